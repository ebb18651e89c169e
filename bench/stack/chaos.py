"""Chaos: a mixed load against a whole local stack while one fault at a time is injected.

    python bench/stack/chaos.py --model models/small --out docs/chaos.md
    python bench/stack/chaos.py --model DIR --faults kill-worker,kill-scheduler --requests 6
    python bench/stack/chaos.py --model models/gemma3-vision-small --faults kill-encoder,kill-only-encoder --requests 0

The stack is the launcher's (`pagedserve up`): its own redis-server (no persistence), two workers
(`--drain-timeout 10`), two schedulers (one leads, one stands by; with `--shards 2` each leads a
shard and one worker), the gateway; the launcher restarts whatever dies (`Stack.supervise`, on a
thread here). Each round sends the same load: streamed and not, greedy and sampled at temperature
0.8 with seeds, unseeded sampled ones, `n = 2`, and JSON-schema chat requests -- every completion
with `ignore_eos` and a fixed `max_tokens`, so its length is known. The first round has no fault
and is the reference; every later round injects its fault once tokens flow in every stream:

  kill-worker       SIGKILL a worker
  sigterm-worker    SIGTERM a worker (it drains), restarted after it exits
  sigstop-worker    SIGSTOP a worker past its registration TTL (8 s), then SIGCONT
  kill-scheduler    SIGKILL the scheduler holding the lease (of shard 0: the standby, or
                    with --shards 2 the other scheduler, takes it over; restarted, it takes
                    its share back)
  restart-redis     SIGKILL redis-server; the launcher starts it again (empty)
  redis-outage      SIGSTOP redis-server for 4 s, then SIGCONT
  rolling-restart   SIGTERM every worker in turn, each restarted and serving again
                    before the next
  kill-encoder      (vision) two encoders; SIGKILL one once it has encoded a batch of the
                    round (the other takes its jobs after their --claim-ttl-s)
  kill-only-encoder (vision) the same with one encoder: the workers encode what it left
A killed encoder stays down (encoder faults are not in the default --faults). Image requests
(8 a round with encoders): greedy chats, streamed and not, with --images-per-request JPEG
frames inline; each round the same pictures, tagged with the round in a JPEG comment: new
bytes (new to the stack, which keys media by their hash), the same pixels, so the same
answers. Who encoded them: bench/cameras/encoder_fleet.py `who_encoded`.

Per fault: requests sent; completed (whole, as expected); failed with a clear error (an
HTTP error or an SSE error event, with a message); lost (completed short, or a stream that
ended without a finish reason); hung (no answer within --bound-s); token sequences that
differ from the reference run (duplicated, skipped or changed tokens of greedy and seeded
requests); and the errors' messages. Between rounds it waits for /health/ready.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import redis

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from bench.cameras import encoder_fleet as enc  # noqa: E402  (the encoders of a stack)
from compose.launcher import Stack, StackConfig, free_port  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@dataclass(frozen=True)
class Ask:
    """One request of the load."""

    key: str
    stream: bool
    temperature: float
    seed: int | None
    n: int = 1
    json_schema: bool = False
    images: int = 0  # a chat request with this many camera frames (greedy)

    @property
    def comparable(self) -> bool:
        """Its output is fixed (greedy or seeded): it must equal the reference run's."""
        return self.temperature == 0 or self.seed is not None


@dataclass
class Outcome:
    kind: str  # completed | error | lost | hung
    tokens: list[list[int]] = field(default_factory=list)  # per choice
    texts: list[str] = field(default_factory=list)
    message: str = ""


def load(requests: int, image_requests: int = 0, images: int = 2) -> list[Ask]:
    kinds = [
        lambda i: Ask(f"stream-seeded-{i}", True, 0.8, 100 + i),
        lambda i: Ask(f"greedy-{i}", False, 0.0, None),
        lambda i: Ask(f"stream-greedy-{i}", True, 0.0, None),
        lambda i: Ask(f"n2-seeded-{i}", False, 0.8, 200 + i, n=2),
        lambda i: Ask(f"stream-unseeded-{i}", True, 1.0, None),
        lambda i: Ask(f"json-seeded-{i}", False, 0.8, 300 + i, json_schema=True),
    ]
    asks = [kinds[i % len(kinds)](i) for i in range(requests)]
    return asks + [Ask(f"image-{i}", i % 2 == 0, 0.0, None, images=images) for i in range(image_requests)]




async def ask(client: openai.AsyncOpenAI, model: str, a: Ask, max_tokens: int, bound_s: float,
              started: asyncio.Event, frames: list[bytes] = ()) -> Outcome:
    try:
        return await asyncio.wait_for(_ask(client, model, a, max_tokens, started, frames), bound_s)
    except TimeoutError:
        return Outcome("hung", message=f"no answer in {bound_s:g} s")
    except openai.APITimeoutError:
        return Outcome("hung", message="the client timed out")
    except openai.APIError as exc:
        return Outcome("error", message=str(exc)[:160])


async def _ask(client, model: str, a: Ask, max_tokens: int, started: asyncio.Event, frames) -> Outcome:
    extra = {"ignore_eos": True, "return_token_ids": True}
    common = dict(model=model, max_tokens=max_tokens, temperature=a.temperature, n=a.n, extra_body=extra)
    if a.seed is not None:
        common["seed"] = a.seed
    if a.json_schema or a.images:
        parts = [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(f).decode()}}
                 for f in frames]
        common["messages"] = [{"role": "user", "content": [*parts, {"type": "text", "text": f"{a.key}: what is ahead?"}]
                               if a.images else "A person as JSON."}]
        if a.json_schema:
            common["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        if not a.stream:
            reply = await client.chat.completions.create(**common)
            started.set()
            tokens = [c.model_extra.get("token_ids") or [] for c in reply.choices]
            whole = a.json_schema or all(len(t) == max_tokens for t in tokens)
            return Outcome("completed" if whole else "lost", tokens=tokens,
                           texts=[c.message.content or "" for c in reply.choices])
        tokens, text, reason = [], [], None  # a streamed chat: n = 1
        async for chunk in await client.chat.completions.create(stream=True, **common):
            for c in chunk.choices:
                tokens.extend((c.model_extra or {}).get("token_ids") or [])
                text.append(c.delta.content or "")
                reason = c.finish_reason or reason
            if len(tokens) >= 3:
                started.set()
        whole = reason is not None and len(tokens) == max_tokens
        return Outcome("completed" if whole else "lost", tokens=[tokens], texts=["".join(text)])
    prompt = [11 + len(a.key), 23, 37, 41 + len(a.key) % 7]
    if not a.stream:
        reply = await client.completions.create(prompt=prompt, **common)
        started.set()
        tokens = [c.model_extra["token_ids"] for c in sorted(reply.choices, key=lambda c: c.index)]
        kind = "completed" if all(len(t) == max_tokens for t in tokens) else "lost"
        return Outcome(kind, tokens=tokens)
    chunks = await client.completions.create(prompt=prompt, stream=True, **common)
    tokens: list[list[int]] = [[] for _ in range(a.n)]
    reasons: list[str | None] = [None] * a.n
    async for chunk in chunks:
        for c in chunk.choices:
            tokens[c.index].extend(c.token_ids or [])
            reasons[c.index] = c.finish_reason or reasons[c.index]
            if len(tokens[c.index]) >= 3:
                started.set()
    whole = all(r is not None for r in reasons) and all(len(t) == max_tokens for t in tokens)
    return Outcome("completed" if whole else "lost", tokens=tokens)


# ---- faults -------------------------------------------------------------------------------

def _leader(stack: Stack) -> str:
    """The process name of the scheduler holding the lease."""
    import socket

    value = redis.Redis.from_url(stack.redis_url).get(stack.keys.scheduler_lease).decode()
    consumer = value.rpartition(":")[0]
    first = f"scheduler-{socket.gethostname()}"
    return "scheduler" if consumer == first else f"scheduler-{consumer.removeprefix(first + '-')}"


def _wait_registered(stack: Stack, name: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while name not in stack.live_worker_ids():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not register again")
        time.sleep(0.2)


def _send(stack: Stack, name: str, sig: int) -> None:
    stack.procs[name].send_signal(sig)


def _pause(stack: Stack, name: str, seconds: float) -> None:
    _send(stack, name, signal.SIGSTOP)
    time.sleep(seconds)
    _send(stack, name, signal.SIGCONT)


def _rolling_restart(stack: Stack) -> None:
    for name in sorted(n for n in stack.procs if n.startswith("worker")):
        proc = stack.procs[name]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        time.sleep(0.5)  # the supervisor starts it again
        _wait_registered(stack, name)
        wait_ready(stack)  # driven by the scheduler again before the next one goes


# Each fault, run on a thread once tokens flow in every stream.
INJECT: dict[str, Callable[[Stack], None]] = {
    "kill-worker": lambda stack: _send(stack, "worker-0", signal.SIGKILL),
    "sigterm-worker": lambda stack: _send(stack, "worker-0", signal.SIGTERM),
    "sigstop-worker": lambda stack: _pause(stack, "worker-0", 8.0),  # past the registration TTL
    "kill-scheduler": lambda stack: _send(stack, _leader(stack), signal.SIGKILL),
    "restart-redis": lambda stack: _send(stack, "redis", signal.SIGKILL),
    "redis-outage": lambda stack: _pause(stack, "redis", 4.0),
    "rolling-restart": _rolling_restart,
}
FAULTS = tuple(INJECT)
ENCODER_FAULTS = {"kill-encoder": 2, "kill-only-encoder": 1}  # → the encoders alive when it strikes


# ---- rounds ---------------------------------------------------------------------------------

def wait_ready(stack: Stack, timeout: float = 120.0) -> None:
    url = f"http://{stack.config.host}:{stack.config.port}/health/ready"
    deadline = time.monotonic() + timeout
    while True:
        try:
            ready = httpx.get(url, timeout=5)
            if ready.status_code == 200 and len(ready.json()["workers"]) == stack.config.workers:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the stack is not ready")
        time.sleep(0.3)


def run_round(stack: Stack, asks: list[Ask], inject: Callable[[Stack], None] | None, max_tokens: int,
              bound_s: float, frames: dict[str, list[bytes]] | None = None,
              at_once: bool = False) -> dict[str, Outcome]:
    """The load once; `inject` on a thread once tokens flow in every stream (`at_once`: at once)."""
    async def main():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                      timeout=bound_s + 5) as client:
            started = {a.key: asyncio.Event() for a in asks}
            tasks = {a.key: asyncio.create_task(ask(client, stack.served_model_name, a, max_tokens, bound_s,
                                                    started[a.key], (frames or {}).get(a.key, [])))
                     for a in asks}

            async def flowing(key: str) -> None:  # its tokens flow, or it already ended
                waiter = asyncio.create_task(started[key].wait())
                try:
                    await asyncio.wait([waiter, tasks[key]], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()

            injected = None
            if inject is not None:
                if not at_once:  # once tokens flow in every stream: all of the load is in flight
                    await asyncio.gather(*(flowing(a.key) for a in asks if a.stream))
                injected = asyncio.create_task(asyncio.to_thread(inject, stack))
            results = {key: await task for key, task in tasks.items()}
            if injected is not None:
                await injected
            return results

    return asyncio.run(main())


@dataclass
class Row:
    fault: str
    sent: int
    counts: Counter
    differs: int
    messages: list[str]
    images: int = 0  # distinct images sent
    encoded: dict[str, int] = field(default_factory=dict)  # process → images it encoded
    missing: int = 0  # images neither published by an encoder nor encoded by a worker
    unfinished_at_kill: int | None = None  # encode jobs not done when the encoder was killed

    def cells(self) -> list[str]:
        c = self.counts
        cells = [self.fault, str(self.sent), str(c["completed"]), str(c["error"]), str(c["lost"]),
                 str(c["hung"]), str(self.differs)]
        who = ", ".join(f"{k} {v}" for k, v in self.encoded.items() if v) or "none"
        kill = "" if self.unfinished_at_kill is None else f" ({self.unfinished_at_kill} jobs unfinished at the kill)"
        return cells + [f"{self.images - self.missing}/{self.images}{kill}: {who}" if self.images else "-"]


def score(fault: str, asks: list[Ask], got: dict[str, Outcome], reference: dict[str, Outcome]) -> Row:
    counts = Counter(o.kind for o in got.values())
    differs = 0
    for a in asks:
        o, ref = got[a.key], reference.get(a.key)
        if o.kind == "completed" and a.comparable and ref is not None and ref.kind == "completed":
            if (o.tokens, o.texts) != (ref.tokens, ref.texts):
                differs += 1
    messages = sorted({o.message for o in got.values() if o.message})
    return Row(fault, len(asks), counts, differs, messages)


def table(rows: list[Row]) -> str:
    head = ["fault", "sent", "completed", "failed, clear error", "lost", "hung", "differ from fault-free",
            "images encoded (by whom)"]
    width = len(head) if any(r.images for r in rows) else len(head) - 1
    lines = ["| " + " | ".join(head[:width]) + " |", "|" + "---|" * width]
    lines += ["| " + " | ".join(r.cells()[:width]) + " |" for r in rows]
    for r in rows:
        for m in r.messages:
            lines.append(f"\n{r.fault}: {m}")
    return "\n".join(lines)


def play(stack: Stack, asks: list[Ask], fault: str, tag: str, args, reference: dict | None) -> tuple[Row, dict]:
    """One round of `fault` ("none": the reference), scored; its outcomes."""
    inject, victim, seen = INJECT.get(fault), None, {}
    if fault in ENCODER_FAULTS:
        victim = enc.set_encoders(stack, ENCODER_FAULTS[fault])[0]
    enc.wait_drained(stack)
    frames = enc.round_frames([(a.key, a.images) for a in asks if a.images], f"chaos-{tag}", *args.image_size)
    hashes = list(dict.fromkeys(enc.digest(f) for fs in frames.values() for f in fs))
    fp = enc.fingerprint(stack) if hashes and stack.live_encoder_ids() else None
    before = enc.encoded_counts(stack) if hashes else {}
    if victim is not None:
        inject = functools.partial(enc.kill_after_batch, victim=victim, before=before, seen=seen)
    got = run_round(stack, asks, inject, args.max_tokens, args.bound_s, frames, at_once=victim is not None)
    row = score(fault, asks, got, reference or got)
    if hashes:
        (row.encoded, row.missing), row.images = enc.who_encoded(stack, fp, hashes, before, victim), len(hashes)
        row.unfinished_at_kill = seen.get("unfinished")
    return row, got


def main(argv: list[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help="comma-separated, from: " + ", ".join([*FAULTS, *ENCODER_FAULTS]))
    p.add_argument("--requests", type=int, default=12, help="requests per round")
    p.add_argument("--encoders", type=int, help="encoders at the start (default: 2 with an encoder fault, else 0)")
    p.add_argument("--image-requests", type=int, help="image requests per round (default: 8 with encoders)")
    p.add_argument("--images-per-request", type=int, default=2)
    p.add_argument("--image-size", type=lambda v: tuple(map(int, v.split("x"))), default=(160, 120), help="WxH")
    p.add_argument("--encoder-arg", action="append", default=[], help="extra flag for every encoder")
    p.add_argument("--shards", type=int, default=1, help="scheduler shards (2: each scheduler leads one)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--bound-s", type=float, default=120.0, help="a request without an answer by then is hung")
    p.add_argument("--run-dir", help="logs of every process (default: a temporary folder)")
    p.add_argument("--out", help="write the table (markdown) here too")
    args = p.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    if unknown := [f for f in faults if f not in INJECT and f not in ENCODER_FAULTS]:
        p.error(f"unknown fault(s): {', '.join(unknown)}")
    encoders = args.encoders if args.encoders is not None else 2 * any(f in ENCODER_FAULTS for f in faults)
    image_requests = args.image_requests if args.image_requests is not None else 8 * bool(encoders)
    asks = load(args.requests, image_requests, args.images_per_request)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="chaos-"))
    config = StackConfig(model=args.model, port=free_port(), workers=2, schedulers=2, run_dir=run_dir,
                         worker_args=("--threads", "1", "--drain-timeout", "10"), startup_timeout_s=300,
                         scheduler_args=("--shards", str(args.shards)),
                         encoder_args=("--threads", "1", *args.encoder_arg))
    rows = []
    with Stack(config) as stack:
        supervising = threading.Event()

        def supervise() -> None:
            while not supervising.wait(0.3):
                stack.supervise()

        supervisor = threading.Thread(target=supervise, name="supervise", daemon=True)
        supervisor.start()
        try:
            enc.set_encoders(stack, encoders)  # from this thread: their parent-death signal follows it
            row, reference = play(stack, asks, "none", "0", args, None)
            rows.append(row)
            for i, fault in enumerate(faults, 1):
                wait_ready(stack)
                rows.append(play(stack, asks, fault, str(i), args, reference)[0])
                print(" | ".join(rows[-1].cells()), flush=True)
        finally:
            supervising.set()
            supervisor.join()
            enc.stop_encoders(stack)  # Stack.stop leaves them
    text = table(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
