"""The vision part of a step: the embeddings of the images whose soft tokens a step
computes, from the encoder cache or encoded now, and their placement over the decoder's
input embeddings (Gemma 3; docs/architecture.md, "Images and video").

    embedder = ImageEmbedder.load(model_dir, vision_cfg, dtype, device, media, cache_bytes)
    embedder.check(state)                -> why the request's images cannot run here, or None
    images = embedder.prepare(scheduled) (before the flat batch is built)
        1. the images whose soft tokens fall in the scheduled chunks, by content hash,
           each once however many requests of the step carry it
        2. those in the encoder cache (worker_svc/encoder_cache.py) are hits
        3. the others: one MediaSource.fetch for all of them (worker_svc/media_source.py),
           each decoded (PIL: the file's bytes, or raw RGB for a video frame) and
           preprocessed (worker_svc/image_preprocess.py), then ONE encoder call for the
           batch; each result goes into the cache
        -> StepImages: embeddings by hash, the requests that cannot run (an image missing
           or undecodable: they fail alone, with its reason), and the step's counts
    h = model.embed(batch.input_ids)
    place_step_images(h, batch.images, images.embeddings)   h's soft-token rows = the images'
    logits = model(..., inputs_embeds=h)

A step without image soft tokens never comes here (the runner checks `image_ranges`).
The encoder runs in the decoder's dtype on its device; pixel values are float32 from the
preprocessor, cast by the encoder. Pan-and-scan crops are not wired (the gateway never asks
for them, Gemma 3's configs leave them off): a checkpoint that turns them on is refused at
load.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from io import BytesIO
from pathlib import Path

import torch
from PIL import Image

from proto.messages import MediaItem
from worker_svc.encoder_cache import EncoderCache
from worker_svc.image_preprocess import ImagePreprocessConfig, preprocess_image
from worker_svc.media_source import MediaSource, MediaUnavailableError
from worker_svc.model.gemma3_vision import Gemma3VisionConfig, Gemma3VisionEncoder, load_vision_encoder
from worker_svc.model.image_placement import ImageSlice, image_slices, place_image_embeddings, splice_rows
from worker_svc.request_state import RequestState


@dataclass(frozen=True)
class VisionStepStats:
    """What one step's images cost: for the worker's /metrics (proto/metrics.py EncoderRecorder)."""

    items_encoded: int  # distinct images (or frames) encoded in this step
    cache_hits: int  # distinct images of this step found in the encoder cache
    seconds: float  # fetching, decoding, preprocessing and encoding those encoded (0 when none)


@dataclass(frozen=True)
class StepImages:
    embeddings: dict[str, torch.Tensor]  # content hash -> [mm_tokens_per_image, hidden], on the device
    failed: list[tuple[RequestState, str]]  # requests that cannot run: an image of theirs could not be had
    stats: VisionStepStats


class ImageEmbedder:
    """The encoder, its preprocessing, the encoder cache and the media source of one worker."""

    def __init__(self, encoder: Gemma3VisionEncoder, preprocess: ImagePreprocessConfig,
                 cache: EncoderCache, media: MediaSource, device: torch.device):
        refuse_pan_and_scan(preprocess)
        self.encoder = encoder
        self.cfg: Gemma3VisionConfig = encoder.cfg
        self.preprocess = preprocess
        self.cache = cache
        self.media = media
        self.device = device

    @classmethod
    def load(cls, model_dir: str | Path, cfg: Gemma3VisionConfig, dtype: torch.dtype,
             device: torch.device, media: MediaSource, cache_bytes: int) -> ImageEmbedder:
        """The checkpoint's encoder in `dtype` on `device`, its preprocessing config, and an
        encoder cache of `cache_bytes`."""
        preprocess = ImagePreprocessConfig.from_checkpoint(model_dir)
        refuse_pan_and_scan(preprocess)  # before the weights load
        encoder = load_vision_encoder(model_dir, cfg, dtype, device)
        return cls(encoder, preprocess, EncoderCache(cache_bytes), media, device)

    def check(self, state: RequestState) -> str | None:
        """Why `state`'s images cannot be served (placeholder ranges that are not the
        model's: wrong length, out of the prompt, overlapping, not image tokens), or None."""
        end = 0
        for i, (r, digest) in enumerate(zip(state.image_ranges, state.image_hashes)):
            where = f"image {i} (soft tokens [{r.offset}, {r.offset + r.length}))"
            if not digest:
                return f"{where} has no content hash"
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
        hashes: dict[str, None] = {}  # distinct content hashes, in order of first need
        for state, n in scheduled:
            if state.num_computed_tokens < state.images_end:
                slices = image_slices(state.image_ranges, state.num_computed_tokens, n, 0)
                images = sorted({s.image for s in slices})
                if images:
                    needs[id(state)] = (state, images)
                    hashes.update(dict.fromkeys(state.image_hashes[i] for i in images))
        embeddings: dict[str, torch.Tensor] = {}
        missing = []
        for digest in hashes:
            embeds = self.cache.get(digest)
            if embeds is None:
                missing.append(digest)
            else:
                embeddings[digest] = embeds
        hits = len(embeddings)
        encoded: dict[str, torch.Tensor] = {}
        failures: dict[str, str] = {}
        seconds = 0.0
        if missing:
            start = time.perf_counter()
            encoded, failures = self._encode_missing(missing)
            seconds = time.perf_counter() - start
            embeddings.update(encoded)
        failed = []
        for state, images in needs.values():
            bad = next((i for i in images if state.image_hashes[i] in failures), None)
            if bad is not None:
                digest = state.image_hashes[bad]
                failed.append((state, f"image {bad} (content hash {digest}): {failures[digest]}"))
        return StepImages(embeddings=embeddings, failed=failed,
                          stats=VisionStepStats(items_encoded=len(encoded), cache_hits=hits, seconds=seconds))

    def _encode_missing(self, hashes: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Fetch, decode, preprocess and encode (one batch) the images of `hashes`; each
        result cached. Returns (embeddings by hash, why not by hash)."""
        failures: dict[str, str] = {}
        try:
            items = self.media.fetch(hashes)
        except MediaUnavailableError as exc:
            items, failures = exc.found, dict(exc.reasons)
        pixels: list[torch.Tensor] = []
        encoded_hashes: list[str] = []
        for digest in hashes:
            if digest in failures:
                continue
            item = items.get(digest)
            if item is None:
                failures[digest] = "the media source did not return it"
                continue
            try:
                pixels.append(preprocess_image(decode_media(item), self.preprocess)[0])
            except Exception as exc:  # any decoding error is this item's, not the step's
                failures[digest] = f"cannot be decoded as an image: {type(exc).__name__}: {exc}"
                continue
            encoded_hashes.append(digest)
        if not pixels:
            return {}, failures
        out = self.encoder(torch.stack(pixels).to(self.device))
        if self.device.type == "cuda":  # the time is the encoder's, not the next kernel's
            torch.cuda.synchronize(self.device)
        embeddings = {}
        for i, digest in enumerate(encoded_hashes):
            embeds = out[i] if len(encoded_hashes) == 1 else out[i].clone()  # own memory in the cache
            self.cache.put(digest, embeds)
            embeddings[digest] = embeds
        return embeddings, failures


def refuse_pan_and_scan(preprocess: ImagePreprocessConfig) -> None:
    """ValueError when the image processor's config turns pan-and-scan on: its crops (extra
    images, and another prompt expansion) are not wired through the gateway and the step."""
    if preprocess.do_pan_and_scan:
        raise ValueError("the checkpoint's image processor turns do_pan_and_scan on; this worker "
                         "encodes each image whole, without pan-and-scan crops: set it to false "
                         "(processor_config.json)")


def decode_media(item: MediaItem) -> Image.Image:
    """A stored item as a PIL image: an image file's bytes opened (decoded on first use, in
    full), or a video frame's raw RGB pixels."""
    if item.kind == "encoded":
        image = Image.open(BytesIO(item.data))
        image.load()
        return image
    if item.kind == "rgb8":
        expected = item.width * item.height * 3
        if item.width <= 0 or item.height <= 0 or len(item.data) != expected:
            raise ValueError(f"an rgb8 frame of {item.width}x{item.height} holds {expected} bytes, "
                             f"not {len(item.data)}")
        return Image.frombytes("RGB", (item.width, item.height), item.data)
    raise ValueError(f"unknown media kind {item.kind!r}")


def place_step_images(inputs_embeds: torch.Tensor, images: Sequence[tuple[RequestState, ImageSlice]],
                      embeddings: dict[str, torch.Tensor]) -> torch.Tensor:
    """Write each image slice's embeddings (its image's, by content hash) over its rows of
    `inputs_embeds` [T, hidden] (the flat batch's `images`), in place; returns it."""
    slices = [replace(s, image=k) for k, (_, s) in enumerate(images)]
    tensors = [embeddings[state.image_hashes[s.image]] for state, s in images]
    rows, embeds = splice_rows(slices, tensors, inputs_embeds.device)
    return place_image_embeddings(inputs_embeds, rows, embeds)
