"""Prompt tokens served from the prefix cache, as the client's usage reports them (vLLM's
num_cached_tokens): decided when the scheduler first admits a request (RequestQueues.admit_head),
carried on NewRequestData.num_cached_tokens, published by the worker on the event of the
request's first output token (TokenEvent.num_cached_tokens). The scheduler against the fake
worker, then the real model through the in-process engine. The gateway's side:
test_gateway_cached_tokens.py; through the stack: test_e2e_cached_tokens.py."""

from __future__ import annotations

import time

import msgspec

from tests.support.prefix_cache_helpers import BS, P, request
from proto.messages import NewRequest, SamplingParams, TokenEvent
from tests.support.scheduler_harness import Harness, make_request


def new_requests(h: Harness) -> dict[str, list]:
    """Every NewRequestData each request was sent as, in step order."""
    out: dict[str, list] = {}
    for step in h.steps:
        for new in step.new_requests:
            out.setdefault(new.request_id, []).append(new)
    return out


def test_the_first_admission_reports_its_block_aligned_hit():
    h = Harness(num_blocks=16, block_size=BS)
    h.add(request("a", P[:10], 3, arrival=0))
    h.run()  # blocks of P[:4], P[4:8] cached (the third holds a's outputs)
    h.add(request("b", P + [1, 2], 3, arrival=1))
    h.run()
    sent = new_requests(h)
    assert [n.num_cached_tokens for n in sent["a"]] == [0]  # nothing cached yet
    [b] = sent["b"]
    assert b.num_cached_tokens == b.num_computed_tokens == 2 * BS
    assert h.sched.stats().prefix_cache_hits == 2 * BS


def test_a_whole_cached_prompt_still_computes_its_last_token():
    h = Harness(num_blocks=16, block_size=BS)
    h.add(request("a", P[:8], 3, arrival=0))
    h.run()
    h.add(request("b", P[:8], 3, arrival=1))  # both its blocks cached; its last token is computed again
    h.run()
    [b] = new_requests(h)["b"]
    assert b.num_cached_tokens == BS < len(P[:8])


def test_a_preempted_request_keeps_the_count_of_its_first_admission():
    # As test_prefix_cache_scheduler's: 6 blocks of 4, b (the later arrival) is preempted and
    # resumes from its own cached blocks (8 tokens); its first admission found x's one block.
    a, b = make_request("a", 8, 8, arrival=0), make_request("b", 8, 8, arrival=1)
    x = msgspec.structs.replace(b, request_id="x", prompt_token_ids=b.prompt_token_ids[:BS + 1],
                                arrival_time=-1.0, sampling=SamplingParams(max_tokens=1, temperature=0.0))
    h = Harness(num_blocks=6, block_size=BS)
    h.add(x)
    h.run()
    h.add(a, b)
    h.run()
    assert h.sched.stats().num_preemptions == 1
    first, resumed = new_requests(h)["b"]
    assert first.num_computed_tokens == first.num_cached_tokens == BS
    assert resumed.num_computed_tokens == 2 * BS  # a larger hit, its own blocks: not the client's
    assert resumed.num_cached_tokens == BS


def test_forked_children_carry_their_parents_count_once():
    h = Harness(num_blocks=32, block_size=BS)
    h.add(request("a", P[:10], 2, arrival=0))
    h.run()
    parent = msgspec.structs.replace(request("p", P + [1, 2, 3], 4, arrival=1), n=3)
    h.add(parent)
    h.run()
    sent = new_requests(h)
    assert [n.num_cached_tokens for n in sent["p"]] == [2 * BS]
    assert {rid: [n.num_cached_tokens for n in sent[rid]] for rid in ("p/0", "p/1", "p/2")} == {
        "p/0": [2 * BS], "p/1": [2 * BS], "p/2": [2 * BS]}


def test_no_hit_is_reported_without_a_lookup():
    h = Harness(num_blocks=16, block_size=BS)
    h.add(request("a", P[:10], 2, arrival=0))
    h.run()
    h.add(request("b", P[:10], 2, arrival=1, prompt_logprobs=0))  # needs every prompt logit
    h.run()
    [b] = new_requests(h)["b"]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (0, 0)
    off = Harness(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    off.add(request("a", P[:10], 2, arrival=0))
    off.run()
    off.add(request("b", P[:10], 2, arrival=1))
    off.run()
    [b] = new_requests(off)["b"]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (0, 0)


def test_a_rerouted_request_keeps_its_count():
    h = Harness(num_blocks=16, block_size=BS)
    h.add(request("a", P[:10], 2, arrival=0))
    h.run()
    h.add(request("b", P + [1, 2], 6, arrival=1))
    h.step()  # b admitted with a hit of 8, then its worker is lost
    [state] = h.sched.drain()
    assert state.num_cached_tokens == 2 * BS
    other = Harness(num_blocks=16, block_size=BS)  # nothing cached there
    assert other.sched.add_state(state) is None
    other.run()
    [b] = new_requests(other)["b"]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (0, 2 * BS)


# -- the worker: the real model through the in-process engine ---------------------------------


class Events:
    """The engine's event sink, keeping every event."""

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []

    def __call__(self, events: dict[str, list[TokenEvent]]) -> None:
        self.events.extend(e for batch in events.values() for e in batch)

    def of(self, request_id: str) -> list[TokenEvent]:
        return [e for e in self.events if e.request_id == request_id]


def test_the_worker_publishes_the_count_with_the_first_token_only(tiny_model_dir):
    from compose.engine import EngineConfig, InProcessEngine
    from tests.support.engine_helpers import run_engine
    from worker_svc.config import RunnerConfig

    sink = Events()
    engine = InProcessEngine(EngineConfig(runner=RunnerConfig(model=str(tiny_model_dir), num_blocks=64)), sink)
    bs = engine.info.block_size
    prompt = [(13 * i + 5) % 900 + 3 for i in range(2 * bs + 8)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def req(rid: str, ids: list[int], n: int = 1) -> NewRequest:
        return NewRequest(rid, ids, params, "c", time.time(), n=n)

    run_engine(engine, sink, [req("a", prompt)])  # 2 full blocks cached
    shared = prompt[:2 * bs + 4] + [7, 8, 9]
    run_engine(engine, sink, [req("b", shared), req("c", shared, n=2)])
    assert all(e.num_cached_tokens == 0 for e in sink.of("a"))
    for rid in ("b", "c/0", "c/1"):
        events = [e for e in sink.of(rid) if e.token_ids]
        assert [e.index for e in events] == [0, 1, 2, 3]
        assert [e.num_cached_tokens for e in events] == [2 * bs, 0, 0, 0], rid
    assert not sink.of("c")  # the parent publishes nothing (no prompt logprobs asked)
