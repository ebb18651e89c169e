"""Media to image embeddings: fetched from the media store, decoded, preprocessed and run
through the vision tower in one batch -- the one path the worker's steps
(worker_svc/vision_step.py) and the encoder service (encoder_svc/) both encode by, so an
embedding is the same whoever computed it.

    media_encoder = MediaEncoder.load(model_dir, vision_cfg, dtype, device, media)
    embeds, failures = media_encoder.encode(hashes)
        embeds    content hash -> [mm_tokens_per_image, hidden] on the device, each tensor
                  its own memory (safe to keep in a cache)
        failures  content hash -> why it could not be had (missing from the store,
                  undecodable): the caller fails what needs it, alone

The encoder runs in the decoder's dtype on its device; pixel values are float32 from the
preprocessor, cast by the encoder. Pan-and-scan crops are not wired (the gateway never asks
for them, Gemma 3's configs leave them off): a checkpoint that turns them on is refused at
load.
"""

from __future__ import annotations

from collections.abc import Sequence
from io import BytesIO
from pathlib import Path

import torch
from PIL import Image

from proto.messages import MediaItem
from worker_svc.image_preprocess import ImagePreprocessConfig, preprocess_image
from worker_svc.media_source import MediaSource, MediaUnavailableError
from worker_svc.model.gemma3_vision import Gemma3VisionConfig, Gemma3VisionEncoder, load_vision_encoder


class MediaEncoder:
    """The vision encoder of one process, its preprocessing and its media source."""

    def __init__(self, encoder: Gemma3VisionEncoder, preprocess: ImagePreprocessConfig,
                 media: MediaSource, device: torch.device):
        refuse_pan_and_scan(preprocess)
        self.encoder = encoder
        self.cfg: Gemma3VisionConfig = encoder.cfg
        self.preprocess = preprocess
        self.media = media
        self.device = device

    @classmethod
    def load(cls, model_dir: str | Path, cfg: Gemma3VisionConfig, dtype: torch.dtype,
             device: torch.device, media: MediaSource, load_format: str = "auto") -> MediaEncoder:
        """The checkpoint's encoder in `dtype` on `device` (random weights with `load_format`
        "dummy") and its preprocessing config."""
        preprocess = ImagePreprocessConfig.from_checkpoint(model_dir)
        refuse_pan_and_scan(preprocess)  # before the weights load
        return cls(load_vision_encoder(model_dir, cfg, dtype, device, load_format), preprocess, media, device)

    @property
    def embeddings_shape(self) -> tuple[int, int]:
        return self.cfg.mm_tokens_per_image, self.cfg.text_hidden_size

    def encode(self, hashes: Sequence[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Fetch (one MediaSource call), decode, preprocess and encode (one batch) the media
        of `hashes` (distinct). Returns (embeddings by hash, why not by hash)."""
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
            except Exception as exc:  # any decoding error is this item's, not the batch's
                failures[digest] = f"cannot be decoded as an image: {type(exc).__name__}: {exc}"
                continue
            encoded_hashes.append(digest)
        if not pixels:
            return {}, failures
        with torch.inference_mode():  # the worker's steps run in it already; the encoder service's loop does not
            out = self.encoder(torch.stack(pixels).to(self.device))
        if self.device.type == "cuda":  # the time is the encoder's, not the next kernel's
            torch.cuda.synchronize(self.device)
        if len(encoded_hashes) == 1:
            return {encoded_hashes[0]: out[0]}, failures
        return {digest: out[i].clone() for i, digest in enumerate(encoded_hashes)}, failures


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
