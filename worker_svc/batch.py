"""The flat batch of one step: every scheduled token of every request in one row axis.

Request i contributes rows `query_start_loc[i]:query_start_loc[i+1]`: its tokens
`token_ids[num_computed : num_computed + n]` at positions `num_computed ...`. Each KV cache
group g of the model (kvstore/kv_cache_groups.py) writes position p's K/V to slot
`block_tables[g][p // block_size] * block_size + p % block_size` and reads through its own
table, so `attn.groups[g]` (modeling/attention_metadata.py) holds that group's slot mapping,
block table tensor and attention plan; the layers of group g use it. Its context after this
step is `seq_lens[i] = num_computed + n` tokens. A request whose step catches up with its
token list samples one token from the logits of its last row (`logits_indices`).

Images (Gemma 3): the soft tokens of a request's image i (`RequestState.image_ranges[i]`,
positions [offset, offset + length)) that fall in its chunk are listed in `images` with
their rows (modeling/image_placement.py's ImageSlice), where the runner places the
image's embeddings; and each such row gets the bidirectional span [offset, offset + length)
in `bidir_spans` (int32 [T, 2] on the device, [0, 0] for every other row), which every
window's attention plan takes: the image's tokens see each other both ways. A chunk may
start inside an image (the image's first tokens' K/V are cached, computed with the whole
image) but never end inside one: the rows would need keys not computed yet, so the
scheduler keeps an image's soft tokens in one step. With no image row in the step,
`bidir_spans` is None and the plans are the causal ones.

Built by the persistent batch (worker_svc/input_batch.py): every tensor here is a view of
the step's inputs on the device, valid until the next step is prepared. A CUDA graph step
is padded (R = T = the graph's batch size; the padded rows read row 0 and write nowhere).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from modeling.attention_metadata import AttentionMetadata
from modeling.image_placement import ImageSlice, image_slices
from worker_svc.request_state import RequestState
from worker_svc.sampler import SamplingBatch


@dataclass(frozen=True)
class FlatBatch:
    input_ids: torch.Tensor  # int32 [T]
    positions: torch.Tensor  # int32 [T]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # int32 [S]: the row each sampling request samples from
    sampling_requests: tuple[RequestState, ...]  # in logits_indices order
    # the image soft tokens of each request's chunk, and the rows they are at
    images: tuple[tuple[RequestState, ImageSlice], ...] = ()
    # the sampling rows' settings, views of the step's inputs; None when no row samples
    sampling: SamplingBatch | None = None


def whole_image_slices(req: RequestState, start: int, n: int, first_row: int) -> list[ImageSlice]:
    """The request's image soft tokens in its chunk; ValueError for a chunk that ends
    inside an image (its rows would need the K/V of the image's tokens after the chunk)."""
    slices = image_slices(req.image_ranges, start, n, first_row)
    for s in slices:
        if s.end < req.image_ranges[s.image].length:
            r = req.image_ranges[s.image]
            raise ValueError(
                f"request {req.request_id!r}: the chunk of positions [{start}, {start + n}) ends "
                f"inside image {s.image} (soft tokens [{r.offset}, {r.offset + r.length})): an "
                "image's soft tokens must be computed in one step")
    return slices


def bidir_spans_of(images: Sequence[tuple[RequestState, ImageSlice]], num_tokens: int,
                   device: torch.device) -> torch.Tensor:
    """int32 [num_tokens, 2]: the rows of each image slice hold their image's
    [offset, offset + length), every other row [0, 0]."""
    spans = torch.zeros(num_tokens, 2, dtype=torch.int32)
    for req, s in images:
        r = req.image_ranges[s.image]
        spans[s.row:s.row + s.end - s.start] = torch.tensor([r.offset, r.offset + r.length], dtype=torch.int32)
    return spans.to(device)


def effective_window(window: int | None, max_seq_len: int) -> int | None:
    """A window no context this step outgrows is full attention for this step (same
    result; full attention takes SDPA's causal fast path)."""
    return None if window is None or window >= max_seq_len else window
