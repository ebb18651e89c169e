"""The worker service: a gRPC shell around ModelRunner.

It owns the transport only: the gRPC server (Describe / Step / Steps / Health, and the
standard `grpc.health.v1.Health` service: SERVING from registration until SIGTERM),
publishing each step's TokenEvents to Redis (one PUBLISH per reply channel per step,
pipelined: worker_svc/event_publisher.py), the registration heartbeat that lets
schedulers discover it (worker_svc/registration.py), the media store the runner reads images from (the same Redis:
vision/media_source.py), and /metrics (each step's duration, requests and tokens; for
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

On an accelerator a step planned ahead is also *launched* before the step it follows
finishes (ModelRunner.launch / finish): the step in flight is finished -- its sampled ids
read on the host -- only once the next one is launched, or once its ids are on the host
with no next step queued. The host then lays out step k+1 while the device runs step k.
"""

from __future__ import annotations

import functools
import logging
import queue
import signal
import socket
import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto import worker_pb2, worker_pb2_grpc
from proto.grpc_options import GRPC_OPTIONS
from proto.keys import RedisKeys
from proto.messages import TokenEvent, WorkerRegistration
from proto.metrics import EncoderRecorder, StepCollector, StepRecorder, serve_metrics
from proto.outage_log import OutageLog
from vision.media_source import RedisMediaSource
from vision.published_embeddings import PublishedEmbeddings
from worker_svc.compute_thread import ComputeThread
from worker_svc.event_publisher import EventPublisher
from worker_svc.model_runner import LaunchedStep, ModelRunner, StepConsistencyError
from worker_svc.registration import Registration, drain
from worker_svc.service_config import WorkerServiceConfig
from worker_svc.step_gap import StepGap

log = logging.getLogger("pagedserve.worker")

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name  # for grpc.health.v1
ORDER_TIMEOUT_S = 30.0  # how long a step planned ahead waits for the step it follows
POLL_S = 1e-4  # how often a launched step's ids are looked for while the next step may come


class StepOrderError(Exception):
    """A step planned after one this worker never received."""


class StaleSchedulerError(Exception):
    """A step from a scheduler whose lease another scheduler has taken since."""


@dataclass(frozen=True)
class _InFlight:
    """A step launched on the compute thread and not finished yet."""

    launched: LaunchedStep
    outcome: Future  # of (StepOutput, publish future or None)
    gap: float | None  # the compute thread's idle before it (StepGap)

    @property
    def request(self) -> worker_pb2.StepRequest:
        return self.launched.request


class ModelWorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Queues Steps in order on the compute thread (the runner holds one batch state) and
    publishes their events.

    Every step runs on the compute thread that loaded the runner, whichever gRPC thread
    received it (worker_svc/compute_thread.py says why)."""

    def __init__(self, runner: ModelRunner, compute: ComputeThread, publisher: EventPublisher,
                 launch_ahead: bool = False):
        self._runner = runner
        self._launch_ahead = launch_ahead
        self._compute = compute
        self._publisher = publisher
        self._publishing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")  # FIFO
        self._order = threading.Condition()
        self._last_queued = 0  # id of the last step queued on the compute thread
        self._followed: set[int] = set()  # ids of steps that a queued step is planned after
        self._in_flight: _InFlight | None = None  # launched, left for the next step to finish (compute thread only)
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
        """Queue the step on the compute thread, behind the step it was planned after;
        the future of its (StepOutput, publish future or None)."""
        after = request.after_step_id
        outcome: Future = Future()
        with self._order:
            # Planned ahead: its RPC may overtake the one of the step it follows.
            if after and not self._order.wait_for(lambda: self._last_queued == after, ORDER_TIMEOUT_S):
                raise StepOrderError(f"step {request.step_id} is planned after step {after}, "
                                     f"which this worker did not receive")
            self._compute.submit(self._run, request, outcome)
            self._last_queued = request.step_id
            if after:
                self._followed.add(after)
            self._order.notify_all()
        return outcome

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

    def _run(self, request: worker_pb2.StepRequest, outcome: Future) -> None:
        """On the compute thread: launch the step, and finish it (ModelRunner.finish) now,
        or, when the step planned after it is queued already and launching ahead is on,
        once that step is launched too: the device then runs this step while the host
        prepares the next, whose tokens from this step never visit the host."""
        behind, self._in_flight = self._in_flight, None
        with self._order:
            self._followed.discard(request.after_step_id)
        try:
            self._launch_after(request, outcome, behind)
        except BaseException as exc:  # a bug, or a broken device: no step may wait forever
            log.exception("step %d: the compute thread failed", request.step_id)
            if behind is not None and not behind.outcome.done():  # still launched only: finish it
                try:
                    self._finish(behind)
                except BaseException:
                    if not behind.outcome.done():
                        behind.outcome.set_exception(exc)
            self._failed = request.step_id
            self._in_flight = None
            if not outcome.done():
                outcome.set_exception(exc)

    def _launch_after(self, request: worker_pb2.StepRequest, outcome: Future, behind: _InFlight | None) -> None:
        """_run's work: `behind` is the step launched before and not finished yet."""
        ahead = (behind is not None and request.after_step_id == behind.request.step_id
                 and request.fencing_token == behind.request.fencing_token
                 and self._runner.can_launch_ahead(request))
        if behind is not None and not ahead:
            self._finish(behind)
            behind = None
        try:
            self._fence(request)
            if request.after_step_id and request.after_step_id == self._failed:
                raise StepConsistencyError(
                    f"step {request.step_id} is planned after step {request.after_step_id}, which failed")
            gap = self._gap.start()
            launched = _InFlight(self._runner.launch(request), outcome, gap)
        except Exception as exc:
            if behind is not None:
                self._finish(behind)
            self._failed = request.step_id  # and so on down the queue
            outcome.set_exception(exc)
            return
        if behind is not None:
            self._finish(behind)
            if self._failed == behind.request.step_id:  # this step read its sampled ids: it fails too
                self._finish(launched, failure=StepConsistencyError(
                    f"step {request.step_id} is planned after step {behind.request.step_id}, which failed"))
                return
        if self._launch_ahead and self._next_comes_first(launched):
            self._in_flight = launched
        else:
            self._finish(launched)

    def _next_comes_first(self, step: _InFlight) -> bool:
        """Whether the step planned after `step` is queued before `step`'s sampled ids are
        on the host (then it launches before `step` finishes); polled, as the device
        cannot wake this thread. Where `step`'s ids are all the scheduler waits for, this
        is as long as finishing it now would wait."""
        with self._order:
            while step.request.step_id not in self._followed:
                if step.launched.ready():
                    return False
                self._order.wait(POLL_S)
        return True

    def _finish(self, step: _InFlight, failure: Exception | None = None) -> None:
        """On the compute thread: the launched step finished, and its events published, or
        handed to the publishing thread (that publish's future) when a later step is
        queued already; its outcome set. With `failure`, the step is finished on the
        runner (whose state then follows what the device did) and fails with it, unheard."""
        request = step.request
        try:
            output = self._runner.finish(step.launched)
            self._gap.end(request, output.result, step.gap)
            if failure is not None:
                raise failure
        except Exception as exc:
            self._failed = request.step_id
            step.outcome.set_exception(exc)
            return
        self._failed = 0  # step ids start again at 1 with a new scheduler
        published = None
        try:
            if self._last_queued > request.step_id:  # the next step waits: publish beside it
                published = self._handed_off = self._publishing.submit(self._publish, output.events)
            else:
                if self._handed_off is not None:  # an earlier step's events go first
                    handed_off, self._handed_off = self._handed_off, None
                    handed_off.result()  # if that publish failed, this step fails too, not the ones after
                self._publish(output.events)
        except Exception as exc:
            step.outcome.set_exception(exc)
            return
        step.outcome.set_result((output, published))

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
    launch_ahead = config.launch_ahead if config.launch_ahead is not None else runner.device.type != "cpu"
    servicer = ModelWorkerServicer(runner, compute, EventPublisher(client), launch_ahead)
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
    drain(registration, compute, runner, config.drain_timeout_s)
    registration.stop()  # first, so schedulers stop routing here and re-route what it held
    server.stop(grace=2).wait()
    servicer.close()
    if metrics is not None:
        metrics.close()
    media.close()
    client.close()


def _set_health(probes: health.HealthServicer, status: int) -> None:
    for service in ("", WORKER_SERVICE):
        probes.set(service, status)
