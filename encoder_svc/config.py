"""The encoder service's settings (`pagedserve encoder` flags: compose/flags.py)."""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass, field


def _default_id() -> str:
    return f"encoder-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class EncoderServiceConfig:
    model: str  # the checkpoint the workers serve (a folder or a Hub id from the cache)
    served_model_name: str | None = None
    dtype: str = "auto"  # resolved as the worker resolves it: the embeddings must be the worker's
    device: str = "cpu"
    threads: int | None = None  # CPU compute threads (None: the CPUs it may use: affinity, cgroup quota)
    load_format: str = "auto"  # "dummy": random weights, as the workers' (modeling/dummy_weights.py)
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "pagedserve"
    encoder_id: str = field(default_factory=_default_id)
    batch: int = 8  # media per encoder call at most
    embeddings_ttl_s: float = 300.0  # how long published embeddings live
    claim_ttl_s: float = 10.0  # a claim outlives one batch's encoding; a dead encoder's runs out
    read_block_ms: int = 500  # one XREADGROUP waits this long for a job
    heartbeat_interval_s: float = 1.0
    registration_ttl_s: float = 5.0
    host: str = "127.0.0.1"  # of /metrics and /health
    metrics_port: int = 0  # 0: off

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"--batch {self.batch}: must be >= 1")
        if self.embeddings_ttl_s <= 0 or self.claim_ttl_s <= 0:
            raise ValueError("--embeddings-ttl-s and --claim-ttl-s must be positive")
