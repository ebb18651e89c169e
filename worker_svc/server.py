"""The worker service: a gRPC shell around ModelRunner.

It owns the transport only: the gRPC server (Describe / Step / Steps / Health, and the
standard `grpc.health.v1.Health` service: SERVING from registration until SIGTERM),
publishing each step's TokenEvents to Redis (one PUBLISH per reply channel per step,
pipelined: worker_svc/event_publisher.py), the registration heartbeat that lets
schedulers discover it, the media store the runner reads images from (the same Redis:
worker_svc/media_source.py), and /metrics (each step's duration, requests and tokens; for
a vision model also the images encoded, encoder-cache hits and encoding time:
proto/metrics.py) when a metrics port is given. All compute is ModelRunner's.

Steps come one at a time (Step) or on the scheduler's stream (Steps) and run one at a time,
in the order they came, on the compute thread. A step planned
ahead (after_step_id) arrives while the step before it runs and waits in the compute
thread's queue, so the thread goes from one step straight into the next. A step's events
go out before its result (a finished request is acknowledged only after its last event
went out; worker_svc/event_publisher.py returns once Redis has answered every PUBLISH),
in step order: from the compute thread itself when no step waits behind it
(no thread to wake), else from a publishing thread while the next step computes.
"""

from __future__ import annotations

import functools
import logging
import queue
import signal
import socket
import threading
import time
import uuid
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import msgspec
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto import worker_pb2, worker_pb2_grpc
from proto.grpc_options import GRPC_OPTIONS
from proto.keys import RedisKeys
from proto.messages import TokenEvent, WorkerRegistration, stream_encoder
from proto.metrics import EncoderRecorder, StepCollector, StepRecorder, serve_metrics
from proto.outage_log import OutageLog
from worker_svc.compute_thread import ComputeThread
from worker_svc.config import RunnerConfig
from worker_svc.event_publisher import EventPublisher
from worker_svc.media_source import RedisMediaSource
from worker_svc.published_embeddings import PublishedEmbeddings
from worker_svc.model_runner import ModelRunner, StepConsistencyError, StepOutput
from worker_svc.step_gap import StepGap

log = logging.getLogger("pagedserve.worker")

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name  # for grpc.health.v1
ORDER_TIMEOUT_S = 30.0  # how long a step planned ahead waits for the step it follows


class StepOrderError(Exception):
    """A step planned after one this worker never received."""


class StaleSchedulerError(Exception):
    """A step from a scheduler whose lease another scheduler has taken since."""


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
    # SIGTERM: registered as draining (no new requests) while running ones finish, for at
    # most this long; then deregistered, and schedulers move what is left elsewhere.
    drain_timeout_s: float = 30.0


class ModelWorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Queues Steps in order on the compute thread (the runner holds one batch state) and
    publishes their events.

    Every step runs on the compute thread that loaded the runner, whichever gRPC thread
    received it (worker_svc/compute_thread.py says why)."""

    def __init__(self, runner: ModelRunner, compute: ComputeThread, publisher: EventPublisher):
        self._runner = runner
        self._compute = compute
        self._publisher = publisher
        self._publishing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")  # FIFO
        self._order = threading.Condition()
        self._last_queued = 0  # id of the last step queued on the compute thread
        self._failed = 0  # id of the last step that failed (compute thread only)
        self._handed_off: Future | None = None  # the last publish handed to _publishing
        self._gap = StepGap()  # compute thread only
        self._publish_outage = OutageLog(log, "Redis out of reach, events kept for the next publish",
                                         "publishing again")
        self._fence_token = 0  # the highest scheduler token seen (compute thread only)
        self.steps = StepRecorder()
        # images encoded and encoder-cache hits: a model that embeds images only
        self.encoder = EncoderRecorder() if runner.vision is not None else None

    def Describe(self, request, context):
        return self._runner.describe()

    def Health(self, request, context):
        return worker_pb2.HealthReply(ok=True, num_requests=self._runner.num_requests)

    def Step(self, request, context):
        try:
            done = self._queue(request)
        except StepOrderError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return self._result(request, done, context)

    def Steps(self, requests, context):
        """The scheduler's stream: each request queued as it arrives (a reader thread, so a
        step planned ahead queues while the one before it runs), each result sent when
        its step is done, in order."""
        queued: queue.SimpleQueue = queue.SimpleQueue()

        def read() -> None:
            try:
                for request in requests:
                    queued.put((request, self._queue(request)))
            except grpc.RpcError:  # the scheduler went away (or the stream was aborted)
                pass
            except Exception as exc:  # a step out of order, or the worker shutting down
                queued.put(exc)
            finally:
                queued.put(None)

        threading.Thread(target=read, name="steps-reader", daemon=True).start()
        while (item := queued.get()) is not None:
            if isinstance(item, Exception):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION if isinstance(item, StepOrderError)
                              else grpc.StatusCode.INTERNAL, str(item))
            yield self._result(*item, context)

    def _queue(self, request: worker_pb2.StepRequest) -> Future:
        """Queue the step on the compute thread, behind the step it was planned after."""
        after = request.after_step_id
        with self._order:
            # Planned ahead: its RPC may overtake the one of the step it follows.
            if after and not self._order.wait_for(lambda: self._last_queued == after, ORDER_TIMEOUT_S):
                raise StepOrderError(f"step {request.step_id} is planned after step {after}, "
                                     f"which this worker did not receive")
            self._last_queued = request.step_id
            done = self._compute.submit(self._run, request)
            self._order.notify_all()
        return done

    def _result(self, request: worker_pb2.StepRequest, done: Future, context) -> worker_pb2.StepResult:
        """The queued step's result, once its events went out; a failed step aborts the call."""
        try:
            output, published = done.result()
            if published is not None:
                published.result()
        except Exception as exc:  # a bad step must not kill the server; the scheduler decides
            log.exception("step %d failed", request.step_id)
            context.abort(grpc.StatusCode.INTERNAL, f"step {request.step_id} failed: {exc}")
        self.steps.observe(request, output.result)
        if output.vision is not None and self.encoder is not None:
            v = output.vision
            self.encoder.observe(v.items_encoded, v.cache_hits, v.seconds, v.published_hits, v.queries)
        return output.result

    def _run(self, request: worker_pb2.StepRequest) -> tuple[StepOutput, Future | None]:
        """On the compute thread: the step, then its events published, or handed to the
        publishing thread (that publish's future) when the next step is queued already."""
        self._fence(request)
        if request.after_step_id and request.after_step_id == self._failed:
            self._failed = request.step_id  # and so on down the queue
            raise StepConsistencyError(
                f"step {request.step_id} is planned after step {request.after_step_id}, which failed")
        try:
            self._gap.start()
            output = self._runner.step(request)
            self._gap.end(request, output.result)
        except Exception:
            self._failed = request.step_id
            raise
        self._failed = 0  # step ids start again at 1 with a new scheduler
        if self._last_queued > request.step_id:  # the next step waits: publish beside it
            self._handed_off = self._publishing.submit(self._publish, output.events)
            return output, self._handed_off
        if self._handed_off is not None:  # an earlier step's events go first
            handed_off, self._handed_off = self._handed_off, None
            handed_off.result()  # if that publish failed, this step fails too, not the ones after
        self._publish(output.events)
        return output, None

    def _fence(self, request: worker_pb2.StepRequest) -> None:
        """On the compute thread, before the step: refuse a scheduler that lost its lease
        (a token below the highest seen); forget every request when a new one takes over."""
        token = request.fencing_token
        if not token:
            return  # not fenced: a tool or test driving this worker directly
        if token < self._fence_token:
            raise StaleSchedulerError(f"step {request.step_id} comes from a scheduler that lost its lease "
                                      f"(token {token}, the current one is {self._fence_token})")
        if token > self._fence_token:
            dropped = self._runner.forget_all()
            if self._fence_token:
                log.warning("a new scheduler (token %d) took over: forgot %d request(s)", token, dropped)
            self._fence_token = token

    def close(self) -> None:
        """Stop the compute and publishing threads (after the gRPC server stopped: no step
        is running)."""
        self._compute.close()
        self._publishing.shutdown(wait=True)
        self._publisher.close()

    def retry_unsent(self) -> None:
        """Send what a publish during a Redis outage kept, on the publishing thread (events
        keep their order): an idle worker has no next publish to carry a finished request's
        last events."""
        if self._publisher.pending:
            self._publishing.submit(self._publish, {})

    def _publish(self, events: dict[str, list[TokenEvent]]) -> None:
        """Redis out of reach does not fail the step (the scheduler would retire this
        healthy worker): the publisher keeps the events and sends them first with the next
        publish. A gateway that lost its subscription meanwhile fails its open requests
        (gateway/backend.py), so nobody waits for events lost in the gap."""
        try:
            self._publisher.publish(events)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._publish_outage.failed(exc)
            return
        self._publish_outage.ok()


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

    def drain(self) -> None:
        """From now on say `draining` (at once, and in every beat)."""
        self._reg = msgspec.structs.replace(self._reg, draining=True)
        try:
            self._beat()
        except redis.RedisError as exc:
            log.warning("could not announce the drain: %s", exc)

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
    media = RedisMediaSource.from_url(config.redis_url, config.key_prefix)
    runner = compute.setup(ModelRunner, config.runner, worker_id=config.worker_id, media=media,
                           published=functools.partial(PublishedEmbeddings.for_encoder, media.client, media.keys))
    info = runner.describe()
    client = redis.Redis.from_url(config.redis_url)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),  # a Steps stream holds one for its life
        options=GRPC_OPTIONS,
    )
    servicer = ModelWorkerServicer(runner, compute, EventPublisher(client))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    probes = health.HealthServicer()  # "" (the process) and the Worker service alike
    health_pb2_grpc.add_HealthServicer_to_server(probes, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    server.start()
    metrics = serve_metrics(StepCollector(config.worker_id, servicer.steps, servicer.encoder),
                            config.host, config.metrics_port)
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
    _set_health(probes, health_pb2.HealthCheckResponse.SERVING)
    log.info("worker %s serving %s on %s: %d blocks of %d tokens, max_model_len %d",
             reg.worker_id, reg.model, reg.address, reg.num_blocks, reg.block_size, reg.max_model_len)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    if ready is not None:
        ready.set()
    while not stop.wait(config.heartbeat_interval_s):
        servicer.retry_unsent()
    log.info("worker %s stopping", reg.worker_id)
    _set_health(probes, health_pb2.HealthCheckResponse.NOT_SERVING)
    _drain(registration, compute, runner, config.drain_timeout_s)
    registration.stop()  # first, so schedulers stop routing here and re-route what it held
    server.stop(grace=2).wait()
    servicer.close()
    if metrics is not None:
        metrics.close()
    media.close()
    client.close()


def _drain(registration: Registration, compute: ComputeThread, runner: ModelRunner, timeout_s: float) -> None:
    """Registered as draining, wait (up to `timeout_s`) until no request is still generating
    here; what is left when time is up is handed over once the worker deregisters."""
    if timeout_s <= 0:
        return
    registration.drain()
    deadline = time.monotonic() + timeout_s
    while (left := compute.call(lambda: runner.num_unfinished)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        log.warning("drain timeout: handing %d running request(s) over to other workers", left)
    else:
        log.info("drained: every request here finished")


def _set_health(probes: health.HealthServicer, status: int) -> None:
    for service in ("", WORKER_SERVICE):
        probes.set(service, status)
