"""Triton kernels (kernels/triton_attention.py, kernels/triton_cache.py) against the plain
references, on fresh random inputs per case.

Two ways these cases run:
- on the CPU, in Triton's interpreter, small shapes. Triton decides interpreter-or-compiler
  when a kernel is decorated, from TRITON_INTERPRET, so the interpreter run needs a process
  of its own: `test_cases_in_triton_interpreter` reruns this file in a subprocess with
  TRITON_INTERPRET=1 (directly: `TRITON_INTERPRET=1 pytest tests/unit/kernels/test_triton_kernels.py`),
  and other test modules never see the variable;
- on CUDA (`gpu` marker), the same cases at full size (Llama-3-8B head layout, contexts of
  thousands of tokens), compiled. They skip without CUDA.
Compiled ahead of time without a GPU (what the interpreter cannot catch):
tests/unit/kernels/test_triton_compile.py.

Every output buffer is NaN before the call, so an element the kernel fails to write fails
the comparison, and every cache slot no request owns is NaN, so a kernel that reads past a
request's context (or a block-table padding entry) turns its output NaN.

Gemma 3's bidirectional image spans: tests/unit/kernels/test_triton_bidirectional.py. What both share
(devices, batches, the comparison, the interpreter rerun): tests/support/triton_cases.py.
"""

import pytest
import torch

from tests.support.triton_cases import (  # noqa: F401  (device, gen: fixtures)
    INTERPRETER,
    NAN,
    ON_CUDA,
    REL_TOL,
    SMALL_MIXES,
    check_attention,
    device,
    gen,
    llama_layout,
    make_batch,
    mixes,
    rel_error,
    run_in_interpreter,
)
from kernels import sdpa_prefill, triton_attention, triton_cache, triton_tiles  # noqa: E402  (triton_cases skips without triton)
from kernels.backend import get_attention_backend
from kernels.host_layout import HostLayout
from kernels.reference import copy_blocks_reference, paged_attention_reference, write_kv_reference


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


# Tile sets with the diagonal and the window's edge in separate key tiles or in one, and every
# tuned one (kernels/triton_tuned.json): each masked/unmasked split of the key loop is exact.
TILE_SETS = sorted({(16, 16, 4, 1), (32, 16, 4, 2), (64, 32, 4, 2), (16, 64, 4, 3), (128, 32, 8, 2),
                    *triton_tiles.TUNED.values()})


@pytest.mark.parametrize("tiles", TILE_SETS, ids=["m{}-n{}-w{}-s{}".format(*t) for t in TILE_SETS])
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (8, None), (33, 30.0)])
def test_attention_in_every_tile_set(device, gen, tiles, sliding_window, soft_cap):
    reqs = mixes(device)["mixed"] + mixes(device)["chunked_prefill"]
    if device == "cuda" and sliding_window is not None:
        sliding_window *= 32  # past a tile of keys
    batch = make_batch(reqs, gen=gen, device=device, dtype=torch.bfloat16, **llama_layout(device))
    check_attention(batch, sliding_window=sliding_window, soft_cap=soft_cap,
                    scale=1.0 if soft_cap else None, tiles=dict(zip(triton_tiles.TILE_KEYS, tiles)))


def test_tiles_that_do_not_fit_the_kernel_are_refused(device, gen):
    batch = make_batch(SMALL_MIXES["mixed"], gen=gen, device=device, num_heads=8, num_kv_heads=1)
    for tiles in [(4, 16, 4, 2), (16, 8, 4, 2), (24, 16, 4, 2), (16, 16, 3, 2), (16, 16, 4, 0)]:
        with pytest.raises(ValueError, match="tiles"):
            check_attention(batch, tiles=dict(zip(triton_tiles.TILE_KEYS, tiles)))
    with pytest.raises(ValueError, match="tiles"):
        check_attention(batch, tiles={"BLOCK_M": 16, "TILE_N": 16})


@pytest.mark.parametrize("mix", ["prefill_only", "chunked_prefill", "mixed"])
def test_long_chunks_run_on_sdpa_over_the_gathered_context(device, gen, mix, monkeypatch):
    """With the lengths on the host (as the worker plans), chunks of MIN_TOKENS or more run on
    SDPA (fresh prompts, and chunks after cached context: the mask aligned to the last key)
    and the rest in the Triton kernel; a window, images or a soft cap keep all in Triton."""
    if device == "cpu":
        monkeypatch.setattr(sdpa_prefill, "MIN_TOKENS", 16)
    q, k_cache, v_cache, bt, seq_lens, qsl = batch = make_batch(
        mixes(device)[mix], gen=gen, device=device, dtype=torch.bfloat16, **llama_layout(device))
    host = HostLayout(seq_lens.cpu().numpy(), qsl.cpu().numpy(), int(seq_lens.max()))
    plan = triton_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1], host=host)
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    routed = [i for i, n in enumerate(q_lens) if n >= sdpa_prefill.MIN_TOKENS]
    assert [r[0] for r in plan.sdpa.requests] == routed and plan.sdpa.skip.tolist() == [
        int(i in routed) for i in range(len(q_lens))]
    scale = q.shape[-1] ** -0.5
    for soft_cap in (None, 20.0):
        out = torch.full_like(q, NAN)
        triton_attention.paged_attention(*batch, scale, soft_cap=soft_cap, plan=plan, out=out)
        ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), bt, seq_lens, qsl, scale,
                                        soft_cap=soft_cap)
        assert rel_error(out, ref) < REL_TOL[torch.bfloat16]
    assert triton_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1], 8, host=host) is None
    spans = torch.zeros(q.shape[0], 2, dtype=torch.int32, device=device)
    assert triton_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1], bidir_spans=spans,
                                           host=host).sdpa is None


def test_fp32_stays_in_the_triton_kernel(device, gen, monkeypatch):
    """SDPA's fused kernels do not take fp32: a planned route is not taken for it."""
    monkeypatch.setattr(sdpa_prefill, "MIN_TOKENS", 16 if device == "cpu" else sdpa_prefill.MIN_TOKENS)

    def no_route(*args):
        raise AssertionError("an fp32 step went to SDPA")

    monkeypatch.setattr(sdpa_prefill, "run_route", no_route)
    q, k_cache, v_cache, bt, seq_lens, qsl = batch = make_batch(
        mixes(device)["prefill_only"], gen=gen, device=device, **llama_layout(device))
    host = HostLayout(seq_lens.cpu().numpy(), qsl.cpu().numpy(), int(seq_lens.max()))
    plan = triton_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1], host=host)
    assert plan.sdpa.requests
    out = triton_attention.paged_attention(*batch, 0.3, plan=plan)
    ref = paged_attention_reference(*batch, 0.3)
    assert rel_error(out, ref) < REL_TOL[torch.float32]


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
        model=str(family_model_dir(arch)), block_size=16, num_blocks=72, device=device,
        attention_backend=name)) for name in ("torch", "triton")}
    assert runners["triton"].backend.name == "triton"
    # a table per KV cache group (Gemma 3's global layer and its sliding ones), 24 blocks each
    groups = runners["torch"].kv_layout.num_groups
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
                        block_ids=[b + 24 * g for g in range(groups) for b in blocks[rid]], reply_channel="c",
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
    run_in_interpreter(__file__)
