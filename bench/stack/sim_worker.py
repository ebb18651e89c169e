"""Simulated GPU workers: the real worker's gRPC and Redis contract, a sleep for the model.

    python bench/stack/sim_worker.py --redis-url URL --model NAME --count 32 --first 0 \
        --vocab-size 1536 --eos-token-id 0 --step-ms 30 --records out.json

One process hosts `--count` workers (`sim-<first>`, ...), each a grpc.aio server on its own
port, in one asyncio loop. Each is what a scheduler sees of a real worker (worker_svc/
server.py): `Describe` (one full-attention KV cache group; `--device cuda:0`, so the
scheduler plans steps ahead as for a GPU), `Health`, `Step` and the `Steps` stream (results
in order; a step planned after one that failed fails too); registration as `Registration`
(`keys.worker(id)` with a 5 s TTL + SADD `keys.workers`, every second); `fencing_token` as
`_fence` (a lower token refused, a higher one forgets every request); each step's
TokenEvents PUBLISHed per reply channel in one pipeline before its result goes back, the
first output token's event with `num_cached_tokens` (worker_svc/model_runner.py).

Bookkeeping: tests/support/fake_worker.py's FakeWorker applies every step and asserts the Step
contract; `IncrementalFakeWorker` carries its checksums and read checks from step to step
(the same tokens and failures; ~0.2 ms a step at batch 8, 0.7 at 32 on a 2-core VM). A step
the check rejects fails as a real worker's would, its message kept in the records. A
stream starting again at step 1 is a new BatchScheduler (the worker was retired and dialled
again): the bookkeeping starts afresh.

Step time (the forward and sampling replaced, nothing else; bookkeeping inside it):
`step_ms + per_token_ms x tokens + per_seq_ms x sequences`. Defaults for a Llama-3-8B /
Gemma-3-12B class model in bf16 on one H100/H200, whose decode step takes 10-40 ms (this
repo's H200 figures for the 1b preset, docs/benchmarks.md "Decode steps against the
bandwidth": 8.35 ms at batch 1, 11.75 ms at 256): step_ms 30; per_seq_ms 0.02, one
sequence's K/V (~600 tokens x 128 KiB, Llama-3-8B) read at ~3.3 TB/s (the 1b preset's own
slope: 0.013); per_token_ms 0.04, a prefill token's 2 x 8e9 FLOPs at ~400 TFLOP/s.

Records, per worker and step: monotonic start and end (CLOCK_MONOTONIC: one clock for
every process of the machine), tokens, sequences, tokens sampled, whether requests were
left to go on; JSON in `--records` when the process stops (SIGTERM, SIGINT): bench/stack/fleet.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
import zlib
from array import array
from collections import deque
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

import grpc  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from proto import worker_pb2, worker_pb2_grpc  # noqa: E402
from proto.grpc_options import GRPC_OPTIONS  # noqa: E402
from proto.keys import RedisKeys  # noqa: E402
from proto.messages import TokenEvent, WorkerRegistration, stream_encoder  # noqa: E402
from tests.support.fake_worker import FakeWorker  # noqa: E402

ORDER_TIMEOUT_S = 30.0  # as worker_svc/server.py: a step planned ahead waits this long for its predecessor
RECORD_FIELDS = ("start", "end", "tokens", "seqs", "sampled", "pending")


def worker_id(i: int) -> str:
    """The simulated worker of index `i` registers as this."""
    return f"sim-{i}"


@dataclass(frozen=True)
class StepModel:
    step_ms: float = 30.0
    per_token_ms: float = 0.04
    per_seq_ms: float = 0.02

    def seconds(self, tokens: int, seqs: int) -> float:
        return (self.step_ms + self.per_token_ms * tokens + self.per_seq_ms * seqs) / 1000


@dataclass(frozen=True)
class SimSpec:
    model: str  # the served model name the workers register under (the gateway's)
    vocab_size: int  # the checkpoint's: sampled ids stay below it
    eos_token_id: int
    num_blocks: int = 2048
    block_size: int = 16
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048  # as the scheduler's: FakeWorker asserts the budget
    device: str = "cuda:0"  # what Describe says: an accelerator turns on steps planned ahead


class _Track:
    """One request's running checksums: `sums[p]` as fake_worker's _prefix_checksums; the
    CRC of repr(token_ids[:count]) but its closing bracket; positions read back per group."""

    def __init__(self, req) -> None:
        self.req, self.sums, self.crc, self.count, self.verified = req, [], 0, 0, [0] * len(req.block_tables)

    def extend_sums(self) -> list[int]:
        req, sums = self.req, self.sums
        image_at = {p: h.encode() for h, o, n in req.mm_inputs for p in range(o, o + n)}
        crc = sums[-1] if sums else 0
        for pos in range(len(sums), len(req.token_ids)):
            crc = zlib.crc32(req.token_ids[pos].to_bytes(4, "little"), crc)
            if pos in image_at:
                crc = zlib.crc32(image_at[pos], crc)
            sums.append(crc)
        return sums

    def context_token(self, upto: int, vocab_size: int) -> int:
        """zlib.crc32(repr(token_ids[:upto]).encode()) % vocab_size, FakeWorker's token."""
        if upto > self.count:
            piece = ", ".join(map(str, self.req.token_ids[self.count:upto]))
            self.crc = zlib.crc32(((", " if self.count else "[") + piece).encode(), self.crc)
            self.count = upto
        return zlib.crc32(b"]", self.crc if self.count else zlib.crc32(b"[")) % vocab_size


class IncrementalFakeWorker(FakeWorker):
    """FakeWorker whose checksums, read checks and sampled tokens are carried from step to
    step. A position's K/V is read back once after its block table changed: writes only
    reach blocks their writer alone holds (FakeWorker asserts it), so a slot read back
    stays right until a swap-in or block copy, after which every request is read in full."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps = deque(maxlen=1)  # FakeWorker keeps every step for assertions: only the last
        self._tracks: dict[str, _Track] = {}

    def step(self, step: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        stale = [*step.finished_request_ids, *(c.request_id for c in step.cached_requests if c.replace_block_ids)]
        for request_id in list(self._tracks) if step.blocks_to_swap_in or step.blocks_to_copy else stale:
            self._tracks.pop(request_id, None)
        return super().step(step)

    def _track(self, request_id: str, req) -> _Track:
        track = self._tracks.get(request_id)
        if track is None or track.req is not req:
            track = self._tracks[request_id] = _Track(req)
        return track

    def _checksums(self, request_id, req):
        return self._track(request_id, req).extend_sums()

    def _token(self, request_id, req, context):
        if req.mm_inputs:
            return super()._token(request_id, req, context)
        return self._track(request_id, req).context_token(req.num_computed_tokens, self.vocab_size)

    def _read_context(self, request_id, req):
        track = self._track(request_id, req)  # positions verified before are not read again
        req.first_read = [max(first, seen) for first, seen in zip(req.first_read, track.verified)]
        context = super()._read_context(request_id, req)
        track.verified = [req.num_computed_tokens] * len(req.first_read)
        return context


class SimWorker(worker_pb2_grpc.WorkerServicer):
    """One simulated worker: steps queued in order on its own 'compute' task, each applied
    to the bookkeeping, slept to its modelled end, its events published, then answered."""

    def __init__(self, worker_id: str, spec: SimSpec, model: StepModel, client: aioredis.Redis) -> None:
        self.worker_id, self._spec, self._model, self._client = worker_id, spec, model, client
        self.records = {name: array("d") for name in RECORD_FIELDS}
        self.errors: list[str] = []
        self.resets = self.publish_errors = 0
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._order = asyncio.Condition()
        self._last_queued = self._failed = self._fence_token = 0
        self._publishing: asyncio.Future | None = None
        self._reset()
        self._task = asyncio.create_task(self._compute())

    def _reset(self) -> None:
        s = self._spec
        self._fake = IncrementalFakeWorker(s.num_blocks, s.block_size, s.max_num_batched_tokens,
                                           vocab_size=s.vocab_size, eos_token_id=s.eos_token_id)
        self._replies: dict[str, tuple[str, int]] = {}  # request id -> (reply channel, cached tokens)

    async def Describe(self, request, context):
        s = self._spec
        return worker_pb2.WorkerInfo(
            worker_id=self.worker_id, model=s.model, block_size=s.block_size, num_blocks=s.num_blocks,
            max_model_len=s.max_model_len, vocab_size=s.vocab_size, eos_token_ids=[s.eos_token_id],
            device=s.device, kv_cache_group_windows=[0], kv_cache_group_size=1)

    async def Health(self, request, context):
        return worker_pb2.HealthReply(ok=True, num_requests=len(self._fake.requests))

    async def Step(self, request, context):
        try:
            done = await self._queue(request)
        except LookupError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return await self._answer(done, context)

    async def Steps(self, request_iterator, context):
        queued: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    queued.put_nowait(await self._queue(request))
            except Exception as exc:
                queued.put_nowait(exc)
            finally:
                queued.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await queued.get()) is not None:
                if isinstance(item, Exception):  # a step out of order (or the stream broke)
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(item))
                yield await self._answer(item, context)
        finally:
            reader.cancel()

    async def _queue(self, request: worker_pb2.StepRequest) -> asyncio.Future:
        """Queue the step for the compute task, behind the step it was planned after (a
        unary Step may overtake the one it follows)."""
        after = request.after_step_id
        async with self._order:
            if after:
                try:
                    await asyncio.wait_for(self._order.wait_for(lambda: self._last_queued == after), ORDER_TIMEOUT_S)
                except TimeoutError:
                    raise LookupError(f"step {request.step_id} is planned after step {after}, "
                                      "which this worker did not receive") from None
            self._last_queued = request.step_id
            done = asyncio.get_running_loop().create_future()
            self._inbox.put_nowait((request, done))
            self._order.notify_all()
        return done

    async def _answer(self, done: asyncio.Future, context) -> worker_pb2.StepResult:
        try:
            return await done
        except Exception as exc:  # a bad step must not kill the server; the scheduler decides
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    async def _compute(self) -> None:
        """The compute thread's part: one step after the other; a step's events go out
        inline when nothing waits behind it, else beside the next step (in order)."""
        while True:
            request, done = await self._inbox.get()
            try:
                result, events = await self._run(request)
            except Exception as exc:
                self._failed = request.step_id
                if not isinstance(exc, _Chained):
                    self.errors.append(f"step {request.step_id}: {type(exc).__name__}: {exc}"[:500])
                done.set_exception(exc)
                continue
            self._failed = 0
            publish = asyncio.ensure_future(self._publish(self._publishing, events))
            self._publishing = publish
            publish.add_done_callback(lambda _, done=done, result=result: done.done() or done.set_result(result))
            if self._inbox.empty():
                await publish

    async def _run(self, request: worker_pb2.StepRequest):
        token = request.fencing_token
        if token and token < self._fence_token:
            raise PermissionError(f"step {request.step_id}: token {token} below {self._fence_token}")
        if request.after_step_id and request.after_step_id == self._failed:
            raise _Chained(f"step {request.step_id} is planned after step {request.after_step_id}, which failed")
        if (token and token > self._fence_token) or (request.step_id == 1 and not request.after_step_id):
            self.resets += bool(self._fake.requests)
            self._reset()
        self._fence_token = max(self._fence_token, token)
        start = time.monotonic()
        for request_id in request.finished_request_ids:
            self._replies.pop(request_id, None)
        for new in request.new_requests:
            self._replies[new.request_id] = (new.reply_channel, new.num_cached_tokens)
        result = self._fake.step(request)
        tokens, seqs = sum(request.num_scheduled_tokens.values()), len(request.num_scheduled_tokens)
        await asyncio.sleep(max(0.0, start + self._model.seconds(tokens, seqs) - time.monotonic()))
        events: dict[str, list[TokenEvent]] = {}
        for s in result.sampled:
            req, (channel, cached) = self._fake.requests[s.request_id], self._replies[s.request_id]
            index = len(req.token_ids) - req.num_prompt_tokens - 1
            events.setdefault(channel, []).append(TokenEvent(
                request_id=s.request_id, index=index, token_ids=[s.token_id], finish_reason=s.finish_reason or None,
                num_cached_tokens=cached if index == 0 else 0))
        pending = any(not r.finished for r in self._fake.requests.values())
        for name, value in zip(RECORD_FIELDS, (start, time.monotonic(), tokens, seqs, len(result.sampled), pending)):
            self.records[name].append(value)
        return result, events

    async def _publish(self, before: asyncio.Future | None, events: dict[str, list[TokenEvent]]) -> None:
        """worker_svc/event_publisher.py: one PUBLISH per reply channel, one round trip, after
        the step before's publish."""
        if before is not None:
            await asyncio.shield(before)
        if not events:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for channel, batch in events.items():
                pipe.publish(channel, stream_encoder.encode(batch))
            await pipe.execute()
        except (aioredis.RedisError, OSError):
            self.publish_errors += 1

    def summary(self) -> dict:
        return {"worker_id": self.worker_id, "errors": self.errors[:20], "num_errors": len(self.errors),
                "resets": self.resets, "publish_errors": self.publish_errors,
                **{name: values.tolist() for name, values in self.records.items()}}


class _Chained(Exception):
    """A step planned after one that failed (not a failure of its own)."""


async def serve(args: argparse.Namespace) -> None:
    """Start the workers, register them every second until SIGTERM / SIGINT (worker_svc/
    server.py Registration._beat for each), then deregister, stop, write the records."""
    spec = SimSpec(**{f.name: getattr(args, f.name) for f in fields(SimSpec)})
    model = StepModel(**{f.name: getattr(args, f.name) for f in fields(StepModel)})
    keys, client, stop = RedisKeys(args.key_prefix), aioredis.Redis.from_url(args.redis_url), asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    workers, servers, regs = [], [], []
    for i in range(args.first, args.first + args.count):
        workers.append(SimWorker(worker_id(i), spec, model, client))
        servers.append(grpc.aio.server(options=GRPC_OPTIONS))
        worker_pb2_grpc.add_WorkerServicer_to_server(workers[-1], servers[-1])
        port = servers[-1].add_insecure_port("127.0.0.1:0")
        await servers[-1].start()
        regs.append(WorkerRegistration(worker_id=workers[-1].worker_id, address=f"127.0.0.1:{port}", model=spec.model,
                                       block_size=spec.block_size, num_blocks=spec.num_blocks,
                                       max_model_len=spec.max_model_len, started_at=time.time()))
    try:
        while not stop.is_set():
            try:
                for reg in regs:
                    pipe = client.pipeline(transaction=True)
                    pipe.set(keys.worker(reg.worker_id), stream_encoder.encode(reg), px=5000)
                    pipe.sadd(keys.workers, reg.worker_id)
                    await pipe.execute()
            except (aioredis.RedisError, OSError) as exc:  # Redis may come back; the TTL covers the gap
                print(f"sim_worker: heartbeat failed: {exc}", file=sys.stderr)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    finally:
        with contextlib.suppress(aioredis.RedisError, OSError):
            await client.delete(*[keys.worker(r.worker_id) for r in regs])
            await client.srem(keys.workers, *[r.worker_id for r in regs])
        await asyncio.gather(*(s.stop(0.5) for s in servers))
        if args.records:
            Path(args.records).write_text(json.dumps({"args": vars(args), "workers": [w.summary() for w in workers]}))
        await client.aclose()


def build_parser() -> argparse.ArgumentParser:
    """Where Redis is, which workers; then a flag for every SimSpec and StepModel field."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--key-prefix", default="pagedserve")
    p.add_argument("--count", type=int, default=1, help="workers in this process")
    p.add_argument("--first", type=int, default=0, help="index of the first worker (ids sim-<i>)")
    p.add_argument("--records", help="write every worker's step records here (JSON) on stop")
    for f in (*fields(SimSpec), *fields(StepModel)):
        p.add_argument("--" + f.name.replace("_", "-"), type={"int": int, "float": float, "str": str}[f.type],
                       required=f.default is MISSING, default=None if f.default is MISSING else f.default)
    return p


if __name__ == "__main__":
    asyncio.run(serve(build_parser().parse_args()))
