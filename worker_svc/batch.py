"""The flat batch of one step: every scheduled token of every request in one row axis.

Request i contributes rows `query_start_loc[i]:query_start_loc[i+1]`: its tokens
`token_ids[num_computed : num_computed + n]` at positions `num_computed ...`. Each KV cache
group g of the model (kvstore/kv_cache_groups.py) writes position p's K/V to slot
`block_tables[g][p // block_size] * block_size + p % block_size` and reads through its own
table, so `attn.groups[g]` holds that group's slot mapping, block table tensor and attention
plan; the layers of group g use it. Its context after this step is `seq_lens[i] =
num_computed + n` tokens. A request whose step catches up with its token list samples one
token from the logits of its last row (`logits_indices`).

Images (Gemma 3): the soft tokens of a request's image i (`RequestState.image_ranges[i]`,
positions [offset, offset + length)) that fall in its chunk are listed in `images` with
their rows (worker_svc/model/image_placement.py's ImageSlice), where the runner places the
image's embeddings; and each such row gets the bidirectional span [offset, offset + length)
in `bidir_spans` (int32 [T, 2] on the device, [0, 0] for every other row), which every
window's attention plan takes: the image's tokens see each other both ways. A chunk may
start inside an image (the image's first tokens' K/V are cached, computed with the whole
image) but never end inside one: the rows would need keys not computed yet, so the
scheduler keeps an image's soft tokens in one step. With no image row in the step,
`bidir_spans` is None and the plans are today's causal ones.

Built with per-request Python work and vectorised torch ops for everything per token.
"""

from collections.abc import Sequence
from dataclasses import dataclass
import torch

from worker_svc.model.image_placement import ImageSlice, image_slices
from worker_svc.request_state import RequestState


@dataclass(frozen=True)
class GroupAttention:
    """One KV cache group's view of the step."""

    slot_mapping: torch.Tensor  # int64 [T]: where each row's K/V go in this group's blocks
    block_tables: torch.Tensor  # int32 [R, max_blocks], padded with 0 (a finite block)
    plan: object  # the backend's attention plan for this group's window, shared by its layers


@dataclass(frozen=True)
class AttentionMetadata:
    groups: tuple[GroupAttention, ...]  # one per KV cache group
    seq_lens: torch.Tensor  # int32 [R]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    # int32 [T, 2]: each row's image [start, end), [0, 0] for text; None: no image row this step
    bidir_spans: torch.Tensor | None = None


@dataclass(frozen=True)
class FlatBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [S]: the row each sampling request samples from
    sampling_requests: tuple[RequestState, ...]  # in logits_indices order
    # the image soft tokens of each request's chunk, and the rows they are at
    images: tuple[tuple[RequestState, ImageSlice], ...] = ()


def build_flat_batch(scheduled: Sequence[tuple[RequestState, int]], block_size: int,
                     plan_fn, device: torch.device,
                     group_windows: Sequence[int | None] = (None,)) -> FlatBatch:
    """`scheduled`: (request, number of tokens to compute this step), in batch order.
    `plan_fn` is the attention backend's `plan`, called once for each KV cache group, with
    the group's window (`group_windows`; None: full attention)."""
    ids: list[int] = []
    q_lens, computed, ends, tables, samplers, sample_rows = [], [], [], [], [], []
    images: list[tuple[RequestState, ImageSlice]] = []
    row = 0
    for req, n in scheduled:
        start = req.num_computed_tokens
        end = start + n
        if n <= 0 or end > req.num_tokens:
            raise ValueError(
                f"request {req.request_id!r}: cannot compute {n} tokens from "
                f"{start} (it has {req.num_tokens})")
        num_blocks = -(-end // block_size)
        if num_blocks > len(req.block_tables[0]):
            raise ValueError(
                f"request {req.request_id!r}: {end} tokens need {num_blocks} blocks, "
                f"its block table has {len(req.block_tables[0])}")
        ids.extend(req.token_ids[start:end])
        q_lens.append(n)
        computed.append(start)
        ends.append(end)
        tables.append([table[:num_blocks] for table in req.block_tables])
        if start < req.images_end:
            images.extend((req, s) for s in _whole_image_slices(req, start, n, row))
        row += n
        if end == req.num_tokens:
            samplers.append(req)
            sample_rows.append(row - 1)

    num_groups = len(group_windows)
    if any(len(t) != num_groups for t in tables):
        raise ValueError(f"a request's block tables are not those of {num_groups} KV cache groups")
    max_blocks = max(len(t[0]) for t in tables)
    # [G, R, max_blocks]
    block_tables = torch.tensor([[t[g] + [0] * (max_blocks - len(t[g])) for t in tables]
                                 for g in range(num_groups)], dtype=torch.int32)
    q_lens_t = torch.tensor(q_lens, dtype=torch.long)
    computed_t = torch.tensor(computed, dtype=torch.long)
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.long)
    torch.cumsum(q_lens_t, 0, out=query_start_loc[1:])
    num_tokens = row
    req_of_row = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t, output_size=num_tokens)
    positions = (torch.arange(num_tokens) - query_start_loc[:-1][req_of_row]
                 + computed_t[req_of_row])
    block_of_row = block_tables[:, req_of_row, positions // block_size].long()  # [G, T]
    slot_mappings = (block_of_row * block_size + positions % block_size).to(device)

    block_tables = block_tables.to(device)
    seq_lens = (computed_t + q_lens_t).to(torch.int32).to(device)
    query_start_loc = query_start_loc.to(torch.int32).to(device)
    bidir_spans = _bidir_spans(images, num_tokens, device) if images else None
    max_seq_len = max(ends)
    groups = tuple(
        GroupAttention(slot_mapping=slot_mappings[g], block_tables=block_tables[g],
                       plan=plan_fn(block_tables[g], seq_lens, query_start_loc, block_size,
                                    _effective_window(window, max_seq_len), bidir_spans=bidir_spans))
        for g, window in enumerate(group_windows))
    return FlatBatch(
        input_ids=torch.tensor(ids, dtype=torch.long).to(device),
        positions=positions.to(device),
        attn=AttentionMetadata(groups=groups, seq_lens=seq_lens, query_start_loc=query_start_loc,
                               bidir_spans=bidir_spans),
        logits_indices=torch.tensor(sample_rows, dtype=torch.long).to(device),
        sampling_requests=tuple(samplers),
        images=tuple(images),
    )


def _whole_image_slices(req: RequestState, start: int, n: int, first_row: int) -> list[ImageSlice]:
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


def _bidir_spans(images: Sequence[tuple[RequestState, ImageSlice]], num_tokens: int,
                 device: torch.device) -> torch.Tensor:
    """int32 [num_tokens, 2]: the rows of each image slice hold their image's
    [offset, offset + length), every other row [0, 0]."""
    spans = torch.zeros(num_tokens, 2, dtype=torch.int32)
    for req, s in images:
        r = req.image_ranges[s.image]
        spans[s.row:s.row + s.end - s.start] = torch.tensor([r.offset, r.offset + r.length], dtype=torch.int32)
    return spans.to(device)


def _effective_window(window: int | None, max_seq_len: int) -> int | None:
    """A window no context this step outgrows is full attention for this step (same
    result; full attention takes SDPA's causal fast path)."""
    return None if window is None or window >= max_seq_len else window
