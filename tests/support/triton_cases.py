"""What the Triton kernel tests share (tests/unit/kernels/test_triton_kernels.py,
tests/unit/kernels/test_triton_bidirectional.py): where the cases run (Triton's interpreter on the CPU, in a
process of its own, or compiled on CUDA under the `gpu` marker), the random batches with
NaN-poisoned caches and buffers, the comparison with the plain-torch reference, and the rerun
of a test file in the interpreter."""

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

from kernels import triton_attention  # noqa: E402  (after the importorskip)
from kernels.reference import paged_attention_reference  # noqa: E402

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
                    bidir_spans=None, tiles=None):
    """Run the kernel into a NaN-poisoned buffer and compare with the fp32 reference.
    `bidir_spans` go through plan_attention, as the worker passes them; `tiles` override
    the launch's (kernels/triton_tiles.py)."""
    q, k_cache, v_cache, block_tables, seq_lens, qsl = batch
    query = q if query is None else query
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.full_like(q, NAN)
    plan = triton_attention.plan_attention(block_tables, seq_lens, qsl, k_cache.shape[1],
                                           sliding_window, bidir_spans=bidir_spans)
    assert (plan is None) == (bidir_spans is None)  # no spans: nothing planned, as before
    triton_attention.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, qsl, scale,
                                     sliding_window=sliding_window, soft_cap=soft_cap, plan=plan,
                                     out=out, tiles=tiles)
    ref = paged_attention_reference(query.float(), k_cache.float(), v_cache.float(),
                                    block_tables, seq_lens, qsl, scale,
                                    sliding_window=sliding_window, soft_cap=soft_cap,
                                    bidir_spans=bidir_spans)
    err = rel_error(out, ref)
    assert err < REL_TOL[q.dtype], f"relative error {err:.2e} (limit {REL_TOL[q.dtype]:.0e})"
    return out


def run_in_interpreter(test_file: str) -> None:
    """Every non-gpu case of `test_file`, on the CPU, in a subprocess with TRITON_INTERPRET=1."""
    repo = Path(__file__).resolve().parents[2]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
         str(Path(test_file).resolve().relative_to(repo))],
        cwd=repo, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=900)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and " failed" not in proc.stdout, report
    print(f"interpreter run: {time.monotonic() - start:.0f} s; {proc.stdout.strip().splitlines()[-1]}")
