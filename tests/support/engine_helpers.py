"""Driving compose.engine.InProcessEngine in tests: an event sink, and runs to completion
(on the engine's own thread, or step by step on the caller's)."""

from __future__ import annotations

import threading
import time


class Collector:
    """The engine's event sink: tokens by request and position, finish reasons; `done` is set
    once `expected` requests have finished."""

    def __init__(self, expected: int):
        self.tokens: dict[str, dict[int, int]] = {}
        self.finished: dict[str, str] = {}
        self.expected = expected
        self.done = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, events):
        with self.lock:
            for batch in events.values():
                for e in batch:
                    for i, t in enumerate(e.token_ids):
                        self.tokens.setdefault(e.request_id, {})[e.index + i] = t
                    if e.finish_reason:
                        self.finished[e.request_id] = e.finish_reason
            if len(self.finished) >= self.expected:
                self.done.set()


def serve_on_thread(engine, sink: Collector, requests) -> None:
    """Start the engine's thread, submit `requests`, wait until the sink has every finish and
    the scheduler has nothing left (its last update done), then stop the engine."""
    engine.start()
    try:
        for request in requests:
            engine.submit(request)
        assert sink.done.wait(timeout=120), f"finished {len(sink.finished)} of {sink.expected}"
        deadline = time.monotonic() + 10
        while engine.scheduler.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop()


def run_engine(engine, sink: Collector, requests) -> int:
    """Drive the engine's scheduler and runner on this thread, checking the block pool's
    integrity after every step; returns the peak used blocks."""
    for req in requests:
        engine.submit(req)
    engine._drain_inbox()
    sched, peak = engine.scheduler, 0
    while sched.has_work():
        step = sched.schedule()
        assert step is not None
        out = engine.runner.step(step)
        sink(out.events)
        sched.update(step, out.result)
        sched.check_integrity()
        peak = max(peak, sched.kv.num_blocks - sched.kv.num_free_blocks)
    return peak


def assert_greedy_matches_transformers(model_dir, cases, sink: Collector) -> None:
    """Each request `r<i>` of `cases` ((prompt, max_tokens) pairs) got, in `sink`, exactly the
    tokens transformers' greedy generate() gives for it (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, (prompt, max_tokens) in enumerate(cases):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected = out[0, len(prompt):].tolist()
        got = [sink.tokens[f"r{i}"][k] for k in sorted(sink.tokens[f"r{i}"])]
        assert got == expected, f"request {i}"
