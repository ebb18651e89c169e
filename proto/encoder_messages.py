"""Messages of the encoder service (encoder_svc/, docs/architecture.md "The encoder service").

Stream `RedisKeys.encode_jobs` (gateway → encoders, group `encoders`): field `m` holds a
msgpack `EncodeJob`, the content hashes of media a gateway has just stored.
Key `RedisKeys.encoder(id)` (encoder → gateway, launcher): `EncoderRegistration`, with a TTL.
Key `RedisKeys.encoder_stats(id)` (encoder → gateway): `EncoderStats`, with the same TTL,
written beside the registration by each heartbeat (the gateway's /metrics renders them).
Key `RedisKeys.embeddings(fingerprint, hash)` (encoder → worker): `EmbeddingsRecord`.
"""

from __future__ import annotations

import msgspec

from proto.messages import VisionStats


QUEUED = "queued"  # RedisKeys.encoding(hash) while a medium waits for an encoder (gateway → encoder)


class EncodeJob(msgspec.Struct, frozen=True):
    content_hashes: tuple[str, ...]  # MediaItems under RedisKeys.media(hash), to encode


class EncoderRegistration(msgspec.Struct, frozen=True):
    encoder_id: str
    model: str  # served model name
    fingerprint: str  # the vision tower and dtype its embeddings are keyed by
    dtype: str  # torch dtype name, e.g. "float32"
    device: str  # "cpu", "cuda:0", ...
    metrics_address: str = ""  # host:port of its /metrics and /health ("" when off)


class EncoderStats(msgspec.Struct, frozen=True):
    """An encoder service's counters since it started (encoder_svc/service.py), as its
    own /metrics shows them; proto/metrics.py renders both from this message."""

    encoder_id: str
    vision: VisionStats  # what it encoded, and the seconds of each batch
    items_published: int = 0  # media whose embeddings it published
    bytes_published: int = 0  # bytes of those embeddings
    items_found: int = 0  # media of its jobs already published when it came to them
    items_failed: int = 0  # media of its jobs that could not be had or decoded
    updated_at: float = 0.0  # time.time() of the snapshot


class EmbeddingsRecord(msgspec.Struct, frozen=True, array_like=True):
    """One medium's embeddings [mm_tokens_per_image, hidden]: `data` is the tensor's bytes,
    row-major, in `dtype` (a torch dtype name without "torch.")."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


job_encoder = msgspec.msgpack.Encoder()
job_decoder = msgspec.msgpack.Decoder(EncodeJob)
encoder_registration_decoder = msgspec.msgpack.Decoder(EncoderRegistration)
encoder_stats_decoder = msgspec.msgpack.Decoder(EncoderStats)
embeddings_decoder = msgspec.msgpack.Decoder(EmbeddingsRecord)
