"""Chaos: a mixed load against a whole local stack while one fault at a time is injected.

    python bench/chaos.py --model models/small --out docs/chaos.md
    python bench/chaos.py --model DIR --faults kill-worker,kill-scheduler --requests 6

The stack is the launcher's (`pagedserve up`): its own redis-server (no persistence), two
workers (`--drain-timeout 10`), two schedulers (one leads, one stands by), the gateway;
the launcher restarts whatever dies (`Stack.supervise`, on a thread here). Each round
sends the same load: streamed and not, greedy and sampled at temperature 0.8 with seeds,
unseeded sampled ones, `n = 2`, and JSON-schema chat requests -- every completion with
`ignore_eos` and a fixed `max_tokens`, so its length is known. The first round has no
fault and is the reference; every later round injects its fault once tokens flow in every stream:

  kill-worker       SIGKILL a worker
  sigterm-worker    SIGTERM a worker (it drains), restarted after it exits
  sigstop-worker    SIGSTOP a worker past its registration TTL (8 s), then SIGCONT
  kill-scheduler    SIGKILL the scheduler holding the lease (the standby takes over)
  restart-redis     SIGKILL redis-server; the launcher starts it again (empty)
  redis-outage      SIGSTOP redis-server for 4 s, then SIGCONT
  rolling-restart   SIGTERM every worker in turn, each restarted and serving again
                    before the next

Per fault: requests sent; completed (whole, as expected); failed with a clear error (an
HTTP error or an SSE error event, with a message); lost (completed short, or a stream that
ended without a finish reason); hung (no answer within --bound-s); token sequences that
differ from the reference run (duplicated, skipped or changed tokens of greedy and seeded
requests); and the errors' messages. Between rounds it waits for /health/ready.
"""

from __future__ import annotations

import argparse
import asyncio
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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


def load(requests: int) -> list[Ask]:
    kinds = [
        lambda i: Ask(f"stream-seeded-{i}", True, 0.8, 100 + i),
        lambda i: Ask(f"greedy-{i}", False, 0.0, None),
        lambda i: Ask(f"stream-greedy-{i}", True, 0.0, None),
        lambda i: Ask(f"n2-seeded-{i}", False, 0.8, 200 + i, n=2),
        lambda i: Ask(f"stream-unseeded-{i}", True, 1.0, None),
        lambda i: Ask(f"json-seeded-{i}", False, 0.8, 300 + i, json_schema=True),
    ]
    return [kinds[i % len(kinds)](i) for i in range(requests)]


async def ask(client: openai.AsyncOpenAI, model: str, a: Ask, max_tokens: int, bound_s: float,
              started: asyncio.Event) -> Outcome:
    try:
        return await asyncio.wait_for(_ask(client, model, a, max_tokens, started), bound_s)
    except TimeoutError:
        return Outcome("hung", message=f"no answer in {bound_s:g} s")
    except openai.APITimeoutError:
        return Outcome("hung", message="the client timed out")
    except openai.APIError as exc:
        return Outcome("error", message=str(exc)[:160])


async def _ask(client, model: str, a: Ask, max_tokens: int, started: asyncio.Event) -> Outcome:
    extra = {"ignore_eos": True, "return_token_ids": True}
    common = dict(model=model, max_tokens=max_tokens, temperature=a.temperature, n=a.n)
    if a.seed is not None:
        common["seed"] = a.seed
    if a.json_schema:
        reply = await client.chat.completions.create(
            messages=[{"role": "user", "content": "A person as JSON."}], extra_body=extra,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
            **common)
        started.set()
        texts = [c.message.content or "" for c in reply.choices]
        return Outcome("completed", tokens=[c.model_extra.get("token_ids") or [] for c in reply.choices],
                       texts=texts)
    prompt = [11 + len(a.key), 23, 37, 41 + len(a.key) % 7]
    if not a.stream:
        reply = await client.completions.create(prompt=prompt, extra_body=extra, **common)
        started.set()
        tokens = [c.model_extra["token_ids"] for c in sorted(reply.choices, key=lambda c: c.index)]
        kind = "completed" if all(len(t) == max_tokens for t in tokens) else "lost"
        return Outcome(kind, tokens=tokens)
    chunks = await client.completions.create(prompt=prompt, stream=True, extra_body=extra, **common)
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


def run_round(stack: Stack, asks: list[Ask], fault: str | None, max_tokens: int, bound_s: float) -> dict[str, Outcome]:
    async def main():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                      timeout=bound_s + 5) as client:
            started = {a.key: asyncio.Event() for a in asks}
            tasks = {a.key: asyncio.create_task(ask(client, stack.served_model_name, a, max_tokens, bound_s,
                                                    started[a.key]))
                     for a in asks}

            async def flowing(key: str) -> None:  # its tokens flow, or it already ended
                waiter = asyncio.create_task(started[key].wait())
                try:
                    await asyncio.wait([waiter, tasks[key]], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()

            injected = None
            if fault is not None:  # once tokens flow in every stream: all of the load is in flight
                await asyncio.gather(*(flowing(a.key) for a in asks if a.stream))
                injected = asyncio.create_task(asyncio.to_thread(INJECT[fault], stack))
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

    def cells(self) -> list[str]:
        c = self.counts
        return [self.fault, str(self.sent), str(c["completed"]), str(c["error"]), str(c["lost"]),
                str(c["hung"]), str(self.differs)]


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
    head = ["fault", "sent", "completed", "failed, clear error", "lost", "hung", "differ from fault-free"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    for r in rows:
        for m in r.messages:
            lines.append(f"\n{r.fault}: {m}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, from: " + ", ".join(FAULTS))
    p.add_argument("--requests", type=int, default=12, help="requests per round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--bound-s", type=float, default=120.0, help="a request without an answer by then is hung")
    p.add_argument("--run-dir", help="logs of every process (default: a temporary folder)")
    p.add_argument("--out", help="write the table (markdown) here too")
    args = p.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    asks = load(args.requests)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="chaos-"))
    config = StackConfig(model=args.model, port=free_port(), workers=2, schedulers=2, run_dir=run_dir,
                         worker_args=("--threads", "1", "--drain-timeout", "10"), startup_timeout_s=300)
    rows = []
    with Stack(config) as stack:
        supervising = threading.Event()

        def supervise() -> None:
            while not supervising.wait(0.3):
                stack.supervise()

        supervisor = threading.Thread(target=supervise, name="supervise", daemon=True)
        supervisor.start()
        try:
            reference = run_round(stack, asks, None, args.max_tokens, args.bound_s)
            rows.append(score("none", asks, reference, reference))
            for fault in faults:
                wait_ready(stack)
                got = run_round(stack, asks, fault, args.max_tokens, args.bound_s)
                rows.append(score(fault, asks, got, reference))
                print(" | ".join(rows[-1].cells()), flush=True)
        finally:
            supervising.set()
            supervisor.join()
    text = table(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
