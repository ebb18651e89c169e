"""Plain-torch references for the paged-cache kernels: simple, per-request loops, slow.

Cache layout (see kvstore/cache_tensors.py): one K and one V tensor per layer, each
`[num_blocks, block_size, num_kv_heads, head_dim]`. A slot is `block_id * block_size +
offset`; token `t` of a request lives in slot `block_table[t // block_size] * block_size +
t % block_size`.

Flat varlen batch: request `i` owns query rows `query_start_loc[i]:query_start_loc[i+1]`.
Those rows are the LAST `q_len` tokens of its `seq_lens[i]`-token context, whose K/V are
already in the cache (written by `write_kv` earlier in the same layer), so query row `j`
sits at position `seq_lens[i] - q_len + j` and sees keys at positions `<=` its own.

Bidirectional blocks (Gemma 3's images), optional: `bidir_spans` int32 `[num_tokens, 2]`
on the query's device, row t = `[s, e)`, the absolute positions (in its request) of the
block query row t belongs to (`s <= its position < e <= seq_len`), or `s == e` (`[0, 0]`)
for none. The query at position q then sees key k iff

    ((k <= q) or (s <= k < e)) and (no window or k > q - W)

so a row inside a block also sees the block's keys AFTER it, up to e - 1; their K/V are
written in the same step (an image is never split across prefill chunks: the caller makes
e <= seq_len). That is transformers' Gemma 3 mask (`create_masks_for_vision_model`):
OR(causal, same block) on global layers, AND(window, OR(causal, same block)) on sliding
ones. A decode row (the last of its context) is never changed by its span.
"""

import math

import torch


def write_kv_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k_cache[slot // bs, slot % bs] = key[t] for every token t with slot_mapping[t] >= 0."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:  # padding token: nothing to store
            continue
        k_cache[slot // block_size, slot % block_size] = key[t]
        v_cache[slot // block_size, slot % block_size] = value[t]


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_reqs, max_blocks], padded
    seq_lens: torch.Tensor,  # int32 [num_reqs]: context length including this step's tokens
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    bidir_spans: torch.Tensor | None = None,  # int32 [num_tokens, 2]: [s, e) per query row
) -> torch.Tensor:
    """Causal attention of each request's query rows over its paged context (fp32 math).

    sliding_window=W: a query at position p sees keys at positions p-W+1 .. p (itself and
    W-1 before it, the Hugging Face / Mistral convention). soft_cap=c: scores become
    c * tanh(scores / c) before masking (Gemma). bidir_spans: each row also sees the keys
    of its span [s, e) (the module's docstring), the window still applying.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[i, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos
        if bidir_spans is not None:
            span = bidir_spans[start:end].to(query.device).long()
            allowed |= (k_pos >= span[:, :1]) & (k_pos < span[:, 1:])
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def copy_blocks_reference(k_cache: torch.Tensor, v_cache: torch.Tensor,
                          pairs: list[tuple[int, int]]) -> None:
    """For each (src, dst): block dst of K and V becomes a copy of block src (copy-on-write)."""
    for src, dst in pairs:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


# -- a decoder layer's elementwise work (kernels/torch_layer_ops.py states the contract) -----
# Every value is computed in fp32 and rounded to the model's dtype (`_rounded`) exactly where
# the contract rounds: the rules, spelled out, rather than torch's dtype promotion.

def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 x rounded to `dtype` (to nearest, ties to even) and back to fp32."""
    return x.to(dtype).float()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """Over the last dim: h = x in fp32, r = rsqrt(sum(h^2) / N + eps), then
    llama: round(w * round(h * r)) (normalised, rounded to x's dtype, then weighed);
    gemma: round(h * r * (1 + w)) (all fp32 until the one rounding)."""
    dtype = x.dtype
    h = x.float()
    r = torch.rsqrt((h * h).sum(-1, keepdim=True) / h.shape[-1] + eps)
    w = weight.float()
    if gemma:
        return (h * r * (1.0 + w)).to(dtype)
    return (w * _rounded(h * r, dtype)).to(dtype)


def add_rms_norm_reference(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float, gemma: bool,
                           y_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """y normalised with y_weight when given (in y's dtype), added to the residual with one
    rounding; returns (that sum normalised with weight, the sum)."""
    if y_weight is not None:
        y = rms_norm_reference(y, y_weight, eps, gemma)
    new_residual = (residual.float() + y.float()).to(y.dtype)
    return rms_norm_reference(new_residual, weight, eps, gemma), new_residual


def act_mul_reference(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up [T, 2I] = (gate, up): round(round(act(gate)) * up), act in fp32:
    silu(g) = g / (1 + exp(-g)); gelu_pytorch_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))."""
    dtype = gate_up.dtype
    inter = gate_up.shape[-1] // 2
    g, up = gate_up[..., :inter].float(), gate_up[..., inter:].float()
    if act == "silu":
        a = g / (1.0 + torch.exp(-g))
    elif act == "gelu_pytorch_tanh":
        a = 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * (g * g * g))))
    else:
        raise ValueError(f"unknown activation {act!r}")
    return (_rounded(a, dtype) * up).to(dtype)


def rope_write_kv_reference(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                            eps: float = 0.0, gemma: bool = False) -> torch.Tensor:
    """qkv [T, (H + 2 KV) D] = q heads, k heads, v heads. q and k heads: RMS-normed over D
    when q_norm / k_norm are given (rms_norm_reference), then rotated with token t's table
    rows c = cos[positions[t]], s = sin[positions[t]] (full width, s signed (-sin, sin)):
    round(round(x * c) + round((x2, x1) * s)). Rotated k and raw v go to slot_mapping[t]
    (write_kv_reference: slot < 0 skipped); returns the rotated q [T, H, D]."""
    dtype = qkv.dtype
    num_tokens = qkv.shape[0]
    heads = qkv[:, :(num_heads + num_kv_heads) * head_dim].reshape(
        num_tokens, num_heads + num_kv_heads, head_dim)
    q, k = heads[:, :num_heads], heads[:, num_heads:]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].reshape(num_tokens, num_kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm_reference(q, q_norm, eps, gemma)
        k = rms_norm_reference(k, k_norm, eps, gemma)
    c = cos[positions.long()].float()[:, None, :]
    s = sin[positions.long()].float()[:, None, :]
    half = head_dim // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1).float()
        return (_rounded(x.float() * c, dtype) + _rounded(swapped * s, dtype)).to(dtype)

    q, k = rotate(q), rotate(k)
    write_kv_reference(k, v, k_cache, v_cache, slot_mapping)
    return q.contiguous()
