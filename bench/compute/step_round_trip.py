"""What one step's round trip on a worker's Steps stream costs the scheduler's process in CPU.

    python bench/compute/step_round_trip.py                     # 8 streams, 8 requests a step, 3 rounds
    python bench/compute/step_round_trip.py --modes aio,loop --rounds 5
    GRPC_EXPERIMENTS=-event_engine_client python bench/compute/step_round_trip.py --modes aio

A stand-in worker (a subprocess) serves `Worker.Steps` over gRPC, and the same exchange on a
plain TCP port: for each StepRequest it returns a StepResult with one SampledToken per
scheduled request. The caller drives `--streams` streams at once, as a scheduler drives its
workers: write a step of `--seqs` requests (their ids, computed tokens and scheduled tokens,
as a decode step carries them), read its result, wait `--pause-ms`, again. Each measurement
runs in a fresh process and reports that process's CPU (every thread: the event loop's and
gRPC's own) per round trip:

* `aio`: grpc.aio, a write and a read a step (scheduler_svc/step_loop.py's way);
* `thread`: the blocking stub: gRPC's own thread sends each step from a queue, and one thread
  a stream reads the results and hands each to the event loop;
* `tcp`: the same messages, length-prefixed, on a bare asyncio TCP connection a stream (what
  the transport would cost without gRPC's machinery);
* `loop`: the same pacing and step building without a transport (the loop's own cost, the floor).

Modes run in turn within a round, `--rounds` times; the medians are printed (and `--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

import grpc  # noqa: E402

from compose.launcher import free_port  # noqa: E402
from proto import worker_pb2, worker_pb2_grpc  # noqa: E402
from proto.grpc_options import GRPC_OPTIONS  # noqa: E402

MODES = ("aio", "thread", "tcp", "loop")
MEASURE_TIMEOUT_S = 600  # one measurement's process, at most


def stand_in_result(step: worker_pb2.StepRequest) -> worker_pb2.StepResult:
    result = worker_pb2.StepResult(step_id=step.step_id, execute_seconds=0.001)
    for rid in step.num_scheduled_tokens:
        result.sampled.add(request_id=rid, token_id=7)
    return result


class EchoWorker(worker_pb2_grpc.WorkerServicer):
    async def Steps(self, request_iterator, context):
        async for step in request_iterator:
            yield stand_in_result(step)


async def _tcp_steps(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The Steps exchange on a plain connection: 4-byte little-endian length, then the message."""
    try:
        while True:
            step = worker_pb2.StepRequest.FromString(await _read_frame(reader))
            writer.write(_frame(stand_in_result(step).SerializeToString()))
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "little") + payload


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    return await reader.readexactly(int.from_bytes(await reader.readexactly(4), "little"))


async def serve(grpc_port: int, tcp_port: int) -> None:
    await asyncio.start_server(_tcp_steps, "127.0.0.1", tcp_port)  # first: gRPC answering means both do
    server = grpc.aio.server(options=GRPC_OPTIONS)
    worker_pb2_grpc.add_WorkerServicer_to_server(EchoWorker(), server)
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()
    await server.wait_for_termination()


def make_step(step_id: int, seqs: int) -> worker_pb2.StepRequest:
    step = worker_pb2.StepRequest(step_id=step_id)
    for i in range(seqs):
        rid = f"chatcmpl-{i:032x}"
        step.cached_requests.add(request_id=rid, num_computed_tokens=600 + step_id)
        step.num_scheduled_tokens[rid] = 1
    return step


async def measure(mode: str, port: int, streams: int, steps: int, seqs: int, pause_s: float) -> float:
    """CPU µs of this process per round trip over `streams` x `steps` steps (after a warm-up)."""
    loop = asyncio.get_running_loop()
    target = f"127.0.0.1:{port}"
    channels: list = []
    connections: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    if mode == "aio":
        channels = [grpc.aio.insecure_channel(target, options=GRPC_OPTIONS) for _ in range(streams)]
        calls = [worker_pb2_grpc.WorkerStub(channel).Steps() for channel in channels]

        async def drive(k: int, n: int) -> None:
            for i in range(n):
                await calls[k].write(make_step(i, seqs))
                await calls[k].read()
                await asyncio.sleep(pause_s)
    elif mode == "thread":
        channels = [grpc.insecure_channel(target, options=GRPC_OPTIONS) for _ in range(streams)]
        blocking = [BlockingStream(channel, loop) for channel in channels]

        async def drive(k: int, n: int) -> None:
            for i in range(n):
                await blocking[k].round_trip(make_step(i, seqs))
                await asyncio.sleep(pause_s)
    elif mode == "tcp":
        connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(streams)]

        async def drive(k: int, n: int) -> None:
            reader, writer = connections[k]
            for i in range(n):
                writer.write(_frame(make_step(i, seqs).SerializeToString()))
                worker_pb2.StepResult.FromString(await _read_frame(reader))
                await asyncio.sleep(pause_s)
    else:
        async def drive(k: int, n: int) -> None:
            for i in range(n):
                make_step(i, seqs).SerializeToString()
                await asyncio.sleep(pause_s)
    await asyncio.gather(*(drive(k, max(steps // 10, 5)) for k in range(streams)))  # warm-up
    start = time.process_time()
    await asyncio.gather(*(drive(k, steps) for k in range(streams)))
    cpu = time.process_time() - start
    for _, writer in connections:
        writer.close()
    for channel in channels:
        closed = channel.close()
        if closed is not None:  # an aio channel's close is a coroutine
            await closed
    return 1e6 * cpu / (streams * steps)


class BlockingStream:
    """One Steps call on the blocking stub: steps go into its request iterator (gRPC's own
    thread sends them); this class's thread reads the results, resolving the oldest waiting
    future with each; once the call breaks, every waiting and later round trip fails."""

    def __init__(self, channel: grpc.Channel, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[asyncio.Future] = deque()
        self._broken: RuntimeError | None = None  # set (on the loop's thread) once the call broke
        self._results = worker_pb2_grpc.WorkerStub(channel).Steps(iter(self._outbox.get, None))
        threading.Thread(target=self._read, daemon=True).start()

    async def round_trip(self, step: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        if self._broken is not None:
            raise self._broken
        done = self._loop.create_future()
        self._waiting.append(done)  # before the step goes: its result may come at once
        self._outbox.put(step)
        return await done

    def _read(self) -> None:
        try:
            for result in self._results:
                self._loop.call_soon_threadsafe(self._waiting.popleft().set_result, result)
        except grpc.RpcError as exc:
            try:
                self._loop.call_soon_threadsafe(self._fail, exc)
            except RuntimeError:  # the loop is closed: the measurement ended, its channel with it
                pass

    def _fail(self, exc: grpc.RpcError) -> None:
        self._broken = RuntimeError(f"the Steps call broke: {exc}")
        while self._waiting:
            self._waiting.popleft().set_exception(self._broken)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--streams", type=int, default=8, help="streams driven at once (workers)")
    p.add_argument("--steps", type=int, default=1000, help="steps measured on each stream")
    p.add_argument("--seqs", type=int, default=8, help="requests a step")
    p.add_argument("--pause-ms", type=float, default=2.0, help="wait after each result (the step's time)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the report here")
    p.add_argument("--serve", help=argparse.SUPPRESS)  # the stand-in worker's ports: gRPC,TCP
    p.add_argument("--measure", help=argparse.SUPPRESS)  # one measurement: mode:port
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(serve(*map(int, args.serve.split(","))))
        return {}
    if args.measure:
        mode, port = args.measure.split(":")
        print(asyncio.run(measure(mode, int(port), args.streams, args.steps, args.seqs, args.pause_ms / 1e3)))
        return {}
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}")
    ports = {"aio": free_port(), "tcp": free_port()}
    ports["thread"] = ports["loop"] = ports["aio"]
    me = [sys.executable, str(Path(__file__).resolve())]
    server = subprocess.Popen([*me, "--serve", f"{ports['aio']},{ports['tcp']}"])
    try:
        _wait_for(ports["aio"], server)
        rounds: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else reversed(modes):
                out = subprocess.run([*me, "--measure", f"{mode}:{ports[mode]}", "--streams", str(args.streams),
                                      "--steps", str(args.steps), "--seqs", str(args.seqs),
                                      "--pause-ms", str(args.pause_ms)], stdout=subprocess.PIPE, text=True,
                                     check=True, timeout=MEASURE_TIMEOUT_S)
                rounds[mode].append(float(out.stdout.strip().splitlines()[-1]))
    finally:
        server.kill()
        server.wait()
    report = {"streams": args.streams, "seqs": args.seqs, "pause_ms": args.pause_ms,
              "us_per_round_trip": {m: round(statistics.median(v), 1) for m, v in rounds.items()},
              "rounds": rounds}
    for mode in modes:
        print(f"{mode:7s} median {report['us_per_round_trip'][mode]:7.1f} µs CPU a round trip  "
              f"({', '.join(f'{v:.1f}' for v in rounds[mode])})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


def _wait_for(port: int, server: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Until the stand-in worker answers on `port`; raises if it exits or stays silent."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        ready = grpc.channel_ready_future(channel)
        deadline = time.monotonic() + timeout_s
        while server.poll() is None and time.monotonic() < deadline:
            try:
                return ready.result(timeout=0.5)
            except grpc.FutureTimeoutError:
                continue
        raise RuntimeError(f"the stand-in worker {'exited' if server.poll() is not None else 'did not answer'}")
    finally:
        channel.close()


if __name__ == "__main__":
    main()
