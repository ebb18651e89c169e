"""The vision part of a step: the embeddings of the images whose soft tokens a step
computes -- from the encoder cache, published by the encoder service, or encoded now --
and their placement over the decoder's input embeddings (Gemma 3; docs/architecture.md,
"Images and video").

    embedder = ImageEmbedder.load(model_dir, vision_cfg, dtype, device, media, cache_bytes, published)
    embedder.check(state)                -> why the request's images cannot run here, or None
    images = embedder.prepare(scheduled) (before the flat batch is built)
        1. the images whose soft tokens fall in the scheduled chunks, by embedding key
           (the content hash; for a pan-and-scan crop, the hash and the crop's box:
           proto/pan_and_scan.py), each once however many requests of the step carry it
        2. those in the encoder cache (vision/encoder_cache.py) are hits
        3. then those the encoder service published (vision/published_embeddings.py,
           one MGET; kept in the cache too) are hits
        4. the others: fetched, decoded, preprocessed and encoded in ONE batch
           (vision/media_encoder.py); each result goes into the cache. With an
           encoder service, each is claimed first (one script): those still only queued
           for an encoder (it is behind: the scheduler waited as long as it would) are
           taken over and published after, so the encoder skips them; those an encoder
           (or another worker) is encoding now are waited for (HELD_WAIT_S at most) and
           fetched when published: a medium is encoded once across the fleet
        -> StepImages: embeddings by key, the requests that cannot run (an image missing
           or undecodable: they fail alone, with its reason), and the step's counts
    h = model.embed(batch.input_ids)
    place_step_images(h, batch.images, images.embeddings)   h's soft-token rows = the images'
    logits = model(..., inputs_embeds=h)

A step without image soft tokens never comes here (the runner checks `image_ranges`).
Crops are encoded here, never by the encoder service (it encodes whole images, as the
gateway stores them); a whole image's embeddings are the same with or without pan-and-scan
and are found under its content hash either way.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import redis
import torch

from modeling.gemma3_vision import Gemma3VisionConfig
from modeling.image_placement import ImageSlice, image_slices, place_image_embeddings, splice_rows
from proto.pan_and_scan import ImagePiece
from vision.encoder_cache import EncoderCache
from vision.media_encoder import MediaEncoder
from vision.media_source import MediaSource
from vision.published_embeddings import PublishedEmbeddings
from worker_svc.request_state import RequestState

log = logging.getLogger(__name__)

TAKEN_TTL_S = 30.0  # a medium taken over from the encoders' queue: claimed for this long at most
PUBLISHED_TTL_S = 300.0  # and published for this long (the encoder service's default)
# A medium another party is encoding: waited for this long at most (the encoder's default
# --claim-ttl-s, and the scheduler's longest wait for an encoding: scheduler_svc/encoding_wait.py),
# its claim and embeddings looked at this often.
HELD_WAIT_S = 10.0
HELD_POLL_S = 0.005


@dataclass(frozen=True)
class VisionStepStats:
    """What one step's images cost: for the worker's /metrics (proto/metrics.py EncoderRecorder)."""

    items_encoded: int  # distinct images (or frames) encoded in this step
    cache_hits: int  # distinct images of this step found in the encoder cache
    seconds: float  # fetching, decoding, preprocessing and encoding those encoded (0 when none)
    published_hits: int = 0  # distinct images of this step the encoder service had published
    queries: int = 0  # distinct images of this step (hits + published + encoded + failed)


@dataclass(frozen=True)
class StepImages:
    embeddings: dict[str, torch.Tensor]  # embedding key -> [mm_tokens_per_image, hidden], on the device
    failed: list[tuple[RequestState, str]]  # requests that cannot run: an image of theirs could not be had
    stats: VisionStepStats


class ImageEmbedder:
    """One worker's encoder cache, over the published embeddings (when an encoder service
    may publish them) and its own MediaEncoder."""

    def __init__(self, encoder: MediaEncoder, cache: EncoderCache,
                 published: PublishedEmbeddings | None = None, held_wait_s: float = HELD_WAIT_S):
        self.encoder = encoder
        self.cfg: Gemma3VisionConfig = encoder.cfg
        self.cache = cache
        self.published = published
        self.held_wait_s = held_wait_s
        # the value of the encoding claims it takes: its own, so it never waits for itself
        self.owner = f"worker-{uuid.uuid4().hex[:12]}"

    @classmethod
    def load(cls, model_dir: str | Path, cfg: Gemma3VisionConfig, dtype: torch.dtype,
             device: torch.device, media: MediaSource, cache_bytes: int,
             published: Callable[[MediaEncoder], PublishedEmbeddings] | None = None,
             load_format: str = "auto") -> ImageEmbedder:
        """The checkpoint's encoder in `dtype` on `device` (random weights with `load_format`
        "dummy"), an encoder cache of `cache_bytes`, and (given a way to make it from the
        encoder: its fingerprint) the published embeddings to read."""
        encoder = MediaEncoder.load(model_dir, cfg, dtype, device, media, load_format)
        embedder = cls(encoder, EncoderCache(cache_bytes), published(encoder) if published else None)
        if embedder.published is not None:  # an encoder service of another dtype or checkpoint is not used
            log.info("vision: encoder cache of %d embeddings; published embeddings read under %s",
                     embedder.cache_items, embedder.published.fingerprint)
        return embedder

    @property
    def cache_items(self) -> int:
        """The embeddings the encoder cache holds at most (each the same size)."""
        rows, hidden = self.encoder.embeddings_shape
        return self.cache.capacity_bytes // (rows * hidden * self.encoder.encoder.dtype.itemsize)

    def check(self, state: RequestState) -> str | None:
        """Why `state`'s images cannot be served (placeholder ranges that are not the
        model's: wrong length, out of the prompt, overlapping, not image tokens; an empty
        crop box), or None."""
        end = 0
        for i, (r, piece) in enumerate(zip(state.image_ranges, state.image_pieces)):
            where = f"image {i} (soft tokens [{r.offset}, {r.offset + r.length}))"
            if not piece.content_hash:
                return f"{where} has no content hash"
            if piece.crop is not None and (min(piece.crop) < 0 or min(piece.crop.height, piece.crop.width) < 1):
                return f"{where}: crop box {tuple(piece.crop)} (top, left, height, width) is empty or negative"
            if r.length != self.cfg.mm_tokens_per_image:
                return (f"{where}: {r.length} soft tokens, the model's images have "
                        f"{self.cfg.mm_tokens_per_image}")
            if r.offset < end or r.offset + r.length > state.num_prompt_tokens:
                return (f"{where} overlaps the image before it or lies outside the "
                        f"{state.num_prompt_tokens}-token prompt")
            if any(t != self.cfg.image_token_id for t in state.token_ids[r.offset:r.offset + r.length]):
                return f"{where}: not all of them are the image token {self.cfg.image_token_id}"
            end = r.offset + r.length
        return None

    def prepare(self, scheduled: Sequence[tuple[RequestState, int]]) -> StepImages:
        """The embeddings of every image whose soft tokens the scheduled chunks hold (call
        before num_computed_tokens moves), and the requests that must fail instead."""
        needs: dict[int, tuple[RequestState, list[int]]] = {}  # id(request) -> (request, its images here)
        pieces: dict[str, ImagePiece] = {}  # distinct embedding keys, in order of first need
        for state, n in scheduled:
            if state.num_computed_tokens < state.images_end:
                slices = image_slices(state.image_ranges, state.num_computed_tokens, n, 0)
                images = sorted({s.image for s in slices})
                if images:
                    needs[id(state)] = (state, images)
                    pieces.update((state.image_keys[i], state.image_pieces[i]) for i in images)
        embeddings: dict[str, torch.Tensor] = {}
        missing = []
        for digest in pieces:
            embeds = self.cache.get(digest)
            if embeds is None:
                missing.append(digest)
            else:
                embeddings[digest] = embeds
        hits = len(embeddings)
        published = 0
        if missing and self.published is not None:
            found = self.published.fetch(missing)
            for digest, embeds in found.items():
                self.cache.put(digest, embeds)
                embeddings[digest] = embeds
            published = len(found)
            missing = [d for d in missing if d not in found]
        encoded: dict[str, torch.Tensor] = {}
        failures: dict[str, str] = {}
        seconds = 0.0
        if missing:
            start = time.perf_counter()
            ready, encoded, failures = self._get_missing(missing, pieces)
            seconds = time.perf_counter() - start
            for digest, embeds in (*ready.items(), *encoded.items()):
                self.cache.put(digest, embeds)
            embeddings.update(ready)
            embeddings.update(encoded)
            published += len(ready)
        failed = []
        for state, images in needs.values():
            bad = next((i for i in images if state.image_keys[i] in failures), None)
            if bad is not None:
                piece = state.image_pieces[bad]
                crop = "" if piece.crop is None else f", crop box {tuple(piece.crop)}"
                failed.append((state, f"image {bad} (content hash {piece.content_hash}{crop}): "
                                      f"{failures[piece.key]}"))
        return StepImages(embeddings=embeddings, failed=failed,
                          stats=VisionStepStats(items_encoded=len(encoded), cache_hits=hits, seconds=seconds,
                                                published_hits=published, queries=len(pieces)))

    def _get_missing(self, missing: list[str], pieces: dict[str, ImagePiece]
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
        """The embeddings of `missing` (keys of `pieces`, in neither the cache nor published
        a moment ago):
        (published meanwhile, encoded here, failures). With an encoder service, each is
        claimed first (PublishedEmbeddings.take): those only queued for an encoder (it is
        behind: the scheduler waited as long as it would) are taken over, encoded and
        published, so the encoder skips them; those another party is encoding are waited
        for, not encoded twice (`_wait_for_held`) -- after this worker has encoded and
        published its own, so two workers each waiting for the other's never stall."""
        if self.published is None:
            encoded, failures = self.encoder.encode_pieces([pieces[k] for k in missing])
            return {}, encoded, failures
        claims = self.published.take(missing, self.owner, TAKEN_TTL_S)
        ready = self.published.fetch(claims.published)
        unusable = [h for h in claims.published if h not in ready]
        encoded, failures = self._encode(claims.taken, claims.free + unusable, pieces)
        if claims.held:
            more, taken, here = self._wait_for_held(claims.held)
            ready.update(more)
            late, late_failures = self._encode(taken, here, pieces)
            encoded.update(late)
            failures.update(late_failures)
        return ready, encoded, failures

    def _encode(self, taken: list[str], own: list[str], pieces: dict[str, ImagePiece]
                ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Encode `taken` (claimed: published after) and `own` (unclaimed) in one batch."""
        if not taken and not own:
            return {}, {}
        encoded, failures = self.encoder.encode_pieces([pieces[k] for k in taken + own])
        if taken:
            self._publish_taken(taken, encoded)
        return encoded, failures

    def _wait_for_held(self, held: list[str]) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
        """Wait for the media another party (an encoder, another worker) is encoding now.
        Returns (their published embeddings; those whose claim went unpublished -- the
        holder gave up or died -- now this worker's to encode and publish; those to encode
        here unclaimed: still held after `held_wait_s`, rather than stall the step longer,
        or whose published value is unusable). The step waits on the compute thread: at
        most the rest of an encoding it would otherwise repeat."""
        deadline = time.monotonic() + self.held_wait_s
        ready: dict[str, torch.Tensor] = {}
        taken: list[str] = []
        here: list[str] = []
        while held:
            if time.monotonic() >= deadline:
                log.warning("%d medium(s) still being encoded elsewhere after %.1f s: encoding them here too",
                            len(held), self.held_wait_s)
                return ready, taken, here + held
            time.sleep(HELD_POLL_S)
            claims = self.published.take(held, self.owner, TAKEN_TTL_S, take_free=True)
            found = self.published.fetch(claims.published)
            ready.update(found)
            taken += claims.taken
            here += claims.free + [h for h in claims.published if h not in found]  # free: Redis failed
            held = claims.held
        return ready, taken, here

    def _publish_taken(self, taken: list[str], encoded: dict[str, torch.Tensor]) -> None:
        """Publish what this step took over from the encoders' queue and encoded; give up the
        claims of what it could not. Redis failing here fails nothing: their claims run out
        (TAKEN_TTL_S) and whoever needs them next encodes them."""
        try:
            self.published.publish({h: encoded[h] for h in taken if h in encoded}, PUBLISHED_TTL_S)
            self.published.release([h for h in taken if h not in encoded])
        except (redis.RedisError, OSError) as exc:
            log.warning("could not publish %d embeddings taken over from the encoders: %s", len(taken), exc)


def place_step_images(inputs_embeds: torch.Tensor, images: Sequence[tuple[RequestState, ImageSlice]],
                      embeddings: dict[str, torch.Tensor]) -> torch.Tensor:
    """Write each image slice's embeddings (its image's, by embedding key) over its rows of
    `inputs_embeds` [T, hidden] (the flat batch's `images`), in place; returns it."""
    slices = [replace(s, image=k) for k, (_, s) in enumerate(images)]
    tensors = [embeddings[state.image_keys[s.image]] for state, s in images]
    rows, embeds = splice_rows(slices, tensors, inputs_embeds.device)
    return place_image_embeddings(inputs_embeds, rows, embeds)
