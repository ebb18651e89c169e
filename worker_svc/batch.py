"""The flat batch of one step: every scheduled token of every request in one row axis.

Request i contributes rows `query_start_loc[i]:query_start_loc[i+1]`: its tokens
`token_ids[num_computed : num_computed + n]` at positions `num_computed ...`, each written
to slot `block_table[pos // block_size] * block_size + pos % block_size`. Its context after
this step is `seq_lens[i] = num_computed + n` tokens. A request whose step catches up with
its token list samples one token from the logits of its last row (`logits_indices`).

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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
import torch

from worker_svc.model.image_placement import ImageSlice, image_slices
from worker_svc.request_state import RequestState


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [R, max_blocks], padded with 0 (a finite block)
    seq_lens: torch.Tensor  # int32 [R]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    plans: dict  # window (None: full attention) -> the backend's plan for this step, shared by its layers
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
                     windows: Iterable[int | None] = (None,)) -> FlatBatch:
    """`scheduled`: (request, number of tokens to compute this step), in batch order.
    `plan_fn` is the attention backend's `plan`, called once for each of the model's
    attention `windows` (None: full attention)."""
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
        if num_blocks > len(req.block_ids):
            raise ValueError(
                f"request {req.request_id!r}: {end} tokens need {num_blocks} blocks, "
                f"its block table has {len(req.block_ids)}")
        ids.extend(req.token_ids[start:end])
        q_lens.append(n)
        computed.append(start)
        ends.append(end)
        tables.append(req.block_ids[:num_blocks])
        if start < req.images_end:
            images.extend((req, s) for s in _whole_image_slices(req, start, n, row))
        row += n
        if end == req.num_tokens:
            samplers.append(req)
            sample_rows.append(row - 1)

    max_blocks = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables],
                                dtype=torch.int32)
    q_lens_t = torch.tensor(q_lens, dtype=torch.long)
    computed_t = torch.tensor(computed, dtype=torch.long)
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.long)
    torch.cumsum(q_lens_t, 0, out=query_start_loc[1:])
    num_tokens = row
    req_of_row = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t, output_size=num_tokens)
    positions = (torch.arange(num_tokens) - query_start_loc[:-1][req_of_row]
                 + computed_t[req_of_row])
    block_of_row = block_tables[req_of_row, positions // block_size].long()
    slot_mapping = block_of_row * block_size + positions % block_size

    block_tables = block_tables.to(device)
    seq_lens = (computed_t + q_lens_t).to(torch.int32).to(device)
    query_start_loc = query_start_loc.to(torch.int32).to(device)
    bidir_spans = _bidir_spans(images, num_tokens, device) if images else None
    return FlatBatch(
        input_ids=torch.tensor(ids, dtype=torch.long).to(device),
        positions=positions.to(device),
        attn=AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            plans=_plans(windows, max(end for end in ends), plan_fn,
                         (block_tables, seq_lens, query_start_loc, block_size), bidir_spans),
            bidir_spans=bidir_spans,
        ),
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


def _plans(windows: Iterable[int | None], max_seq_len: int, plan_fn, args: tuple,
           bidir_spans: torch.Tensor | None = None) -> dict:
    """One plan per window, each given the step's `bidir_spans`; a window no context this
    step outgrows is full attention for this step (same result; full attention takes
    SDPA's causal fast path)."""
    plans: dict = {}
    for window in windows:
        effective = None if window is None or window >= max_seq_len else window
        if effective not in plans:
            plans[effective] = plan_fn(*args, effective, bidir_spans=bidir_spans)
        plans[window] = plans[effective]
    return plans
