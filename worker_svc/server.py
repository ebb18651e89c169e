"""The worker service: a gRPC shell around ModelRunner.

It owns the transport only: the gRPC server (Describe / Step / Health), publishing each
step's TokenEvents to Redis (one PUBLISH per reply channel per step, pipelined), the
registration heartbeat that lets schedulers discover it, and /metrics (each step's
duration, requests and tokens: proto/metrics.py) when a metrics port is given. All compute
is ModelRunner's.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import redis

from proto import worker_pb2, worker_pb2_grpc
from proto.keys import RedisKeys
from proto.messages import TokenEvent, WorkerRegistration, stream_encoder
from proto.metrics import StepCollector, StepRecorder, serve_metrics
from worker_svc.compute_thread import ComputeThread
from worker_svc.config import RunnerConfig
from worker_svc.model_runner import ModelRunner

log = logging.getLogger("pagedserve.worker")


@dataclass(frozen=True)
class WorkerServiceConfig:
    runner: RunnerConfig
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    advertise_host: str | None = None  # the address schedulers dial; default: host
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "pagedserve"
    worker_id: str = field(default_factory=lambda: f"worker-{uuid.uuid4().hex[:8]}")
    heartbeat_interval_s: float = 1.0
    registration_ttl_s: float = 5.0  # the registration expires this long after a death
    metrics_port: int = 0  # /metrics on host:metrics_port; 0 = none


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serialises Steps (the runner holds one batch state) and publishes their events.

    Every step runs on the compute thread that loaded the runner, whichever gRPC thread
    received it (worker_svc/compute_thread.py says why)."""

    def __init__(self, runner: ModelRunner, compute: ComputeThread, publisher: redis.Redis):
        self._runner = runner
        self._compute = compute
        self._publisher = publisher
        self._lock = threading.Lock()
        self.steps = StepRecorder()

    def Describe(self, request, context):
        return self._runner.describe()

    def Health(self, request, context):
        return worker_pb2.HealthReply(ok=True, num_requests=self._runner.num_requests)

    def Step(self, request, context):
        with self._lock:
            start = time.perf_counter()
            try:
                output = self._compute.call(self._runner.step, request)
            except Exception as exc:  # a bad step must not kill the server; the scheduler decides
                log.exception("step %d failed", request.step_id)
                context.abort(grpc.StatusCode.INTERNAL, f"step {request.step_id} failed: {exc}")
            self._publish(output.events)
            output.result.execute_seconds = time.perf_counter() - start
            self.steps.observe(request, output.result.execute_seconds)
            return output.result

    def close(self) -> None:
        """Stop the compute thread (after the gRPC server stopped: no step is running)."""
        self._compute.close()

    def _publish(self, events: dict[str, list[TokenEvent]]) -> None:
        if not events:
            return
        pipe = self._publisher.pipeline(transaction=False)
        for channel, batch in events.items():
            pipe.publish(channel, stream_encoder.encode(batch))
        pipe.execute()


class Registration:
    """Keeps `keys.worker(id)` alive with a TTL while the worker lives; removes it on stop."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, reg: WorkerRegistration,
                 interval_s: float, ttl_s: float):
        self._client, self._keys, self._reg = client, keys, reg
        self._interval_s, self._ttl_ms = interval_s, int(ttl_s * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def _beat(self) -> None:
        # Both, every beat: a scheduler SREMs an id whose key expired (a stalled worker),
        # so a heartbeat that resumes must put the id back as well as the key.
        pipe = self._client.pipeline(transaction=True)
        pipe.set(self._keys.worker(self._reg.worker_id), stream_encoder.encode(self._reg), px=self._ttl_ms)
        pipe.sadd(self._keys.workers, self._reg.worker_id)
        pipe.execute()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._beat()
            except redis.RedisError as exc:  # Redis may come back; the TTL covers the gap
                log.warning("heartbeat failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._client.delete(self._keys.worker(self._reg.worker_id))
            self._client.srem(self._keys.workers, self._reg.worker_id)
        except redis.RedisError:
            pass


def serve(config: WorkerServiceConfig, ready: threading.Event | None = None,
          stop: threading.Event | None = None) -> None:
    """Load the model, start gRPC, register; run until SIGTERM/SIGINT (or `stop` is set)."""
    compute = ComputeThread("step")
    runner = compute.setup(ModelRunner, config.runner, worker_id=config.worker_id)
    info = runner.describe()
    client = redis.Redis.from_url(config.redis_url)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=[("grpc.max_receive_message_length", 64 << 20),
                 ("grpc.max_send_message_length", 64 << 20)],
    )
    servicer = WorkerServicer(runner, compute, client)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    server.start()
    metrics = serve_metrics(StepCollector(config.worker_id, servicer.steps), config.host, config.metrics_port)
    # Bound to every interface (a container): advertise our own address on its network.
    advertise = config.advertise_host or (
        socket.gethostbyname(socket.gethostname()) if config.host == "0.0.0.0" else config.host)
    reg = WorkerRegistration(
        worker_id=config.worker_id, address=f"{advertise}:{port}", model=info.model,
        block_size=info.block_size, num_blocks=info.num_blocks, max_model_len=info.max_model_len,
        started_at=time.time(), num_cpu_blocks=info.num_cpu_blocks,
    )
    registration = Registration(client, RedisKeys(config.key_prefix), reg,
                                config.heartbeat_interval_s, config.registration_ttl_s)
    registration.start()
    log.info("worker %s serving %s on %s: %d blocks of %d tokens, max_model_len %d",
             reg.worker_id, reg.model, reg.address, reg.num_blocks, reg.block_size, reg.max_model_len)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    if ready is not None:
        ready.set()
    stop.wait()
    log.info("worker %s stopping", reg.worker_id)
    registration.stop()  # first, so schedulers stop routing here and re-route what it held
    server.stop(grace=2).wait()
    servicer.close()
    if metrics is not None:
        metrics.close()
    client.close()
