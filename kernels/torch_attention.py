"""The torch backend: paged attention and cache writes in vectorised torch ops (CPU path).

Same contract as kernels/reference.py (read its docstring for the flat varlen batch and
the cache layout). The work of reading block tables is done once per step in
`plan_attention` and shared by every layer.

paged_attention, in pseudo-code:

    decode rows (requests with q_len == 1), all at once:
        K = index_select(k_cache, block_tables[decodes, :max_blocks].flat)   # [B, L, kvh, d]
        mask[b, l] = l < seq_len[b]  (and l > seq_len[b] - 1 - window)
        # one query per request: fold the `group` query heads that share a kv head into
        # SDPA's query-length axis, so GQA needs no repeat of K/V
        out[rows] = sdpa(q.view(B, kvh, group, d), K^T, V^T, mask)
    every other request (prefill chunks), one by one:
        K = index_select(k_cache, its blocks).flat[:seq_len]              # [seq_len, kvh, d]
        p[j] = seq_len - q_len + j                                        # row j's position
        if a row's bidirectional span [s, e) reaches past it (e - 1 > p[j]):
            mask[j, l] = (l <= p[j] or s[j] <= l < e[j])  (and l > p[j] - window)
        elif q_len == seq_len and no window: causal = True, no mask (SDPA's fast path)
        else mask[j, l] = l <= p[j]  (and l > p[j] - window)
        out[rows] = sdpa(q, K, V, mask, enable_gqa=True)

Spans (`bidir_spans`, kernels/reference.py) never change a decode row (the last of its
context, and e <= seq_len), so they shape prefill masks only, and only of the requests
where some row's span reaches past it; without spans the plan does no extra work at all.

index_select is used instead of advanced indexing: on CPU it is ~2x faster for this gather.
The gathers write into a `GatherWorkspace` that outlives the step: allocating fresh ~10 MB
tensors per layer costs page faults (decode steps of the `small` preset at batch 32 were
~25% slower that way on a 2-core VM, with worse spikes).
Padded keys are masked, but SDPA still multiplies them by a zero probability, so they must
be finite: the cache is zero-initialised and only ever written with model outputs.
soft_cap needs the raw scores, so it takes an explicit-matmul path (Gemma only).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.host_layout import HostLayout


class GatherWorkspace:
    """Scratch K/V buffers for the gathers, grown on demand and reused by every layer of
    every step (layers run one after another, so one pair suffices)."""

    def __init__(self):
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def kv_buffers(self, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        numel = math.prod(shape)
        k = self._k
        if k is None or k.numel() < numel or k.dtype != like.dtype or k.device != like.device:
            grown = numel if k is None or k.dtype != like.dtype else max(numel, k.numel() * 3 // 2)
            self._k = torch.empty(grown, dtype=like.dtype, device=like.device)
            self._v = torch.empty(grown, dtype=like.dtype, device=like.device)
        return self._k[:numel].view(shape), self._v[:numel].view(shape)


def _gather_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                   workspace: GatherWorkspace, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `block_ids`, [n, block_size, kvh, d] each, in the workspace; converted to
    `dtype` (the query's) where the cache is kept in another (`--kv-cache-dtype`)."""
    k, v = workspace.kv_buffers((block_ids.numel(), *k_cache.shape[1:]), k_cache)
    torch.index_select(k_cache, 0, block_ids, out=k)
    torch.index_select(v_cache, 0, block_ids, out=v)
    if k.dtype != dtype:
        return k.to(dtype), v.to(dtype)
    return k, v


@dataclass(frozen=True)
class PrefillSlice:
    start: int  # first query row
    end: int
    block_ids: torch.Tensor  # int64 [num_blocks_needed]
    seq_len: int
    mask: torch.Tensor | None  # bool [q_len, seq_len]; None = plain causal (q_len == seq_len)


@dataclass(frozen=True)
class AttentionPlan:
    """Per-step gather indices and masks, built once and used by every layer."""

    block_size: int
    decode_rows: torch.Tensor  # int64 [B]: query rows of the q_len == 1 requests
    decode_block_ids: torch.Tensor  # int64 [B * max_blocks]
    decode_mask: torch.Tensor  # bool [B, 1, 1, max_blocks * block_size]
    prefills: tuple[PrefillSlice, ...]
    workspace: GatherWorkspace


def _causal_mask(q_len: int, seq_len: int, sliding_window: int | None,
                 device: torch.device, spans: torch.Tensor | None = None) -> torch.Tensor | None:
    """bool [q_len, seq_len]: which keys each row sees; None for plain causal over the whole
    context. `spans`: the rows' bidirectional spans [q_len, 2], or None."""
    if q_len == seq_len and sliding_window is None and spans is None:
        return None
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if spans is not None:
        spans = spans.to(device=device, dtype=torch.long)
        allowed |= (k_pos >= spans[:, :1]) & (k_pos < spans[:, 1:])
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


def bidir_span_requests(bidir_spans: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor) -> list[bool]:
    """For each request: does a span make one of its rows see a key after its own position
    (e - 1 > p)? Only those requests need spans in their masks. Checks the contract first
    (ValueError): one [s, e) per query row, and each non-empty span holds its row's
    position: 0 <= s <= p < e <= seq_len; an empty one has s == e."""
    qsl = query_start_loc.cpu().long()
    lens = seq_lens.cpu().long()
    num_tokens = int(qsl[-1])
    if (bidir_spans.dim() != 2 or bidir_spans.shape[1] != 2 or bidir_spans.shape[0] < num_tokens
            or bidir_spans.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"bidir_spans must be int32 [num_tokens={num_tokens}, 2], got "
                         f"{bidir_spans.dtype} {tuple(bidir_spans.shape)}")
    spans = bidir_spans[:num_tokens].cpu().long()
    q_lens = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(len(lens)), q_lens, output_size=num_tokens)
    pos = torch.arange(num_tokens) - qsl[:-1][req] + (lens - q_lens)[req]
    s, e = spans[:, 0], spans[:, 1]
    some = s != e
    bad = (e < s) | (some & ((s < 0) | (s > pos) | (e <= pos) | (e > lens[req])))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"query row {row} (request {int(req[row])}, position {int(pos[row])}, "
                         f"context {int(lens[req[row]])}) has span {spans[row].tolist()}: a span "
                         "must hold its row's position and end within the context, or be empty")
    reaching = (some & (e - 1 > pos)).long()
    return (torch.zeros(len(lens), dtype=torch.long).index_add_(0, req, reaching) > 0).tolist()


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, block_size: int,
                   sliding_window: int | None = None,
                   workspace: GatherWorkspace | None = None,
                   only: list[int] | None = None, *,
                   bidir_spans: torch.Tensor | None = None, host: HostLayout | None = None) -> AttentionPlan:
    """Split the batch into decodes (vectorised) and prefill chunks (looped); precompute
    their gather indices and masks. Pass a long-lived `workspace` to reuse its buffers
    across steps (default: a fresh one, shared by this step's layers). `only`: plan just
    these requests (another kernel computes the rest). `bidir_spans`: int32 [num_tokens, 2],
    each query row's bidirectional block (kernels/reference.py), checked here (ValueError).
    `host`: the lengths as the host holds them (kernels/host_layout.py), read in place of
    the tensors (on a GPU: no synchronisation)."""
    device = block_tables.device
    starts = (query_start_loc if host is None else host.query_start_loc).tolist()
    lens = (seq_lens if host is None else host.seq_lens).tolist()
    reaching = None if bidir_spans is None else bidir_span_requests(bidir_spans, seq_lens,
                                                                   query_start_loc)
    decodes, prefills = [], []
    for i in range(len(lens)) if only is None else only:
        seq_len, q_len = lens[i], starts[i + 1] - starts[i]
        if q_len == 1:
            decodes.append(i)
        elif q_len > 1:
            num_blocks = -(-seq_len // block_size)
            spans = bidir_spans[starts[i]:starts[i + 1]] if reaching and reaching[i] else None
            prefills.append(PrefillSlice(
                starts[i], starts[i + 1], block_tables[i, :num_blocks].long(), seq_len,
                _causal_mask(q_len, seq_len, sliding_window, device, spans)))
    idx = torch.tensor(decodes, dtype=torch.long, device=device)
    max_blocks = -(-max((lens[i] for i in decodes), default=0) // block_size)
    decode_lens = seq_lens.to(device).long()[idx][:, None]
    k_pos = torch.arange(max_blocks * block_size, device=device)[None, :]
    mask = k_pos < decode_lens
    if sliding_window is not None:
        mask &= k_pos > decode_lens - 1 - sliding_window
    return AttentionPlan(
        block_size=block_size,
        decode_rows=query_start_loc.to(device).long()[idx],
        decode_block_ids=block_tables[idx, :max_blocks].long().reshape(-1),
        decode_mask=mask[:, None, None, :],
        prefills=tuple(prefills),
        workspace=GatherWorkspace() if workspace is None else workspace,
    )


def _sdpa(q, k, v, mask, scale, soft_cap, is_causal=False):
    """q [..., Hq, Lq, d], k/v [..., Hkv, Lk, d] with Hq a multiple of Hkv."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
            enable_gqa=q.shape[-3] != k.shape[-3])
    group = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(group, dim=-3)
    v = v.repeat_interleave(group, dim=-3)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = soft_cap * torch.tanh(scores / soft_cap)
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    plan: AttentionPlan | None = None,
                    out: torch.Tensor | None = None, *,
                    bidir_spans: torch.Tensor | None = None) -> torch.Tensor:
    """Same result as `paged_attention_reference`; pass `plan` to reuse it across layers
    (it must have been built with the same sliding_window and bidir_spans), `out` to write
    in place. `bidir_spans` only without a plan (a plan carries its own)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, block_size, sliding_window,
                              bidir_spans=bidir_spans)
    elif bidir_spans is not None:
        raise ValueError("pass bidir_spans to plan_attention: the plan carries them")
    if out is None:
        out = torch.empty_like(query)
    num_decodes = plan.decode_rows.numel()
    if num_decodes:
        k, v = _gather_blocks(k_cache, v_cache, plan.decode_block_ids, plan.workspace, query.dtype)
        k = k.view(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2)
        q = query.index_select(0, plan.decode_rows).view(num_decodes, num_kv_heads, group, head_dim)
        o = _sdpa(q, k, v, plan.decode_mask, scale, soft_cap)
        out.index_copy_(0, plan.decode_rows, o.reshape(num_decodes, num_heads, head_dim))
    for p in plan.prefills:
        k, v = _gather_blocks(k_cache, v_cache, p.block_ids, plan.workspace, query.dtype)
        k = k.view(-1, num_kv_heads, head_dim)[: p.seq_len]
        v = v.view(-1, num_kv_heads, head_dim)[: p.seq_len]
        q = query[p.start : p.end].transpose(0, 1)[None]
        o = _sdpa(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], p.mask, scale, soft_cap,
                  is_causal=p.mask is None)
        out[p.start : p.end] = o[0].transpose(0, 1)
    return out


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter each token's K/V into its slot: view the cache as [num_slots, kvh, d] and
    index_copy_ rows `slot_mapping` (int64); tokens with slot -1 are dropped first."""
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor,
                pairs: list[tuple[int, int]]) -> None:
    """Block dst := block src for each pair, as one gather + one scatter per cache."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=k_cache.device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=k_cache.device)
    k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
    v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
