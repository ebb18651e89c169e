"""Image embeddings shared through Redis: the encoder service (encoder_svc/) publishes what it
encodes, every worker reads them before encoding anything itself.

    fingerprint = vision_fingerprint(encoder)     which tower, which weights, which dtype
    published = PublishedEmbeddings.for_encoder(client, keys, media_encoder)
    published.fetch(hashes)              -> {hash: embeddings on `device`} for those published
    published.publish(embeds, ttl_s)     -> SET each under RedisKeys.embeddings(fp, hash) with
                                            a TTL, and give up the encoding claims of them
    published.claim(hash, owner, ttl_s)  -> True when `owner` (an encoder) is now the one
                                            encoding it
    published.take(hashes, owner, ttl_s) -> Claims: for each medium a worker lacks, whether
                                            it is now the worker's to encode (taken), nobody's
                                            (free), another party's (held) or published

The "hash" of a medium here is its embedding key (proto/pan_and_scan.py): the content hash
of a whole image -- the only kind the encoder service encodes and the gateway announces --
or, for a pan-and-scan crop a worker encodes, the hash and the crop's box, which no encoder
ever claims (so a worker finds it free and encodes it itself).

Keyed by the fingerprint, a worker only takes embeddings its own encoder would have
computed: the same vision config, the same weights (the values of its first and last
parameters and of the projector are hashed) and the same dtype; another checkpoint's or dtype's are
another key. A value that does not decode, or whose dtype or shape is not the encoder's,
is treated as missing (encoded again), never used.

A claim (`RedisKeys.encoding(hash)`) says "queued for an encoder" (value QUEUED, set by the
gateway that announced the medium: gateway/media/encode_jobs.py) or "being encoded now by
its value's owner" (an encoder's id, or a worker's). Claims change hands only inside Lua
scripts that also look at the published embeddings, so each medium of the encoders' queue
is encoded by exactly one party:
  * an encoder claims it when it is free or only QUEUED, and not published (`claim`): a
    medium a worker took over and published before the encoder came to it is refused;
  * a worker takes it when it is only QUEUED (`take`); held by another party, the worker
    waits for its embeddings rather than encode it too (worker_svc/vision_step.py), and
    takes it once the claim is gone unpublished (given up after a failure, or its TTL ran
    out because the holder died);
  * publishing an embedding and giving up its claim happen in one pipeline (`publish`).
The scheduler routes a request needing a claimed medium once the claim is gone, or after
1 s of it being only QUEUED (scheduler_svc/encoding_wait.py).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import redis
import torch

from modeling.gemma3_vision import Gemma3VisionEncoder
from proto.encoder_messages import QUEUED, EmbeddingsRecord, embeddings_decoder
from proto.keys import RedisKeys
from vision.media_encoder import MediaEncoder

log = logging.getLogger(__name__)
_record_encoder = msgspec.msgpack.Encoder()
# KEYS[1] the claim, KEYS[2] the embeddings; ARGV: owner, TTL in ms, QUEUED -> 1 when claimed
_CLAIM = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[3] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS: (claim, embeddings) of each medium; ARGV: owner, TTL in ms, QUEUED, "1" to take free
# ones too -> for each medium 0 taken, 1 free, 2 held (by another), 3 published
_TAKE = """
local states = {}
for i = 1, #KEYS, 2 do
  local state = 2
  if redis.call('EXISTS', KEYS[i + 1]) == 1 then
    state = 3
  else
    local held = redis.call('GET', KEYS[i])
    if held == ARGV[3] or held == ARGV[1] or (not held and ARGV[4] == '1') then
      redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
      state = 0
    elseif not held then
      state = 1
    end
  end
  states[#states + 1] = state
end
return states
"""
# KEYS: claims; ARGV[1] QUEUED
_RELEASE_QUEUED = """
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('DEL', key) end
end
return 0
"""


def vision_fingerprint(encoder: Gemma3VisionEncoder) -> str:
    """16 hex digits naming what `encoder` computes: its config, dtype and the values of
    its first and last weights (two checkpoints of one config differ there)."""
    digest = hashlib.sha256()
    digest.update(repr(encoder.cfg).encode())
    digest.update(str(encoder.dtype).encode())
    params = list(encoder.parameters())
    for p in (params[0], params[-1], encoder.multi_modal_projector.mm_input_projection_weight):
        digest.update(tensor_bytes(p.detach()))
    return digest.hexdigest()[:16]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's values as bytes, row-major (any dtype, bf16 included)."""
    flat = t.detach().contiguous().reshape(-1).cpu()
    return flat.view(torch.uint8).numpy().tobytes()


def to_record(embeds: torch.Tensor) -> bytes:
    return _record_encoder.encode(EmbeddingsRecord(str(embeds.dtype).removeprefix("torch."),
                                                   tuple(embeds.shape), tensor_bytes(embeds)))


def from_record(value: bytes, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The embeddings a record holds; ValueError when it is not a [shape] tensor of `dtype`."""
    record = embeddings_decoder.decode(value)
    name = str(dtype).removeprefix("torch.")
    if record.dtype != name or tuple(record.shape) != shape:
        raise ValueError(f"a {record.dtype} {list(record.shape)} record, not {name} {list(shape)}")
    flat = torch.frombuffer(bytearray(record.data), dtype=torch.uint8)
    if flat.numel() != dtype.itemsize * torch.Size(shape).numel():
        raise ValueError(f"{flat.numel()} bytes for a {name} {list(shape)} tensor")
    return flat.view(dtype).reshape(shape).to(device)


@dataclass(frozen=True)
class Claims:
    """What `PublishedEmbeddings.take` found of each medium, in the order asked."""

    taken: list[str] = field(default_factory=list)  # the caller's now: encode, then publish
    free: list[str] = field(default_factory=list)  # nobody's: encode (nobody else will)
    held: list[str] = field(default_factory=list)  # another party is encoding it: wait
    published: list[str] = field(default_factory=list)  # published since the caller looked: fetch


class PublishedEmbeddings:
    """The published embeddings of one fingerprint, read and written with redis-py's
    synchronous client (the compute thread, the encoder's loop)."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, fingerprint: str,
                 dtype: torch.dtype, shape: tuple[int, ...], device: torch.device):
        self._client = client
        self._keys = keys
        self.fingerprint = fingerprint
        self._dtype, self._shape, self._device = dtype, shape, device
        self._claim = client.register_script(_CLAIM)
        self._release_queued = client.register_script(_RELEASE_QUEUED)
        self._take = client.register_script(_TAKE)

    @classmethod
    def for_encoder(cls, client: redis.Redis, keys: RedisKeys, encoder: MediaEncoder) -> PublishedEmbeddings:
        """The embeddings `encoder` would compute: its fingerprint, dtype, shape and device."""
        return cls(client, keys, vision_fingerprint(encoder.encoder), encoder.encoder.dtype,
                   encoder.embeddings_shape, encoder.device)

    def fetch(self, hashes: Sequence[str]) -> dict[str, torch.Tensor]:
        """The embeddings of those `hashes` that are published (one MGET); Redis unreachable
        or a bad value: those are missing (the caller encodes them)."""
        if not hashes:
            return {}
        try:
            values = self._client.mget([self._keys.embeddings(self.fingerprint, h) for h in hashes])
        except (redis.RedisError, OSError) as exc:
            log.warning("published embeddings unreachable (%s): encoding %d item(s) here", exc, len(hashes))
            return {}
        found = {}
        for digest, value in zip(hashes, values):
            if value is None:
                continue
            try:
                found[digest] = from_record(value, self._dtype, self._shape, self._device)
            except (msgspec.DecodeError, ValueError) as exc:
                log.warning("published embeddings of %s unusable (%s): encoding it here", digest, exc)
        return found

    def exists(self, hashes: Sequence[str]) -> set[str]:
        """Those of `hashes` whose embeddings are published now."""
        if not hashes:
            return set()
        pipe = self._client.pipeline(transaction=False)
        for h in hashes:
            pipe.exists(self._keys.embeddings(self.fingerprint, h))
        return {h for h, n in zip(hashes, pipe.execute()) if n}

    def claim(self, content_hash: str, owner: str, ttl_s: float) -> bool:
        """Whether `owner` (an encoder) now holds the encoding claim of `content_hash`: it
        was free, or only marked QUEUED by the gateway that announced it, and its embeddings
        are not published (a worker may have taken it over and published it since the
        encoder looked); then `owner`'s, for `ttl_s`."""
        return bool(self._claim(keys=[self._keys.encoding(content_hash),
                                      self._keys.embeddings(self.fingerprint, content_hash)],
                                args=[owner, max(1, int(ttl_s * 1000)), QUEUED]))

    def take(self, hashes: Sequence[str], owner: str, ttl_s: float, take_free: bool = False) -> Claims:
        """For each of `hashes` (media a worker's step lacks), in one script: taken (it was
        only QUEUED for an encoder, or `owner`'s already, or free and `take_free`: now
        `owner`'s for `ttl_s`, to encode and publish), free (no claim: not in the encoders'
        queue), held (an encoder or another worker is encoding it: wait for its embeddings)
        or published (since the caller looked). Redis unreachable: all free (the worker
        encodes them, as without encoders)."""
        if not hashes:
            return Claims()
        keys = []
        for h in hashes:
            keys += [self._keys.encoding(h), self._keys.embeddings(self.fingerprint, h)]
        try:
            states = self._take(keys=keys, args=[owner, max(1, int(ttl_s * 1000)), QUEUED,
                                                 "1" if take_free else "0"])
        except (redis.RedisError, OSError) as exc:
            log.warning("encoding claims unreachable (%s): encoding %d item(s) here", exc, len(hashes))
            return Claims(free=list(hashes))
        claims = Claims()
        for h, state in zip(hashes, states):
            (claims.taken, claims.free, claims.held, claims.published)[state].append(h)
        return claims

    def release(self, hashes: Sequence[str], only_queued: bool = False) -> None:
        """Give up the claims of `hashes` (their encoding failed); `only_queued`: only the
        gateway's QUEUED marks (of media found published already: nobody will encode them)."""
        if not hashes:
            return
        keys = [self._keys.encoding(h) for h in hashes]
        if only_queued:
            self._release_queued(keys=keys, args=[QUEUED])
        else:
            self._client.delete(*keys)

    def publish(self, embeds: Mapping[str, torch.Tensor], ttl_s: float) -> int:
        """Store each (hash → embeddings) with a TTL and give up its claim, in one pipeline;
        the bytes written."""
        pipe = self._client.pipeline(transaction=False)
        written = 0
        ttl_ms = max(1, int(ttl_s * 1000))
        for digest, tensor in embeds.items():
            value = to_record(tensor)
            written += len(value)
            pipe.set(self._keys.embeddings(self.fingerprint, digest), value, px=ttl_ms)
            pipe.delete(self._keys.encoding(digest))
        pipe.execute()
        return written
