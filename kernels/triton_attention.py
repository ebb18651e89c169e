"""Unified paged attention in Triton: one kernel for prefill, chunked prefill and decode.

Same contract as `paged_attention_reference` in kernels/reference.py (read its docstring for
the flat varlen batch and the cache layout `[num_blocks, block_size, num_kv_heads, head_dim]`).

Work split. A program owns one KV head and one *tile* of one request: up to BLOCK_Q of its
query tokens times the `group = num_heads // num_kv_heads` query heads that read that KV head,
packed as BLOCK_M = BLOCK_Q * group rows (row r = token r // group, head r % group). K and
V of a key are loaded once for the whole group (GQA without repeating K/V). Request i's
tiles are numbered from `query_start_loc[i] // BLOCK_Q + i`; that numbering is increasing and
leaves room for ceil(q_len / BLOCK_Q) tiles per request, so the grid
`(num_tokens // BLOCK_Q + num_seqs, num_kv_heads)` covers every tile and needs no host sync:
a program finds its request by binary search, and a tile past its request's queries exits.

    for each program (tile, kv_head):
        i = largest request with query_start_loc[i] // BLOCK_Q + i <= tile
        q_len = query_start_loc[i+1] - query_start_loc[i];  context = seq_lens[i] - q_len
        t0 = (tile - first_tile(i)) * BLOCK_Q;  if t0 >= q_len: exit
        Q = query rows of tokens t0 .. t0+BLOCK_Q-1, heads of kv_head's group   # [BLOCK_M, d]
        pos[r] = context + token(r)                     # absolute position of each query row
        keys to visit: [lo, hi) with hi = context + last token of the tile + 1,
                       lo = 0, or with a window W: context + t0 - W + 1 (rounded down)
        if HAS_SPANS: [s[r], e[r]) = bidir_spans[row of r]     # [0, 0]: none
                      hi = min(max(hi, max_r e[r]), seq_len)   # a block's keys after the tile
        m = -inf, l = 0, acc = 0                       # online softmax state, fp32
        keys every row sees: [full_lo, full_hi) = [last row's position - W + 1, first row's
            position], in whole tiles; the tiles of [lo, full_lo) and [full_hi, hi) are masked
        for each TILE_N keys k in [lo, hi):
            block = block_tables[i, k // block_size]   # a key-by-key gather: tiles may span blocks
            K, V = cache[block, k % block_size, kv_head]         # int64 addresses
            S = Q K^T * scale;  if soft_cap: S = soft_cap * tanh(S / soft_cap)
            if masked: S[r, k] = -inf unless (k <= pos[r] or s[r] <= k < e[r]) (and k > pos[r] - W)
            m' = max(m, rowmax S);  P = exp(S - m');  alpha = exp(m - m')
            l = l * alpha + rowsum P;  acc = acc * alpha + P V;  m = m'
        out[rows] = acc / l

Tiles are launched last first (they hold the most keys), so a long prefill's tail is short.
The unmasked tiles load without predicates and skip the mask arithmetic: in a long prefill
or a decode, all but the tiles at the diagonal and the window's edge.
exp is exp2 on pre-scaled scores; a row with no visible key yet keeps m = -inf and is
guarded so it never computes (-inf) - (-inf). Keys at or past seq_len are never loaded, so
unused cache slots may hold anything (even NaN). fp32 inputs use IEEE dots (no TF32).

Launch parameters depend only on shapes, dtype and the device's architecture
(kernels/triton_tiles.py: tuned tiles per architecture, measured on the GPU), so the call
never syncs with the host. The plan carries two things, each only when there is one:
bidirectional spans (Gemma 3's images, kernels/reference.py), which make a compiled variant
of their own (HAS_SPANS; without them the kernel is exactly the causal one), and the long
causal chunks that run on SDPA (kernels/sdpa_prefill.py; SKIP). It carries the spans to the
kernel (int32, contiguous, on the device) and checks their shape; checking their values would
sync with the host, so it trusts them as the contract says (the kernel applies the rule as
written for any span, and never reads past seq_len).
"""

import inspect
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import sdpa_prefill
from kernels.host_layout import HostLayout
from kernels.sdpa_prefill import SdpaRoute
from kernels.triton_tiles import custom_config, device_arch, launch_config

if "input_precision" not in inspect.signature(tl.dot).parameters:  # Triton < 3.0
    raise ImportError(f"triton {triton.__version__} is too old for these kernels "
                      "(tl.dot needs input_precision: Triton >= 3.0)")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))  # in (0, 1]: no overflow for any x
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32. UPCAST computes it on fp32 copies: the same products
    (fp16/bf16 products are exact in fp32), used only under Triton's CPU interpreter, whose
    dot multiplies bf16 operands as their raw uint16 bits (Triton 3.9)."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _find_request(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest i < num_seqs with query_start_loc[i] // BLOCK_Q + i <= tile."""
    lo: tl.int32 = 0
    hi = lo + num_seqs  # a tensor even when num_seqs == 1 is specialised to a constant
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _attend_tiles(acc, l_i, m, q, k_cache_ptr, v_cache_ptr, block_row, kv_head, key_lo, key_hi, hi,
                  q_pos, span_lo, span_hi, qk_scale, cap_in, cap_out, window, dims, dim_ok,
                  stride_k_block, stride_k_slot, stride_k_head, stride_k_dim,
                  stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
                  BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr,
                  PAD_DIM: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
                  HAS_SPANS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """The online softmax over keys [key_lo, key_hi), TILE_N at a time. MASKED tiles apply
    every rule (causal, spans, window, keys < hi); unmasked ones hold only keys that every
    row of the tile sees, so they load and compute without a mask."""
    for start in range(key_lo, key_hi, TILE_N):
        k_pos = start + tl.arange(0, TILE_N)
        if MASKED:
            k_ok = k_pos < hi
            block = tl.load(block_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        else:
            block = tl.load(block_row + k_pos // BLOCK_SIZE).to(tl.int64)
        slot = (k_pos % BLOCK_SIZE).to(tl.int64)
        k_ptrs = (k_cache_ptr + (block * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head)[None, :]
                  + dims[:, None] * stride_k_dim)  # [HEAD_DIM_PAD, TILE_N]
        v_ptrs = (v_cache_ptr + (block * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head)[:, None]
                  + dims[None, :] * stride_v_dim)  # [TILE_N, HEAD_DIM_PAD]
        if MASKED:
            k = tl.load(k_ptrs, mask=k_ok[None, :] & dim_ok[:, None], other=0.0)
        elif PAD_DIM:
            k = tl.load(k_ptrs, mask=dim_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        s = _dot(q, k, DOT_PRECISION, UPCAST_DOT)
        if USE_SOFT_CAP:  # qk_scale = log2(e): cap_out * tanh(cap_in * s), in base-2 units
            s = cap_out * _tanh(s * cap_in)
        else:  # qk_scale = scale * log2(e)
            s = s * qk_scale
        if MASKED:
            visible = k_pos[None, :] <= q_pos[:, None]
            if HAS_SPANS:
                visible = visible | ((k_pos[None, :] >= span_lo[:, None])
                                     & (k_pos[None, :] < span_hi[:, None]))
            visible = k_ok[None, :] & visible
            if USE_WINDOW:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:  # every score is finite
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = m_new
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MASKED:
            v = tl.load(v_ptrs, mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
        elif PAD_DIM:
            v = tl.load(v_ptrs, mask=dim_ok[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m = m_new
    return acc, l_i, m


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, bidir_spans_ptr, skip_ptr, qk_scale, cap_in, cap_out, window, num_seqs,
    stride_q_tok, stride_q_head, stride_q_dim,
    stride_k_block, stride_k_slot, stride_k_head, stride_k_dim,
    stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
    stride_o_tok, stride_o_head, stride_o_dim,
    stride_bt_req,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    HAS_SPANS: tl.constexpr, SKIP: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the last tiles (most keys) start first
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    t0 = (tile - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    if SKIP:  # the request runs on SDPA (kernels/sdpa_prefill.py)
        t0 = tl.where(tl.load(skip_ptr + req) != 0, q_len, t0)
    if t0 < q_len:
        context = tl.load(seq_lens_ptr + req) - q_len
        t1 = tl.minimum(t0 + BLOCK_Q, q_len)  # one past the tile's last token

        rows = tl.arange(0, BLOCK_M)
        tok = t0 + rows // GROUP  # token index within the request
        head = kv_head * GROUP + rows % GROUP
        row_ok = (tok < q_len) & (rows < BLOCK_Q * GROUP)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        q_offs = ((q_begin + tok).to(tl.int64)[:, None] * stride_q_tok
                  + head[:, None].to(tl.int64) * stride_q_head + dims[None, :] * stride_q_dim)
        q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        q_pos = context + tok

        hi = context + t1  # one past the last visible key
        span_lo = q_pos
        span_hi = q_pos
        if HAS_SPANS:  # [span_lo, span_hi): each row's bidirectional block, [0, 0] for none
            span_offs = (q_begin + tok).to(tl.int64) * 2
            span_lo = tl.load(bidir_spans_ptr + span_offs, mask=row_ok, other=0)
            span_hi = tl.load(bidir_spans_ptr + span_offs + 1, mask=row_ok, other=0)
            hi = tl.minimum(tl.maximum(hi, tl.max(span_hi, axis=0)), context + q_len)
        # Keys every row sees: causal up to the first token, and inside the last token's window.
        full_lo = hi * 0
        lo = full_lo
        if USE_WINDOW:
            lo = tl.maximum(context + t0 - window + 1, 0) // TILE_N * TILE_N
            full_lo = (tl.maximum(context + t1 - window, 0) + TILE_N - 1) // TILE_N * TILE_N
        full_hi = tl.maximum((context + t0 + 1) // TILE_N * TILE_N, full_lo)
        full_lo = tl.minimum(full_lo, full_hi)

        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # `l` above: each row's running sum of P
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        block_row = block_tables_ptr + req.to(tl.int64) * stride_bt_req
        acc, l_i, m = _attend_tiles(  # the window's lower edge, masked
            acc, l_i, m, q, k_cache_ptr, v_cache_ptr, block_row, kv_head, lo, full_lo, hi,
            q_pos, span_lo, span_hi, qk_scale, cap_in, cap_out, window, dims, dim_ok,
            stride_k_block, stride_k_slot, stride_k_head, stride_k_dim,
            stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
            BLOCK_SIZE, TILE_N, True, HEAD_DIM_PAD != HEAD_DIM, USE_WINDOW, USE_SOFT_CAP,
            HAS_SPANS, DOT_PRECISION, UPCAST_DOT)
        acc, l_i, m = _attend_tiles(  # keys all rows see, unmasked
            acc, l_i, m, q, k_cache_ptr, v_cache_ptr, block_row, kv_head, full_lo, full_hi, hi,
            q_pos, span_lo, span_hi, qk_scale, cap_in, cap_out, window, dims, dim_ok,
            stride_k_block, stride_k_slot, stride_k_head, stride_k_dim,
            stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
            BLOCK_SIZE, TILE_N, False, HEAD_DIM_PAD != HEAD_DIM, USE_WINDOW, USE_SOFT_CAP,
            HAS_SPANS, DOT_PRECISION, UPCAST_DOT)
        acc, l_i, m = _attend_tiles(  # the diagonal and the spans past it, masked
            acc, l_i, m, q, k_cache_ptr, v_cache_ptr, block_row, kv_head, full_hi, hi, hi,
            q_pos, span_lo, span_hi, qk_scale, cap_in, cap_out, window, dims, dim_ok,
            stride_k_block, stride_k_slot, stride_k_head, stride_k_dim,
            stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
            BLOCK_SIZE, TILE_N, True, HEAD_DIM_PAD != HEAD_DIM, USE_WINDOW, USE_SOFT_CAP,
            HAS_SPANS, DOT_PRECISION, UPCAST_DOT)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = ((q_begin + tok).to(tl.int64)[:, None] * stride_o_tok
                  + head[:, None].to(tl.int64) * stride_o_head + dims[None, :] * stride_o_dim)
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])


# True when TRITON_INTERPRET=1 was set as this module was imported: its kernels then run
# on the CPU in Triton's numpy interpreter (tests only).
INTERPRETED = type(_paged_attention_kernel).__name__ == "InterpretedFunction"


class TritonWorkspace:
    """The Triton path needs no scratch memory; this exists for the backend contract."""


@dataclass(frozen=True)
class TritonPlan:
    """A step's bidirectional spans, int32 [num_tokens, 2], contiguous, on the device (None:
    no image), and the long causal chunks that run on SDPA (kernels/sdpa_prefill.py; None:
    every request in the Triton kernel)."""

    bidir_spans: torch.Tensor | None
    sdpa: SdpaRoute | None = None


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, block_size: int,
                   sliding_window: int | None = None, workspace: TritonWorkspace | None = None, *,
                   bidir_spans: torch.Tensor | None = None, host: HostLayout | None = None) -> TritonPlan | None:
    """None when there is nothing to plan: the kernel reads the metadata tensors on the
    device. With spans: them, as the kernel reads them (no host sync; their shape is
    checked, ValueError, their values are the caller's to get right). With the lengths on
    the host (`host`): the chunks of MIN_TOKENS or more that go to SDPA, on a layer without
    a window in a step without images (kernels/sdpa_prefill.py)."""
    route = sdpa_prefill.plan_route(host, sliding_window, bidir_spans, query_start_loc, block_tables, block_size)
    if bidir_spans is None:
        return None if route is None else TritonPlan(None, route)
    if (bidir_spans.dim() != 2 or bidir_spans.shape[1] != 2
            or bidir_spans.dtype not in (torch.int32, torch.int64)
            or bidir_spans.device != query_start_loc.device):
        raise ValueError(f"bidir_spans must be int32 [num_tokens, 2] on {query_start_loc.device}, "
                         f"got {bidir_spans.dtype} {tuple(bidir_spans.shape)} on {bidir_spans.device}")
    return TritonPlan(bidir_spans.to(torch.int32).contiguous())


def _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out):
    if query.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"want query [tokens, heads, head_dim] and K/V caches [blocks, "
                         f"block_size, kv_heads, head_dim] of one shape; got {tuple(query.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads of size {head_dim} cannot read "
                         f"{num_kv_heads} KV heads of size {k_cache.shape[3]}")
    if head_dim > MAX_HEAD_DIM or query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"head_dim {head_dim} / dtype {query.dtype} not supported "
                         f"(head_dim <= {MAX_HEAD_DIM}, dtypes {SUPPORTED_DTYPES})")
    if k_cache.dtype != query.dtype or v_cache.dtype != query.dtype:
        raise ValueError(f"query {query.dtype} and caches {k_cache.dtype}/{v_cache.dtype} differ")
    num_seqs = seq_lens.shape[0]
    if (block_tables.dim() != 2 or block_tables.shape[0] != num_seqs
            or query_start_loc.shape != (num_seqs + 1,) or seq_lens.dim() != 1):
        raise ValueError(f"block_tables {tuple(block_tables.shape)}, seq_lens "
                         f"{tuple(seq_lens.shape)}, query_start_loc "
                         f"{tuple(query_start_loc.shape)} disagree on the number of requests")
    for name, t in [("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)]:
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if seq_lens.stride(0) != 1 or query_start_loc.stride(0) != 1 or block_tables.stride(1) != 1:
        raise ValueError("seq_lens, query_start_loc and block_tables rows must be contiguous")
    tensors = [query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out]
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"tensors on several devices: {sorted({str(t.device) for t in tensors})}")
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match query "
                         f"{tuple(query.shape)} {query.dtype}")


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    plan: TritonPlan | None = None, out: torch.Tensor | None = None, *,
                    bidir_spans: torch.Tensor | None = None, tiles: dict | None = None) -> torch.Tensor:
    """Same result as `paged_attention_reference`. Any strides are accepted (e.g. `query` a
    view into a fused QKV output); `out` is written in place when given. Spans come in
    the plan (plan_attention's), or as `bidir_spans` without one. `tiles` (TILE_KEYS, powers
    of two) overrides launch_config's choice: for the tuner (bench/compute/tune_attention.py)
    and the tests."""
    if out is None:
        out = torch.empty_like(query)
    _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    if bidir_spans is not None:
        if plan is not None:
            raise ValueError("pass bidir_spans to plan_attention: the plan carries them")
        plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1],
                              bidir_spans=bidir_spans)
    spans = None if plan is None else plan.bidir_spans
    route = None if (plan is None or soft_cap is not None or sliding_window is not None
                     or query.dtype not in sdpa_prefill.DTYPES) else plan.sdpa
    if spans is not None and spans.shape[0] < query.shape[0]:
        raise ValueError(f"bidir_spans has {spans.shape[0]} rows for {query.shape[0]} query rows")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    if tiles is None:
        cfg = launch_config(num_tokens, num_seqs, group, head_dim, query.dtype, device_arch(query.device))
    else:
        cfg = custom_config(tiles, group)
    grid = (num_tokens // cfg["BLOCK_Q"] + num_seqs, num_kv_heads)
    log2e = math.log2(math.e)  # the kernel's softmax is in base 2
    if soft_cap is None:
        qk_scale, cap_in, cap_out = float(scale) * log2e, 1.0, 1.0
    else:
        qk_scale, cap_in, cap_out = log2e, float(scale) / soft_cap, float(soft_cap) * log2e
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        seq_lens if spans is None else spans,  # not read without spans (HAS_SPANS=False)
        seq_lens if route is None else route.skip,  # not read without a route (SKIP=False)
        qk_scale, cap_in, cap_out, int(sliding_window or 0), num_seqs,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1], USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=soft_cap is not None, HAS_SPANS=spans is not None, SKIP=route is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        UPCAST_DOT=INTERPRETED and query.dtype == torch.bfloat16, **cfg,
    )
    if route is not None:
        sdpa_prefill.run_route(route, query, k_cache, v_cache, scale, out)
    return out
