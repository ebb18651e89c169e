"""Media to image embeddings: fetched from the media store, decoded, preprocessed and run
through the vision tower in one batch -- the one path the worker's steps
(worker_svc/vision_step.py) and the encoder service (encoder_svc/) both encode by, so an
embedding is the same whoever computed it.

    media_encoder = MediaEncoder.load(model_dir, vision_cfg, dtype, device, media)
    embeds, failures = media_encoder.encode_pieces(pieces)     ImagePiece(content_hash, crop)
        embeds    piece.key -> [mm_tokens_per_image, hidden] on the device, each tensor
                  its own memory (safe to keep in a cache)
        failures  piece.key -> why it could not be had (missing from the store,
                  undecodable, a crop box outside the image): the caller fails what needs
                  it, alone
    media_encoder.encode(hashes)     the same for whole images, keyed by content hash (the
                                     encoder service's: it never encodes crops)

A piece is a whole image or one pan-and-scan crop of it (proto/pan_and_scan.py; the box
comes from the gateway, which cut the prompt by it): each medium is fetched and decoded
once however many of its pieces the batch holds. The encoder runs in the decoder's dtype on
its device; pixel values are float32 from the preprocessor, cast by the encoder. A
checkpoint whose image processor turns pan-and-scan on needs nothing here: the gateway
reads that setting and names the crops.
"""

from __future__ import annotations

from collections.abc import Sequence
from io import BytesIO
from pathlib import Path

import torch
from PIL import Image

from modeling.gemma3_vision import Gemma3VisionConfig, Gemma3VisionEncoder, load_vision_encoder
from proto.messages import MediaItem
from proto.pan_and_scan import ImagePiece
from vision.image_preprocess import ImagePreprocessConfig, preprocess_piece, rgb_array
from vision.media_source import MediaSource, MediaUnavailableError


class MediaEncoder:
    """The vision encoder of one process, its preprocessing and its media source."""

    def __init__(self, encoder: Gemma3VisionEncoder, preprocess: ImagePreprocessConfig,
                 media: MediaSource, device: torch.device):
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
        preprocess = ImagePreprocessConfig.from_checkpoint(model_dir)  # before the weights load
        return cls(load_vision_encoder(model_dir, cfg, dtype, device, load_format), preprocess, media, device)

    @property
    def embeddings_shape(self) -> tuple[int, int]:
        return self.cfg.mm_tokens_per_image, self.cfg.text_hidden_size

    def encode(self, hashes: Sequence[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """`encode_pieces` of the whole images of `hashes` (distinct): by content hash."""
        return self.encode_pieces([ImagePiece(h) for h in hashes])

    def encode_pieces(self, pieces: Sequence[ImagePiece]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Fetch (one MediaSource call for their distinct media), decode (each medium once),
        preprocess and encode (one batch) `pieces` (distinct keys). Returns (embeddings by
        piece key, why not by piece key)."""
        hashes = list(dict.fromkeys(p.content_hash for p in pieces))
        media_failures: dict[str, str] = {}
        try:
            items = self.media.fetch(hashes)
        except MediaUnavailableError as exc:
            items, media_failures = exc.found, dict(exc.reasons)
        images = {}
        for digest in hashes:
            if digest in media_failures:
                continue
            item = items.get(digest)
            if item is None:
                media_failures[digest] = "the media source did not return it"
                continue
            try:
                image = decode_media(item)
            except Exception as exc:  # any decoding error is this item's, not the batch's
                media_failures[digest] = f"cannot be decoded as an image: {type(exc).__name__}: {exc}"
                continue
            try:  # converted once, however many pieces are cut from it
                images[digest] = rgb_array(image, self.preprocess)
            except Exception as exc:  # an image mode the config cannot use
                media_failures[digest] = f"cannot be preprocessed: {type(exc).__name__}: {exc}"
        failures = {p.key: media_failures[p.content_hash] for p in pieces if p.content_hash in media_failures}
        pixels: list[torch.Tensor] = []
        encoded_keys: list[str] = []
        for piece in pieces:
            if piece.content_hash not in images:
                continue
            try:
                pixels.append(preprocess_piece(images[piece.content_hash], self.preprocess, piece.crop))
            except Exception as exc:  # this piece's (a bad crop box), not the batch's
                failures[piece.key] = f"cannot be preprocessed: {type(exc).__name__}: {exc}"
                continue
            encoded_keys.append(piece.key)
        if not pixels:
            return {}, failures
        with torch.inference_mode():  # the worker's steps run in it already; the encoder service's loop does not
            out = self.encoder(torch.stack(pixels).to(self.device))
        if self.device.type == "cuda":  # the time is the encoder's, not the next kernel's
            torch.cuda.synchronize(self.device)
        if len(encoded_keys) == 1:
            return {encoded_keys[0]: out[0]}, failures
        return {key: out[i].clone() for i, key in enumerate(encoded_keys)}, failures


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
