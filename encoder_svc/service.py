"""EncoderService: the vision tower of the served checkpoint, fed by the encode-job stream.

    service = EncoderService(config)     loads the encoder (the workers' dtype), connects
    service.run(stop)                    registers, serves /metrics and /health, and loops:
        1. jobs: those a dead encoder left pending for longer than --claim-ttl-s (every
           half of it), else new ones (XREADGROUP, up to --batch, blocking --read-block-ms)
        2. their media, each once: skipped when already published; claimed
           (`RedisKeys.encoding(hash)`: free or only QUEUED by the gateway, and not
           published, now this encoder's for --claim-ttl-s; one Lua script) just before
           its batch is encoded, skipped when another encoder or a worker that took it
           over holds the claim, or published it meanwhile
        3. fetched, decoded, preprocessed and encoded in batches of --batch
           (vision/media_encoder.py, the workers' own path), published with
           --embeddings-ttl-s and the claims given up (vision/published_embeddings.py)
        4. the jobs acknowledged: only now, so a crash before loses nothing

A medium that cannot be had (expired, undecodable) is given up (its claim too) and counted
as failed: the worker that needs it fails the request with the reason, as without encoders.
Registration (`RedisKeys.encoder(id)`, an `EncoderRegistration` with a TTL, and the set
`RedisKeys.encoders`) is what makes gateways announce new media (gateway/media/encode_jobs.py):
without a live encoder they announce nothing and the workers encode as they always did.
Each heartbeat also writes its counters (`RedisKeys.encoder_stats(id)`, `EncoderStats`, the
same TTL), which the gateways' /metrics show beside the workers'.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import redis
import torch
from prometheus_client.core import GaugeMetricFamily, Metric

from encoder_svc.config import EncoderServiceConfig
from encoder_svc.jobs import EncodeJobStream
from modeling.cpu_threads import choose_threads
from modeling.dummy_weights import check_config
from modeling.loader import resolve_dtype
from modeling.registry import load_config, load_vision_config
from proto.encoder_messages import EncodeJob, EncoderRegistration, EncoderStats
from proto.keys import RedisKeys
from proto.metrics import EncoderRecorder, MetricsServer, serve_metrics, vision_families
from proto.model_source import resolve_model, served_name
from vision.media_encoder import MediaEncoder
from vision.media_source import RedisMediaSource
from vision.published_embeddings import PublishedEmbeddings

log = logging.getLogger(__name__)
_encoder = msgspec.msgpack.Encoder()


class EncoderService:
    def __init__(self, config: EncoderServiceConfig):
        self.config = config
        self.keys = RedisKeys(config.key_prefix)
        model_dir = resolve_model(config.model)
        check_config(model_dir, config.load_format)
        vision = load_vision_config(model_dir)
        if vision is None:
            raise ValueError(f"{config.model} has no vision tower: an encoder service has nothing to encode")
        device = torch.device(config.device)
        if device.type == "cpu":  # the CPUs it may use (affinity, cgroup quota), or --threads
            choice = choose_threads(config.threads)
            torch.set_num_threads(choice.threads)
            log.info("encoding with %d thread(s) (%s)", choice.threads, choice.why)
        dtype, why = resolve_dtype(config.dtype, load_config(model_dir), device)
        log.info("vision encoder in %s (%s) on %s", str(dtype).removeprefix("torch."), why, device)
        self.client = redis.Redis.from_url(config.redis_url, socket_timeout=10, socket_connect_timeout=10)
        self.media = RedisMediaSource.from_url(config.redis_url, config.key_prefix)
        self.encoder = MediaEncoder.load(model_dir, vision, dtype, device, self.media, config.load_format)
        self.published = PublishedEmbeddings.for_encoder(self.client, self.keys, self.encoder)
        self.jobs = EncodeJobStream(self.client, self.keys, config.encoder_id)
        self.recorder = EncoderRecorder()
        self.items_published = 0
        self.bytes_published = 0
        self.items_failed = 0
        self.items_found = 0  # asked for, already published (by another encoder, earlier)
        self._last_beat = 0.0  # monotonic time of the last registration Redis took
        self._next_stale = 0.0
        self.registration = EncoderRegistration(
            encoder_id=config.encoder_id, model=served_name(config.model, config.served_model_name),
            fingerprint=self.published.fingerprint, dtype=str(dtype).removeprefix("torch."),
            device=str(device))
        log.info("encoder %s: embeddings keyed %s", config.encoder_id, self.published.fingerprint)

    # ---- the loop ---------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Register, serve /metrics and /health, and encode until `stop` is set."""
        self.jobs.create_group()
        metrics: MetricsServer | None = serve_metrics(_Collector(self.config.encoder_id, self.stats, self.jobs.depth),
                                                      self.config.host, self.config.metrics_port, self.health)
        if metrics is not None:
            self.registration = msgspec.structs.replace(
                self.registration, metrics_address=f"{self.config.host}:{metrics.port}")
        beat = threading.Thread(target=self._beat, args=(stop,), name="encoder-heartbeat", daemon=True)
        self._register()
        beat.start()
        try:
            while not stop.is_set():
                try:
                    self.run_once()
                except (redis.RedisError, OSError) as exc:
                    log.warning("Redis unreachable (%s); retrying in 1 s", exc)
                    stop.wait(1.0)
        finally:
            stop.set()
            beat.join(timeout=5)
            self._deregister()
            if metrics is not None:
                metrics.close()
            self.media.close()
            self.client.close()

    def run_once(self) -> int:
        """One round: stale jobs (when due) or new ones, encoded, published, acknowledged;
        the number of jobs handled."""
        entries = []
        now = time.monotonic()
        if now >= self._next_stale:
            self._next_stale = now + self.config.claim_ttl_s / 2
            entries = self.jobs.claim_stale(int(self.config.claim_ttl_s * 1000), self.config.batch)
        if not entries:
            entries = self.jobs.read(self.config.batch, self.config.read_block_ms)
        if entries:
            self.encode(_distinct(job for _, job in entries))
            self.jobs.ack([entry_id for entry_id, _ in entries])
        return len(entries)

    def encode(self, hashes: list[str]) -> None:
        """Publish the embeddings of `hashes` not published yet, in batches, each claimed
        just before it is encoded (what another encoder holds is left to it)."""
        found = self.published.exists(hashes)
        self.items_found += len(found)
        self.published.release(list(found), only_queued=True)  # nobody waits for them now
        todo = [h for h in hashes if h not in found]
        for start in range(0, len(todo), self.config.batch):
            mine = [h for h in todo[start:start + self.config.batch]
                    if self.published.claim(h, self.config.encoder_id, self.config.claim_ttl_s)]
            if not mine:
                continue
            began = time.perf_counter()
            embeds, failures = self.encoder.encode(mine)
            seconds = time.perf_counter() - began
            self.recorder.observe(len(embeds), 0, seconds)
            if embeds:
                self.bytes_published += self.published.publish(embeds, self.config.embeddings_ttl_s)
                self.items_published += len(embeds)
            if failures:
                self.items_failed += len(failures)
                self.published.release(list(failures))
                log.warning("%d medium(s) not encoded: %s", len(failures),
                            "; ".join(f"{h}: {why}" for h, why in failures.items()))

    # ---- registration and health ------------------------------------------------------

    def stats(self) -> EncoderStats:
        """Its counters now (read from any thread: each is replaced whole by the loop)."""
        return EncoderStats(encoder_id=self.config.encoder_id, vision=self.recorder.snapshot(),
                            items_published=self.items_published, bytes_published=self.bytes_published,
                            items_found=self.items_found, items_failed=self.items_failed,
                            updated_at=time.time())

    def _register(self) -> None:
        """The registration and the stats, both with the registration's TTL: a dead
        encoder's counters leave the gateway's /metrics as it leaves the registry."""
        ttl_ms = int(self.config.registration_ttl_s * 1000)
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.encoder(self.config.encoder_id), _encoder.encode(self.registration), px=ttl_ms)
        pipe.set(self.keys.encoder_stats(self.config.encoder_id), _encoder.encode(self.stats()), px=ttl_ms)
        pipe.sadd(self.keys.encoders, self.config.encoder_id)
        pipe.execute()
        self._last_beat = time.monotonic()

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(self.config.heartbeat_interval_s):
            try:
                self._register()
            except (redis.RedisError, OSError) as exc:
                log.warning("heartbeat failed: %s", exc)

    def _deregister(self) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(self.keys.encoder(self.config.encoder_id), self.keys.encoder_stats(self.config.encoder_id))
            pipe.srem(self.keys.encoders, self.config.encoder_id)
            pipe.execute()
        except (redis.RedisError, OSError):
            pass  # its TTL runs out

    def health(self) -> tuple[bool, dict]:
        """Ready while Redis took a registration within its TTL (the gateways see it)."""
        age = time.monotonic() - self._last_beat
        healthy = age < self.config.registration_ttl_s
        return healthy, {"status": "ok" if healthy else "unregistered", "encoder": self.config.encoder_id,
                         "fingerprint": self.published.fingerprint, "last_heartbeat_s": round(age, 3)}


def _distinct(jobs: Iterator[EncodeJob]) -> list[str]:
    seen: dict[str, None] = {}
    for job in jobs:
        seen.update(dict.fromkeys(job.content_hashes))
    return list(seen)


class _Collector:
    """The encoder's /metrics: what it encoded (and how long each batch took), published,
    found published and failed -- `stats()`, its EncoderStats, rendered as the gateway
    renders them too -- and `depth()`, the jobs no encoder has finished."""

    def __init__(self, encoder_id: str, stats: Callable[[], EncoderStats], depth: Callable[[], int]):
        self._encoder_id, self._stats, self._depth = encoder_id, stats, depth

    def collect(self) -> Iterator[Metric]:
        yield from vision_families([], [self._stats()])
        try:
            depth = self._depth()
        except (redis.RedisError, OSError):
            return
        family = GaugeMetricFamily("pagedserve:encoder_queue_depth",
                                   "encode jobs no encoder has finished (not read yet, or read and "
                                   "not acknowledged)", labels=["encoder"])
        family.add_metric([self._encoder_id], float(depth))
        yield family
