"""The cpu backend: paged attention in C for decode rows, read straight from the block tables.

The torch backend (kernels/torch_attention.py) gathers every decode request's blocks into
a contiguous scratch buffer and hands it to SDPA: the K/V are read, written and read again,
and SDPA's CPU kernel pays a fixed cost per (request, head) that dwarfs the few FLOPs of a
one-token query. On the `small` preset at batch 32 that was ~40% of a decode step. This
kernel reads each K and V vector once, where it lies in the paged cache.

Same contract as kernels/reference.py (flat varlen batch, cache layout, causal rule,
sliding window, soft cap; fp32 math). Requests with q_len <= SHORT_MAX_Q_LEN (decodes,
short chunked-prefill tails) go to the C kernel; longer prefill chunks still take the
torch backend's gather + SDPA path, where SDPA's blocked GEMMs are the right tool.

The kernel, per (request r, kv head h) work item, in parallel (OpenMP, torch's own runtime
and thread count):

    q_vecs = the q_len * group query vectors of r that read kv head h, times scale
    for key position l in [first visible, seq_len):              # each K row read once
        k = k_cache[block_tables[r][l // bs], l % bs, h]
        for each query vector i (row j = i // group, at position p = seq_len - q_len + j):
            s[i][l] = dot(q_vecs[i], k), soft-capped; -inf unless p - window < l <= p
    p[i] = exp(s[i] - max(s[i]))                                  # softmax, fp32
    for l: acc[i] += p[i][l] * v_cache[block(l), l % bs, h]       # each V row read once
    out[row j, head h * group + i % group] = acc[i] / sum(p[i])

K/V may be fp32 or bf16 (converted on load); query and out share the cache's dtype (for
fp16 models the worker picks the torch backend). The C
source below is compiled once per machine with the system C compiler (`cc`, or $CC) into
a cache folder ($PAGEDSERVE_KERNEL_CACHE, default ~/.cache/pagedserve) keyed by the source,
flags and CPU, and loaded with ctypes; it links the OpenMP runtime torch already loaded.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import torch_attention

SHORT_MAX_Q_LEN = 8  # requests with at most this many query rows run in the C kernel

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = ((uint32_t)h) << 16;
    float x;
    memcpy(&x, &bits, 4);
    return x;
}
static inline uint16_t f32_to_bf16(float x) {
    if (isnan(x)) return 0x7FC0;
    uint32_t bits;
    memcpy(&bits, &x, 4);
    bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}
static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void store(void *p, int64_t i, float x, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(x); else ((float *)p)[i] = x;
}
/* The K or V vectors of kv heads [h0, h0 + n) of one token, as floats. */
static inline const float *token_row(const void *cache, int64_t base, int64_t n, float *buf,
                                     int bf16) {
    if (!bf16) return (const float *)cache + base;
    const uint16_t *src = (const uint16_t *)cache + base;
    for (int64_t d = 0; d < n; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

/* Element offset of kv head h0 of token l in a [blocks, block_size, kv_heads, head_dim] cache. */
static inline int64_t slot_offset(const int32_t *table, int64_t l, int64_t block_size,
                                  int64_t slot_stride, int64_t h0, int64_t head_dim) {
    return ((int64_t)table[l / block_size] * block_size + l % block_size) * slot_stride
           + h0 * head_dim;
}

/* Ask for the K or V vectors of token l + PREFETCH_DISTANCE early: rows of one block are
   contiguous, but blocks are scattered, so the hardware prefetcher stalls at every block. */
#define PREFETCH_DISTANCE 16 /* tokens: one block at block size 16 */
static inline void prefetch_row(const void *cache, const int32_t *table, int64_t l, int64_t end,
                                int64_t block_size, int64_t slot_stride, int64_t h0,
                                int64_t head_dim, int64_t width, int64_t elem) {
    if (l >= end) return;
    const char *p = (const char *)cache
                    + slot_offset(table, l, block_size, slot_stride, h0, head_dim) * elem;
    for (int64_t b = 0; b < width * elem; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* Work item w: request reqs[w / splits], kv heads [h0, h0 + heads) with heads =
   num_kv_heads / splits. Returns 0, or -1 if scratch memory could not be allocated. */
int paged_attention(const void *query, void *out, const void *k_cache, const void *v_cache,
                    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                    const int32_t *query_start_loc, const int32_t *reqs, int64_t num_reqs,
                    int64_t q_row_stride,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t block_size, float scale, int64_t window, float soft_cap,
                    int64_t max_q_len, int64_t max_scores, int64_t splits, int bf16) {
    const int64_t group = num_heads / num_kv_heads, heads = num_kv_heads / splits;
    const int64_t row_stride = num_heads * head_dim;      /* out rows */
    const int64_t slot_stride = num_kv_heads * head_dim;  /* one token in the cache */
    const int64_t max_vecs = max_q_len * heads * group, width = heads * head_dim;
    const int64_t elem = bf16 ? 2 : 4;
    int failed = 0;
    #pragma omp parallel
    {
        float *qv = malloc(sizeof(float) * max_vecs * head_dim);
        float *acc = malloc(sizeof(float) * max_vecs * head_dim);
        float *s = malloc(sizeof(float) * max_scores * heads * group);
        float *buf = malloc(sizeof(float) * width);
        int64_t *koff = malloc(sizeof(int64_t) * max_vecs), *pos = malloc(sizeof(int64_t) * max_vecs);
        if (!qv || !acc || !s || !buf || !koff || !pos) {
            #pragma omp atomic write
            failed = 1;
        }
        /* Every thread of the team must reach the `omp for`, or none: agree first. */
        #pragma omp barrier
        int give_up;
        #pragma omp atomic read
        give_up = failed;
        if (!give_up) {
            #pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < num_reqs * splits; w++) {
                const int64_t r = reqs[w / splits], h0 = (w % splits) * heads;
                const int64_t q0 = query_start_loc[r], q_len = query_start_loc[r + 1] - q0;
                const int64_t seq_len = seq_lens[r], ctx0 = seq_len - q_len;
                const int64_t per_row = heads * group, nv = q_len * per_row;
                const int64_t lo = window > 0 && ctx0 - window + 1 > 0 ? ctx0 - window + 1 : 0;
                const int64_t span = seq_len - lo;
                const int32_t *table = block_tables + r * table_stride;
                /* vector i: query row q0 + i / per_row, head h0 * group + i % per_row */
                for (int64_t i = 0; i < nv; i++) {
                    const int64_t src = (q0 + i / per_row) * q_row_stride
                                        + (h0 * group + i % per_row) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++)
                        qv[i * head_dim + d] = load(query, src + d, bf16) * scale;
                    memset(acc + i * head_dim, 0, sizeof(float) * head_dim);
                    koff[i] = (i % per_row) / group * head_dim;  /* its kv head in the row */
                    pos[i] = ctx0 + i / per_row;                  /* its position */
                }
                for (int64_t l = lo; l < seq_len; l++) {
                    const int64_t base = slot_offset(table, l, block_size, slot_stride, h0, head_dim);
                    prefetch_row(k_cache, table, l + PREFETCH_DISTANCE, seq_len, block_size,
                                 slot_stride, h0, head_dim, width, elem);
                    const float *k = token_row(k_cache, base, width, buf, bf16);
                    float *sl = s + (l - lo);
                    for (int64_t i = 0; i < nv; i++) {
                        const float *q = qv + i * head_dim, *kh = k + koff[i];
                        float dot = 0.0f;
                        #pragma omp simd reduction(+:dot)
                        for (int64_t d = 0; d < head_dim; d++) dot += q[d] * kh[d];
                        if (soft_cap > 0.0f) dot = soft_cap * tanhf(dot / soft_cap);
                        const int visible = l <= pos[i] && (window <= 0 || l > pos[i] - window);
                        sl[i * span] = visible ? dot : -INFINITY;
                    }
                }
                for (int64_t i = 0; i < nv; i++) {
                    float *si = s + i * span, m = -INFINITY, sum = 0.0f;
                    for (int64_t l = 0; l < span; l++) m = si[l] > m ? si[l] : m;
                    for (int64_t l = 0; l < span; l++) { si[l] = expf(si[l] - m); sum += si[l]; }
                    const float inv = 1.0f / sum;
                    for (int64_t l = 0; l < span; l++) si[l] *= inv;
                }
                for (int64_t l = lo; l < seq_len; l++) {
                    const int64_t base = slot_offset(table, l, block_size, slot_stride, h0, head_dim);
                    prefetch_row(v_cache, table, l + PREFETCH_DISTANCE, seq_len, block_size,
                                 slot_stride, h0, head_dim, width, elem);
                    const float *v = token_row(v_cache, base, width, buf, bf16);
                    const float *sl = s + (l - lo);
                    for (int64_t i = 0; i < nv; i++) {
                        const float p = sl[i * span];
                        if (p == 0.0f) continue;
                        float *a = acc + i * head_dim;
                        const float *vh = v + koff[i];
                        #pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) a[d] += p * vh[d];
                    }
                }
                for (int64_t i = 0; i < nv; i++) {
                    const int64_t dst = (q0 + i / per_row) * row_stride
                                        + (h0 * group + i % per_row) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++)
                        store(out, dst + d, acc[i * head_dim + d], bf16);
                }
            }
        }
        free(qv); free(acc); free(s); free(buf); free(koff); free(pos);
    }
    return failed ? -1 : 0;
}
"""

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's `bf16` flag
_ARGTYPES = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 3
             + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64, ctypes.c_float]
             + [ctypes.c_int64] * 3 + [ctypes.c_int])


def _cpu_signature() -> str:
    """What -march=native depends on: a library built on one CPU may not run on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pagedserve")


def compile_library(compiler: str | None = None) -> Path:
    """The shared library for this source, flags and CPU: built once (atomically: several
    workers may start at the same time), then reused. RuntimeError if it cannot be built."""
    compiler = compiler or os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH (set CC, or install gcc)")
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *_FLAGS, platform.machine(),
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"paged_attention_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "paged_attention_cpu.c"
        src.write_text(_SOURCE)
        built = Path(tmp) / target.name
        proc = subprocess.run([compiler, *_FLAGS, str(src), "-o", str(built), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the cpu attention kernel failed:\n{proc.stderr[-2000:]}")
        os.replace(built, target)
    return target


def work_splits(num_reqs: int, num_kv_heads: int, num_threads: int) -> int:
    """Work items per request: 1 (all kv heads together: each token's K/V is one contiguous
    read), or one per kv head when there are too few requests to keep the threads busy."""
    return num_kv_heads if num_reqs < 2 * num_threads else 1


class CpuKernels:
    """The compiled kernel, loaded once per backend (per worker)."""

    def __init__(self, library: Path | None = None):
        torch.get_num_threads()  # torch's OpenMP runtime is loaded first; the kernel shares it
        self._kernel = ctypes.CDLL(str(library or compile_library())).paged_attention
        self._kernel.argtypes, self._kernel.restype = _ARGTYPES, ctypes.c_int

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    def short_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        plan: "CpuPlan", scale: float, sliding_window: int | None,
                        soft_cap: float | None, out: torch.Tensor) -> None:
        """Rows of the plan's short requests of `out` := their attention (the C kernel)."""
        num_tokens, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
        if not (query.dtype == k_cache.dtype == v_cache.dtype == out.dtype):
            raise ValueError(f"dtypes differ: query {query.dtype}, caches {k_cache.dtype}/"
                             f"{v_cache.dtype}, out {out.dtype}")
        if kv_dim != head_dim or num_heads % num_kv_heads or v_cache.shape != k_cache.shape:
            raise ValueError(f"query {tuple(query.shape)} does not fit caches "
                             f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
        if out.shape != query.shape:
            raise ValueError(f"out {tuple(out.shape)} != query {tuple(query.shape)}")
        if plan.block_size != block_size:
            raise ValueError(f"the plan is for blocks of {plan.block_size}, the cache has {block_size}")
        if plan.num_rows > num_tokens:
            raise ValueError(f"the plan's requests have {plan.num_rows} query rows, query {num_tokens}")
        if plan.short_reqs.numel() and not 0 <= plan.min_block_id <= plan.max_block_id < num_blocks:
            # the C code trusts every id it reads: an id outside the cache is a crash, not an error
            raise ValueError(f"block tables name blocks {plan.min_block_id}..{plan.max_block_id}; "
                             f"the cache has {num_blocks}")
        if query.device.type != "cpu" or query.stride(2) != 1 or query.stride(1) != head_dim:
            raise ValueError("query rows must be contiguous [heads, head_dim] on the CPU")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out),
                        ("block_tables", plan.block_tables), ("seq_lens", plan.seq_lens),
                        ("query_start_loc", plan.query_start_loc), ("short_reqs", plan.short_reqs)):
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous CPU tensor")
        # One work item per request, with all its kv heads (each token's K/V is read as one
        # contiguous run); split by kv head when there are too few requests to keep every
        # thread busy. (torch.get_num_threads() also sets this thread's OpenMP thread count
        # to torch's, which the kernel's parallel region then uses.)
        splits = work_splits(plan.short_reqs.numel(), num_kv_heads, torch.get_num_threads())
        status = self._kernel(
            query.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            plan.block_tables.data_ptr(), plan.block_tables.shape[1], plan.seq_lens.data_ptr(),
            plan.query_start_loc.data_ptr(), plan.short_reqs.data_ptr(), plan.short_reqs.numel(),
            query.stride(0), num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window or 0,
            soft_cap or 0.0, plan.max_q_len, plan.max_scores, splits, _DTYPES[query.dtype])
        if status != 0:
            raise MemoryError("the cpu attention kernel could not allocate its scratch memory")


@dataclass(frozen=True)
class CpuPlan:
    """Per-step inputs of the C kernel (int32, contiguous), plus the torch plan of the long
    prefill chunks."""

    block_tables: torch.Tensor  # int32 [R, max_blocks]
    seq_lens: torch.Tensor  # int32 [R]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    short_reqs: torch.Tensor  # int32 [n]: requests with 1 <= q_len <= SHORT_MAX_Q_LEN
    max_q_len: int  # the largest q_len among them
    max_scores: int  # the largest q_len x keys scored (context, cut by the window) among them
    block_size: int
    min_block_id: int  # the smallest and largest block ids their contexts use
    max_block_id: int
    num_rows: int  # query rows of the whole batch
    long: torch_attention.AttentionPlan  # the other requests, for the torch path


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, block_size: int,
                   sliding_window: int | None = None,
                   workspace: torch_attention.Workspace | None = None) -> CpuPlan:
    """Split the batch: short requests for the C kernel (with the bounds it needs, checked
    here once per step: ValueError for a block table too narrow for its context), the rest
    planned by the torch backend."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    short, long = [], []
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        if 1 <= q_len <= SHORT_MAX_Q_LEN:
            short.append(i)
        elif q_len > SHORT_MAX_Q_LEN:
            long.append(i)
    min_id = max_id = 0
    if short:
        needed = torch.tensor([-(-lens[i] // block_size) for i in short])
        if int(needed.max()) > block_tables.shape[1]:
            raise ValueError(f"a context needs {int(needed.max())} blocks; the block tables have "
                             f"{block_tables.shape[1]} columns")
        used = block_tables[short][torch.arange(block_tables.shape[1])[None, :] < needed[:, None]]
        if used.numel():
            min_id, max_id = int(used.min()), int(used.max())

    def scored(i: int) -> int:  # query rows x keys the C kernel scores for request i
        q_len = starts[i + 1] - starts[i]
        keys = lens[i] if sliding_window is None else min(lens[i], sliding_window + q_len - 1)
        return q_len * keys

    return CpuPlan(
        block_tables=block_tables.to(torch.int32).contiguous(),
        seq_lens=seq_lens.to(torch.int32).contiguous(),
        query_start_loc=query_start_loc.to(torch.int32).contiguous(),
        short_reqs=torch.tensor(short, dtype=torch.int32),
        max_q_len=max((starts[i + 1] - starts[i] for i in short), default=0),
        max_scores=max((scored(i) for i in short), default=0),
        block_size=block_size, min_block_id=min_id, max_block_id=max_id, num_rows=starts[-1],
        long=torch_attention.plan_attention(block_tables, seq_lens, query_start_loc, block_size,
                                            sliding_window, workspace, only=long),
    )


def paged_attention(kernels: CpuKernels, query: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    plan: CpuPlan | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same result as `paged_attention_reference`; `plan` (from this module's
    plan_attention, with the same sliding_window) is reused across layers."""
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1], sliding_window)
    if out is None:
        out = query.new_empty(query.shape)  # contiguous, whatever the query's strides
    if not kernels.supports(query.dtype):
        raise ValueError(f"the cpu backend supports {sorted(map(str, _DTYPES))}, not {query.dtype} "
                         "(the worker picks the torch backend for other dtypes)")
    if plan.short_reqs.numel():
        # Rows may be spaced apart (a view of the fused q/k projection): no copy needed.
        rows_ok = query.stride(2) == 1 and query.stride(1) == query.shape[2]
        kernels.short_attention(query if rows_ok else query.contiguous(), k_cache, v_cache, plan,
                                scale, sliding_window, soft_cap, out)
    if plan.long.prefills:
        torch_attention.paged_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                        query_start_loc, scale, sliding_window, soft_cap,
                                        plan.long, out)
    return out
