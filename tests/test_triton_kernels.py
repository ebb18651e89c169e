"""Triton kernels (kernels/triton_attention.py, kernels/triton_cache.py) against the plain
references, on fresh random inputs per case.

Two ways these cases run:
- on the CPU, in Triton's interpreter, small shapes. Triton decides interpreter-or-compiler
  when a kernel is decorated, from TRITON_INTERPRET, so the interpreter run needs a process
  of its own: `test_cases_in_triton_interpreter` reruns this file in a subprocess with
  TRITON_INTERPRET=1 (directly: `TRITON_INTERPRET=1 pytest tests/test_triton_kernels.py`),
  and other test modules never see the variable;
- on CUDA (`gpu` marker), the same cases at full size (Llama-3-8B head layout, contexts of
  thousands of tokens), compiled. They skip without CUDA.
Compiled ahead of time without a GPU (what the interpreter cannot catch):
tests/test_triton_compile.py.

Every output buffer is NaN before the call, so an element the kernel fails to write fails
the comparison, and every cache slot no request owns is NaN, so a kernel that reads past a
request's context (or a block-table padding entry) turns its output NaN.

Gemma 3's bidirectional image spans (`bidir_spans`) run on the layouts of
tests/test_bidirectional_attention.py on the CPU, and on images of 256 tokens (Gemma 3's
`mm_tokens_per_image`) in contexts of thousands on CUDA.
"""

import itertools
import math
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels import triton_attention, triton_cache  # noqa: E402  (after the importorskip)
from kernels.backend import get_attention_backend  # noqa: E402
from kernels.reference import (  # noqa: E402
    copy_blocks_reference,
    paged_attention_reference,
    write_kv_reference,
)
from tests.test_bidirectional_attention import (  # noqa: E402
    LAYOUTS,
    image_rows,
    probe_mask,
    random_layout,
    row_spans,
    transformers_mask,
)

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")
ON_CUDA = torch.cuda.is_available() and not INTERPRETER
DEVICES = ([pytest.param("cpu", id="interp")] if INTERPRETER else []) + [
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not ON_CUDA, reason="needs CUDA (and TRITON_INTERPRET unset)")]),
]
REL_TOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
NAN = float("nan")


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def gen(request, device) -> torch.Generator:
    """A generator seeded from the test's id: fresh inputs per case, reproducible."""
    return torch.Generator(device).manual_seed(zlib.crc32(request.node.name.encode()))


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|; NaN anywhere in out gives inf."""
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# -- batches ---------------------------------------------------------------------------------

# (seq_len, q_len) per request: q_len new tokens at the end of a seq_len-token context.
SMALL_MIXES = {
    "decode_only": [(1, 1), (17, 1), (40, 1), (64, 1), (33, 1)],
    "prefill_only": [(5, 5), (16, 16), (37, 37), (1, 1)],  # no cached tokens at all
    "chunked_prefill": [(48, 16), (70, 13), (33, 32), (21, 20)],  # chunks after a cached context
    "mixed": [(50, 1), (37, 37), (90, 25), (1, 1), (16, 1), (45, 20), (7, 7)],
}
FULL_MIXES = {
    "decode_only": [(n, 1) for n in (1, 17, 511, 1024, 1500, 2049, 3333, 4096)] * 4,
    "prefill_only": [(1024, 1024), (777, 777), (1, 1), (2000, 2000)],
    "chunked_prefill": [(2560, 512), (4100, 1000), (1031, 1030), (700, 17)],
    "mixed": [(3000, 1), (1200, 1200), (4000, 300), (1, 1), (33, 1), (8192, 1), (513, 512)],
}


def mixes(device: str) -> dict:
    return SMALL_MIXES if device == "cpu" else FULL_MIXES


def llama_layout(device: str) -> dict:
    """Small on the CPU; Llama-3-8B's 32 query heads over 8 KV heads of 128 on CUDA."""
    return dict(num_heads=4, num_kv_heads=2, head_dim=32) if device == "cpu" else \
        dict(num_heads=32, num_kv_heads=8, head_dim=128)


def make_batch(reqs, *, gen, device, dtype=torch.float32, block_size=16, num_heads=4,
               num_kv_heads=2, head_dim=32, shared_prefix_blocks=1):
    """Random query and caches for `reqs` [(seq_len, q_len)]. Physical blocks are a random
    permutation (scattered); the first `shared_prefix_blocks` of every long-enough request
    are request 0's (repeated blocks, as a prefix-cache hit gives), and the last request
    names one block twice. Slots that no request owns, and spare blocks the block-table
    padding points at, are NaN."""
    per_req = [math.ceil(s / block_size) for s, _ in reqs]
    num_blocks = sum(per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    spare = perm.pop()  # never owned: all NaN; padding columns point at it
    tables, used = [], 0
    for n in per_req:
        tables.append(perm[used:used + n])
        used += n
    for table in tables[1:]:
        share = min(shared_prefix_blocks, len(table), len(tables[0]))
        table[:share] = tables[0][:share]
    if len(tables[-1]) >= 3:
        tables[-1][2] = tables[-1][0]
    width = max(per_req) + 2
    block_tables = torch.tensor([t + [spare] * (width - len(t)) for t in tables],
                                dtype=torch.int32, device=device)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=dtype, device=device)
    v_cache = torch.full(shape, NAN, dtype=dtype, device=device)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    for (seq_len, _), table in zip(reqs, tables):
        t = torch.arange(seq_len, device=device)
        ids = torch.tensor(table, device=device)
        owned[ids[t // block_size] * block_size + t % block_size] = True
    n = int(owned.sum())
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[owned] = torch.randn(
            n, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)

    q_lens = [q for _, q in reqs]
    query_start_loc = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32,
                                   device=device)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    seq_lens = torch.tensor([s for s, _ in reqs], dtype=torch.int32, device=device)
    return query, k_cache, v_cache, block_tables, seq_lens, query_start_loc


def check_attention(batch, *, scale=None, sliding_window=None, soft_cap=None, query=None,
                    bidir_spans=None):
    """Run the kernel into a NaN-poisoned buffer and compare with the fp32 reference.
    `bidir_spans` go through plan_attention, as the worker passes them."""
    q, k_cache, v_cache, block_tables, seq_lens, qsl = batch
    query = q if query is None else query
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.full_like(q, NAN)
    plan = triton_attention.plan_attention(block_tables, seq_lens, qsl, k_cache.shape[1],
                                           sliding_window, bidir_spans=bidir_spans)
    assert (plan is None) == (bidir_spans is None)  # no spans: nothing planned, as before
    triton_attention.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, qsl, scale,
                                     sliding_window=sliding_window, soft_cap=soft_cap, plan=plan,
                                     out=out)
    ref = paged_attention_reference(query.float(), k_cache.float(), v_cache.float(),
                                    block_tables, seq_lens, qsl, scale,
                                    sliding_window=sliding_window, soft_cap=soft_cap,
                                    bidir_spans=bidir_spans)
    err = rel_error(out, ref)
    assert err < REL_TOL[q.dtype], f"relative error {err:.2e} (limit {REL_TOL[q.dtype]:.0e})"
    return out


# -- attention -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("mix", sorted(SMALL_MIXES))
def test_attention_mixed_batches(device, gen, mix, block_size, dtype):
    batch = make_batch(mixes(device)[mix], gen=gen, device=device, dtype=dtype,
                       block_size=block_size, **llama_layout(device))
    check_attention(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_attention_head_sizes(device, gen, head_dim, dtype):
    heads = dict(num_heads=4, num_kv_heads=2) if device == "cpu" else dict(num_heads=32, num_kv_heads=8)
    batch = make_batch(mixes(device)["mixed"], gen=gen, device=device, dtype=dtype,
                       head_dim=head_dim, **heads)
    check_attention(batch)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 3), (6, 2), (8, 1), (7, 1), (32, 1)],
                         ids=["mha", "gqa3", "gqa8", "gqa7", "mqa32"])
def test_attention_gqa_groups(device, gen, num_heads, num_kv_heads):
    """Groups that fill the 16-row tile, leave rows over (3, 7) or exceed it (32)."""
    scale = 1 if device == "cpu" else 4
    batch = make_batch(mixes(device)["mixed"], gen=gen, device=device, num_heads=num_heads * scale,
                       num_kv_heads=num_kv_heads * scale, head_dim=64)
    check_attention(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding_window,soft_cap", [
    (1, None), (8, None), (33, None), (None, 5.0), (20, 30.0), (4096, 50.0)])
@pytest.mark.parametrize("mix", ["decode_only", "mixed"])
def test_attention_window_and_soft_cap(device, gen, mix, sliding_window, soft_cap, dtype):
    """Windows narrower than a block, wider than a key tile, wider than every context;
    soft caps that bite (scale 1 makes raw scores of ~5) and that barely do."""
    batch = make_batch(mixes(device)[mix], gen=gen, device=device, dtype=dtype,
                       **llama_layout(device))
    check_attention(batch, scale=1.0, sliding_window=sliding_window, soft_cap=soft_cap)


def test_attention_strided_query_and_allocated_output(device, gen):
    """query as a view into a fused QKV projection (row stride != heads * head_dim), int64
    metadata, and the wrapper allocating the output itself."""
    layout = llama_layout(device)
    batch = make_batch(mixes(device)["mixed"], gen=gen, device=device, **layout)
    query, k_cache, v_cache, block_tables, seq_lens, qsl = batch
    h, d = layout["num_heads"], layout["head_dim"]
    fused = torch.randn(query.shape[0], (h + 2 * layout["num_kv_heads"]) * d, generator=gen,
                        device=device)
    fused[:, : h * d] = query.reshape(-1, h * d)
    strided = fused[:, : h * d].view(-1, h, d)
    assert not strided.is_contiguous()
    out = triton_attention.paged_attention(strided, k_cache, v_cache, block_tables.long(),
                                           seq_lens.long(), qsl.long(), 0.2)
    ref = paged_attention_reference(query, k_cache, v_cache, block_tables, seq_lens, qsl, 0.2)
    assert rel_error(out, ref) < REL_TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA: allocates a 2**31-element cache (8 GiB)")
def test_attention_and_write_past_int32_offsets():
    """Blocks whose element offset exceeds 2**31: products of strides must be int64."""
    gen = torch.Generator("cuda").manual_seed(0)
    block_size, kvh, d = 16, 8, 128
    num_blocks = 2**31 // (block_size * kvh * d) + 64
    k_cache = torch.zeros(num_blocks, block_size, kvh, d, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    last = torch.arange(num_blocks - 40, num_blocks, device="cuda", dtype=torch.int32)
    block_tables = last.view(2, 20)
    seq_lens = torch.tensor([300, 20], dtype=torch.int32, device="cuda")
    t = torch.cat([torch.arange(300, device="cuda"), torch.arange(20, device="cuda")])
    req = torch.cat([torch.zeros(300, dtype=torch.long, device="cuda"),
                     torch.ones(20, dtype=torch.long, device="cuda")])
    slots = block_tables[req, t // block_size].long() * block_size + t % block_size
    key = torch.randn(320, kvh, d, generator=gen, device="cuda").bfloat16()
    value = torch.randn(320, kvh, d, generator=gen, device="cuda").bfloat16()
    triton_cache.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, kvh, d)[slots], key)
    query = torch.randn(320, 32, d, generator=gen, device="cuda").bfloat16()
    qsl = torch.tensor([0, 300, 320], dtype=torch.int32, device="cuda")
    out = triton_attention.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, qsl, d**-0.5)
    ref = paged_attention_reference(query.float(), k_cache, v_cache, block_tables, seq_lens, qsl, d**-0.5)
    assert rel_error(out, ref) < REL_TOL[torch.bfloat16]


def test_attention_rejects_bad_shapes(device):
    q = torch.zeros(3, 4, 32, device=device)
    cache = torch.zeros(4, 16, 3, 32, device=device)  # 4 query heads over 3 KV heads
    meta = (torch.zeros(1, 1, dtype=torch.int32, device=device),
            torch.tensor([3], dtype=torch.int32, device=device),
            torch.tensor([0, 3], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="KV heads"):
        triton_attention.paged_attention(q, cache, cache, *meta, 1.0)
    cache = torch.zeros(4, 16, 2, 32, device=device)
    with pytest.raises(ValueError, match="requests"):
        triton_attention.paged_attention(q, cache, cache, meta[0], meta[1], meta[2][:1], 1.0)
    with pytest.raises(ValueError, match="dtype"):
        triton_attention.paged_attention(q.double(), cache.double(), cache.double(), *meta, 1.0)


# -- bidirectional spans (Gemma 3's images) --------------------------------------------------

# The CPU layouts' names at CUDA size: (seq_len, q_len, images [s, e)) per request, images
# of 256 tokens at the start, middle and end of chunks, behind cached context, across a
# prefix-cache hit (an image that starts in the cached context), beside decodes.
FULL_LAYOUTS = {
    "two_images_one_prefill": [(1500, 1500, [(30, 286), (700, 956)])],
    "start_middle_end_of_chunk": [(2048, 2048, [(0, 256), (1000, 1256), (1792, 2048)])],
    "second_chunk_after_context": [(2560, 512, [(100, 356), (2200, 2456)])],
    "prefix_hit_inside_image": [(1500, 1000, [(400, 656)]), (777, 300, [(300, 556), (560, 777)])],
    "mixed_with_decodes": [(3000, 1, [(10, 266)]), (1200, 1200, [(0, 256), (600, 856), (944, 1200)]),
                           (4000, 300, [(3744, 4000)]), (1, 1, []), (33, 1, []), (8192, 1, [(5, 261)]),
                           (513, 512, [(1, 257), (258, 513)])],
    "short_chunks": [(300, 6, [(44, 300)]), (270, 8, [(5, 261), (262, 270)]), (2000, 3, [(1740, 1999)])],
    "text_only_beside_images": [(1024, 1024, []), (2048, 512, []), (1030, 1030, [(4, 260)]), (99, 1, [])],
}
assert FULL_LAYOUTS.keys() == LAYOUTS.keys()


def image_layouts(device: str) -> dict:
    return LAYOUTS if device == "cpu" else FULL_LAYOUTS


def windows(device: str) -> dict:
    """Windows shorter and longer than an image (CUDA: Gemma 3's 1024 and a fraction)."""
    return {"short": 4, "long": 30} if device == "cpu" else {"short": 100, "long": 1024}


def image_batch(layout, *, gen, device, **kwargs):
    batch = make_batch([(s, q) for s, q, _ in layout], gen=gen, device=device, **kwargs)
    return batch, row_spans(layout).to(device)


@pytest.mark.parametrize("options", [{}, {"window": "short"}, {"window": "long", "soft_cap": 30.0}],
                         ids=["plain", "short-window", "long-window-cap"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_attention_with_images(device, gen, name, options):
    options = dict(options)
    if "window" in options:
        options["sliding_window"] = windows(device)[options.pop("window")]
    batch, spans = image_batch(image_layouts(device)[name], gen=gen, device=device,
                               **llama_layout(device))
    check_attention(batch, scale=1.0 if "soft_cap" in options else None, bidir_spans=spans, **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["mixed_with_decodes", "prefix_hit_inside_image"])
def test_attention_with_images_half_precision(device, gen, name, dtype):
    batch, spans = image_batch(image_layouts(device)[name], gen=gen, device=device, dtype=dtype,
                               **llama_layout(device))
    check_attention(batch, bidir_spans=spans)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (8, 1), (7, 1)], ids=["gqa3", "gqa8", "gqa7"])
def test_attention_with_random_images_and_gqa(device, gen, num_heads, num_kv_heads):
    """Random images (several per request, any size up to a few key tiles) over a mixed
    batch, with groups that fill the tile or leave rows over."""
    reqs = mixes(device)["mixed"] + mixes(device)["chunked_prefill"]
    layout = random_layout(zlib.crc32(str(num_heads).encode()), reqs,
                           max_image=12 if device == "cpu" else 300)
    scale = 1 if device == "cpu" else 4
    batch, spans = image_batch(layout, gen=gen, device=device, num_heads=num_heads * scale,
                               num_kv_heads=num_kv_heads * scale, head_dim=64)
    check_attention(batch, bidir_spans=spans)
    check_attention(batch, bidir_spans=spans, sliding_window=windows(device)["short"], soft_cap=20.0,
                    scale=1.0)


@pytest.mark.parametrize("window", [None, "short"])
def test_attention_running_images_causally_is_caught(device, gen, window):
    """With the spans dropped, exactly the image rows before each image's last differ."""
    layout = image_layouts(device)["mixed_with_decodes"] + image_layouts(device)["short_chunks"]
    batch, spans = image_batch(layout, gen=gen, device=device, **llama_layout(device))
    sliding_window = None if window is None else windows(device)[window]
    with_spans = check_attention(batch, bidir_spans=spans, sliding_window=sliding_window)
    causal = check_attention(batch, sliding_window=sliding_window)
    inner, text = image_rows(layout)
    differs = ((with_spans - causal).abs().amax(dim=(1, 2)) > 1e-4).cpu()
    assert differs[inner].all(), [r for r in inner if not differs[r]]
    # text rows: the same keys (two compiled variants, so equal up to rounding)
    assert rel_error(with_spans[text], causal[text]) < 1e-6


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("q_len", [32, 20, 8, 1])
def test_attention_mask_with_images_is_transformers_gemma3_mask(device, window, q_len):
    seq_len, images = 32, [(4, 12), (17, 27), (28, 31)]
    spans = row_spans([(seq_len, q_len, images)]).to(device)

    def attend(query, k_cache, v_cache, bt, seq_lens, qsl):
        return triton_attention.paged_attention(query, k_cache, v_cache, bt, seq_lens, qsl, 1.0,
                                                sliding_window=window, bidir_spans=spans)

    got = probe_mask(attend, seq_len, q_len, device=device)
    assert torch.equal(got, transformers_mask(seq_len, images, window)[seq_len - q_len:])


def test_attention_with_images_never_reads_past_the_context(device, gen):
    """A span that ends past seq_len (a caller's bug: the contract forbids it) reads no key
    at or past seq_len (those slots are NaN here): the kernel clamps its key loop."""
    layout = [(40, 20, [(30, 40)]), (17, 1, [])]
    batch, spans = image_batch(layout, gen=gen, device=device)
    spans[10:20, 1] = 48  # rows of positions 30..39: their image "ends" at 48 > 40
    out = triton_attention.paged_attention(*batch, 0.2, bidir_spans=spans)
    assert torch.isfinite(out).all()
    fixed = spans.clone()
    fixed[10:20, 1] = 40
    ref = paged_attention_reference(*batch, 0.2, bidir_spans=fixed)
    assert rel_error(out, ref) < REL_TOL[torch.float32]


def test_attention_rejects_bad_spans(device):
    meta = (torch.zeros(1, 1, dtype=torch.int32, device=device),
            torch.tensor([3], dtype=torch.int32, device=device),
            torch.tensor([0, 3], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="int32"):
        triton_attention.plan_attention(*meta, 16, bidir_spans=torch.zeros(3, 3, dtype=torch.int32,
                                                                           device=device))
    plan = triton_attention.plan_attention(*meta, 16, bidir_spans=torch.zeros(3, 2, dtype=torch.int32,
                                                                              device=device))
    q = torch.zeros(3, 4, 32, device=device)
    cache = torch.zeros(1, 16, 2, 32, device=device)
    with pytest.raises(ValueError, match="plan"):
        triton_attention.paged_attention(q, cache, cache, *meta, 1.0, plan=plan,
                                         bidir_spans=plan.bidir_spans)
    with pytest.raises(ValueError, match="rows"):
        triton_attention.paged_attention(torch.zeros(4, 4, 32, device=device), cache, cache, *meta, 1.0,
                                         plan=plan)


# -- cache write and block copy --------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_matches_reference(device, gen, block_size, dtype):
    """New K/V as views into a fused QKV output, some slots -1; the NaN cache shows that
    exactly the mapped slots were written."""
    kvh, d = (2, 80) if device == "cpu" else (8, 128)
    num_blocks, num_tokens = (6, 40) if device == "cpu" else (600, 4000)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen, device=device)[: num_tokens // 5]] = -1
    fused = torch.randn(num_tokens, 3 * kvh * d, generator=gen, device=device).to(dtype)
    key = fused[:, kvh * d: 2 * kvh * d].view(-1, kvh, d)
    value = fused[:, 2 * kvh * d:].view(-1, kvh, d)
    k_cache = torch.full((num_blocks, block_size, kvh, d), NAN, dtype=dtype, device=device)
    v_cache = k_cache.clone()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_reference(key, value, ref_k, ref_v, slots)
    triton_cache.write_kv(key, value, k_cache, v_cache, slots.to(torch.int32))
    assert torch.equal(k_cache.nan_to_num(7.0), ref_k.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))
    assert torch.isnan(k_cache).any()  # unmapped slots stayed untouched


def test_write_kv_casts_to_cache_dtype(device, gen):
    key = torch.randn(5, 2, 16, generator=gen, device=device)
    k_cache = torch.full((2, 16, 2, 16), NAN, dtype=torch.bfloat16, device=device)
    v_cache = k_cache.clone()
    slots = torch.tensor([3, -1, 0, 31, 17], device=device)
    triton_cache.write_kv(key, key * 2, k_cache, v_cache, slots)
    got = v_cache.view(-1, 2, 16)[slots[slots >= 0]]
    want = (key[slots >= 0] * 2).bfloat16()
    if device == "cpu":  # Triton 3.9's interpreter truncates fp32 -> bf16: within one ulp
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
    else:  # compiled: round to nearest even, as torch does
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_copy_blocks_matches_reference(device, gen, dtype):
    num_blocks, block_size, kvh, d = (10, 16, 2, 64) if device == "cpu" else (512, 16, 8, 128)
    k = torch.randn(num_blocks, block_size, kvh, d, generator=gen, device=device).to(dtype)
    v = torch.randn(num_blocks, block_size, kvh, d, generator=gen, device=device).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    pairs = list(zip(ids[: num_blocks // 3], ids[num_blocks // 3: 2 * (num_blocks // 3)]))
    for _, dst in pairs:  # poison the destinations
        k[dst], v[dst] = NAN, NAN
    ref_k, ref_v = k.clone(), v.clone()
    copy_blocks_reference(ref_k, ref_v, pairs)
    triton_cache.copy_blocks(k, v, pairs)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


def test_copy_blocks_into_other_caches_and_rejects_chains(device, gen):
    """Swap-style copy into a second pool on the same device; overlapping pairs refused."""
    k = torch.randn(6, 16, 2, 32, generator=gen, device=device)
    v = torch.randn(6, 16, 2, 32, generator=gen, device=device)
    dst_k = torch.full((4, 16, 2, 32), NAN, device=device)
    dst_v = dst_k.clone()
    triton_cache.copy_blocks(k, v, [(5, 0), (2, 3), (0, 1)], dst_k_cache=dst_k, dst_v_cache=dst_v)
    assert torch.equal(dst_k[[0, 3, 1]], k[[5, 2, 0]]) and torch.equal(dst_v[[0, 3, 1]], v[[5, 2, 0]])
    assert torch.isnan(dst_k[2]).all()
    with pytest.raises(ValueError, match="distinct"):
        triton_cache.copy_blocks(k, v, [(1, 2), (2, 3)])
    with pytest.raises(ValueError, match="out of range"):
        triton_cache.copy_blocks(k, v, [(1, 6)])


# -- backend selection and the model on top --------------------------------------------------

def test_backend_selector_gives_triton_here(device):
    assert get_attention_backend("triton", device).name == "triton"
    assert get_attention_backend("auto", device).name == ("triton" if device == "cuda" else "cpu")
    assert get_attention_backend("torch", device).name == "torch"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_runner_with_triton_backend_matches_torch_backend(device, arch, family_model_dir):
    """The whole worker path (write_kv + paged attention in every layer) on the Triton
    backend: chunked prefill then decode steps give the torch backend's tokens. Gemma 3's
    tiny preset has a 48-token window on two layers of three, and the prompt outgrows it."""
    from proto import worker_pb2
    from worker_svc.config import RunnerConfig
    from worker_svc.model_runner import ModelRunner

    runners = {name: ModelRunner(RunnerConfig(
        model=str(family_model_dir(arch)), block_size=16, num_blocks=24, device=device,
        attention_backend=name)) for name in ("torch", "triton")}
    assert runners["triton"].backend.name == "triton"
    prompts = {"a": list(range(10, 70)), "b": list(range(100, 107))}
    blocks = {"a": [9, 2, 17, 20, 21], "b": [5, 11]}
    tokens = {}
    for name, runner in runners.items():
        sampled = {rid: [] for rid in prompts}
        for step in range(8):
            req = worker_pb2.StepRequest(step_id=step)
            for rid, prompt in prompts.items():
                if step == 0:
                    req.new_requests.add(
                        request_id=rid, token_ids=prompt, num_prompt_tokens=len(prompt),
                        block_ids=blocks[rid], reply_channel="c",
                        sampling=worker_pb2.SamplingParams(max_tokens=20, temperature=0.0))
                    req.num_scheduled_tokens[rid] = 24 if rid == "a" else len(prompt)
                elif step == 1 and rid == "a":
                    req.num_scheduled_tokens[rid] = len(prompt) - 24  # rest of the prefill
                else:
                    req.num_scheduled_tokens[rid] = 1
            for s in runner.step(req).result.sampled:
                sampled[s.request_id].append(s.token_id)
        tokens[name] = sampled
    assert tokens["triton"] == tokens["torch"]
    assert len(tokens["torch"]["a"]) == 7 and len(tokens["torch"]["b"]) == 8, tokens


# -- the interpreter run ---------------------------------------------------------------------

@pytest.mark.skipif(INTERPRETER, reason="this process is the interpreter run")
def test_cases_in_triton_interpreter():
    """Every non-gpu case above, on the CPU, in a subprocess with TRITON_INTERPRET=1."""
    repo = Path(__file__).resolve().parent.parent
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
         str(Path(__file__).relative_to(repo))],
        cwd=repo, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=900)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and " failed" not in proc.stdout, report
    print(f"interpreter run: {time.monotonic() - start:.0f} s; {proc.stdout.strip().splitlines()[-1]}")
