"""Where a step's image embeddings go: which soft tokens of which image a request's chunk
holds, at which rows of the flat batch, and the write over those rows.

A request's image i occupies prompt positions `ranges[i].offset .. offset + length - 1`
(its `<image_soft_token>`s; length = mm_tokens_per_image). A step computes positions
`first_position .. first_position + num_tokens - 1` of the request at flat-batch rows
`first_row ..`. Then:

    image_slices(ranges, first_position, num_tokens, first_row)
        -> [ImageSlice(image=i, start, end, row)]  soft tokens start..end-1 of image i sit at
           rows row..row + end - start - 1 (a chunk boundary may cut an image: start > 0 or
           end < length)
    splice_rows(slices, embeddings)   embeddings[i]: image i's encoder output [length, hidden]
        -> (rows [R] int64, embeds [R, hidden]), every slice of every request concatenated
    h = model.embed(batch.input_ids)                 (scaled, as the decoder embeds)
    place_image_embeddings(h, rows, embeds)          h[rows] = embeds, in place
    logits = model(..., inputs_embeds=h)

This is transformers' Gemma3Model order: the text embeddings are scaled by sqrt(hidden)
(Gemma3TextScaledWordEmbedding), then `masked_scatter` puts the projector's outputs, cast to
the embeddings' dtype and not scaled, over the image-token rows, in order. The soft tokens'
own embedding rows are computed and overwritten (their ids are in the vocabulary for
Gemma 3: 262144 < 262208; transformers maps an id outside it to 0 first).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PlaceholderRange:
    """One image's soft tokens in a request's token sequence."""

    offset: int  # position of the first soft token
    length: int  # how many: the encoder's rows for the image (mm_tokens_per_image)


@dataclass(frozen=True)
class ImageSlice:
    """Soft tokens `start .. end - 1` of the request's image `image`, at flat-batch rows
    `row .. row + end - start - 1`."""

    image: int
    start: int
    end: int
    row: int


def image_slices(ranges: Sequence[PlaceholderRange], first_position: int, num_tokens: int,
                 first_row: int) -> list[ImageSlice]:
    """The parts of the images whose soft tokens fall in the chunk of `num_tokens`
    positions from `first_position`, computed at rows from `first_row`; in image order."""
    end_position = first_position + num_tokens
    slices = []
    for i, r in enumerate(ranges):
        lo, hi = max(r.offset, first_position), min(r.offset + r.length, end_position)
        if lo < hi:
            slices.append(ImageSlice(image=i, start=lo - r.offset, end=hi - r.offset,
                                     row=first_row + lo - first_position))
    return slices


def splice_rows(slices: Sequence[ImageSlice], embeddings: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [R] int64 on `device`, embeds [R, hidden]) for `place_image_embeddings`;
    `embeddings[s.image]` is that image's encoder output [length, hidden]."""
    if not slices:
        raise ValueError("no image slices to splice")
    rows = torch.cat([torch.arange(s.row, s.row + s.end - s.start) for s in slices]).to(device)
    embeds = torch.cat([embeddings[s.image][s.start:s.end] for s in slices]).to(device)
    return rows, embeds


def place_image_embeddings(inputs_embeds: torch.Tensor, rows: torch.Tensor,
                           image_embeds: torch.Tensor) -> torch.Tensor:
    """Write `image_embeds` [R, hidden] over rows `rows` [R] of the decoder's input
    embeddings `inputs_embeds` [T, hidden] (already scaled: DecoderForCausalLM.embed), in
    place, cast to their dtype; returns `inputs_embeds`."""
    if rows.shape[0] != image_embeds.shape[0]:
        raise ValueError(f"{rows.shape[0]} rows for {image_embeds.shape[0]} image embeddings")
    return inputs_embeds.index_copy_(0, rows, image_embeds.to(inputs_embeds.dtype))
