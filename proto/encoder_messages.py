"""Messages of the encoder service (encoder_svc/, docs/architecture.md "The encoder service").

Stream `RedisKeys.encode_jobs` (gateway → encoders, group `encoders`): field `m` holds a
msgpack `EncodeJob`, the content hashes of media a gateway has just stored.
Key `RedisKeys.encoder(id)` (encoder → gateway, launcher): `EncoderRegistration`, with a TTL.
Key `RedisKeys.embeddings(fingerprint, hash)` (encoder → worker): `EmbeddingsRecord`.
"""

from __future__ import annotations

import msgspec


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


class EmbeddingsRecord(msgspec.Struct, frozen=True, array_like=True):
    """One medium's embeddings [mm_tokens_per_image, hidden]: `data` is the tensor's bytes,
    row-major, in `dtype` (a torch dtype name without "torch.")."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


job_encoder = msgspec.msgpack.Encoder()
job_decoder = msgspec.msgpack.Decoder(EncodeJob)
encoder_registration_decoder = msgspec.msgpack.Decoder(EncoderRegistration)
embeddings_decoder = msgspec.msgpack.Decoder(EmbeddingsRecord)
