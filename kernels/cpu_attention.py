"""The cpu backend: paged attention in C for decode rows, read straight from the block tables.

The torch backend (kernels/torch_attention.py) gathers every decode request's blocks into
a contiguous scratch buffer and hands it to SDPA: the K/V are read, written and read again,
and SDPA's CPU kernel pays a fixed cost per (request, head) that dwarfs the few FLOPs of a
one-token query. On the `small` preset at batch 32 that was ~40% of a decode step. This
kernel reads each K and V vector once, where it lies in the paged cache.

Same contract as kernels/reference.py (flat varlen batch, cache layout, causal rule,
sliding window, soft cap, bidirectional spans; fp32 math). Requests with q_len <=
SHORT_MAX_Q_LEN (decodes, short chunked-prefill tails) go to the C kernel; longer prefill
chunks still take the torch backend's gather + SDPA path, where SDPA's blocked GEMMs are
the right tool.

Spans reach the C kernel too: a short request may hold a whole small image (a few soft
tokens), or the end of one whose start is in its cached context (a prefix-cache hit ending
inside the image). A span [s, e) holds its row's position p (checked by plan_attention), so
the row sees [0, p] u [s, e) = [0, max(p, e - 1)]: the kernel moves that row's last visible
key from p to e - 1, and nothing else changes. Without spans (or when no short request's
span reaches past its row: always for decodes, whose row is the context's last) the plan
passes NULL and the kernel reads `pos` as before, with no extra work per score.

The kernel, per (request r, kv head h) work item, in parallel (OpenMP, torch's own runtime
and thread count):

    q_vecs = the q_len * group query vectors of r that read kv head h, times scale
    for key position l in [first visible, seq_len):              # each K row read once
        k = k_cache[block_tables[r][l // bs], l % bs, h]
        for each query vector i (row j = i // group, at position p = seq_len - q_len + j):
            last = p, or max(p, e - 1) with a bidirectional span [s, e) (spans[row j])
            s[i][l] = dot(q_vecs[i], k), soft-capped; -inf unless p - window < l <= last
    p[i] = exp(s[i] - max(s[i]))        # softmax, fp32 (AVX-512: 16 at a time, a polynomial)
    for l: acc[i] += p[i][l] * v_cache[block(l), l % bs, h]       # each V row read once
    out[row j, head h * group + i % group] = acc[i] / sum(p[i])

K/V may be fp32 or bf16 (converted on load), and so may query and out (one dtype for both):
the cache may be kept in bf16 for an fp32 model (`--kv-cache-dtype bfloat16`). For fp16
models the worker picks the torch backend.

The C source is kernels/cpu_attention.c; its one declaration, kernels/cpu_attention.h,
takes the arguments by name in a struct. The kernel includes the declaration, and cffi
generates the Python binding from the same text, so the two are compiled against each
other: a kernel that disagrees with its declaration does not build. At load, KernelArgs
(the Python side's fields) is checked against the struct the module was built with, and
every call converts each field by its declared C type (a wrong type is a TypeError, never
a misread argument). Both are compiled once per machine into one extension module
(kernels/cpu_kernel_build.py: the system C compiler, a cache folder keyed by the source,
declaration, flags, interpreter and CPU, the OpenMP runtime torch already loaded).

This module holds the kernel's Python side: its source and declaration, the attention
kernel built from them (`compile_library`), its arguments (KernelArgs, checked against the
struct at load), the loaded kernel (CpuKernels), and each step's plan (plan_attention).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kernels import cpu_kernel_build, torch_attention
from kernels.host_layout import HostLayout

SHORT_MAX_Q_LEN = 8  # requests with at most this many query rows run in the C kernel

_KERNEL_DIR = Path(__file__).resolve().parent
SOURCE = _KERNEL_DIR / "cpu_attention.c"
HEADER = _KERNEL_DIR / "cpu_attention.h"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's `bf16` flag


def compile_library(compiler: str | None = None, source: Path = SOURCE, header: Path = HEADER,
                    extra_flags: tuple[str, ...] = ()) -> Path:
    """The attention kernel and its binding, built once per machine and cached
    (kernels/cpu_kernel_build.py `compile_library`): from this source and declaration, or
    from edited copies or another revision's (the tests, bench/compute/cpu_attention.py).
    RuntimeError if it cannot be built."""
    return cpu_kernel_build.compile_library(compiler, source=source, header=header, extra_flags=extra_flags)


class KernelArgs(NamedTuple):
    """One call's arguments: the fields of `struct paged_attention_args` (cpu_attention.h),
    by name and in its order (they fill the struct in that order); load_library checks
    that the two agree. Pointers are data_ptr()s."""

    query: int
    out: int
    k_cache: int
    v_cache: int
    block_tables: int
    table_stride: int
    seq_lens: int
    query_start_loc: int
    reqs: int
    bidir_spans: int  # 0 (NULL): no spans
    num_reqs: int
    q_row_stride: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    scale: float
    window: int
    soft_cap: float
    max_q_len: int
    max_scores: int
    splits: int
    bf16: int
    kv_bf16: int


_POINTERS = ("query", "out", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc", "reqs",
             "bidir_spans")


def load_library(path: Path):
    """The compiled module at `path` (its `ffi` and `lib`), after checking that KernelArgs
    has exactly the fields of the struct it was built with, in its order, pointers where
    it has pointers: ValueError otherwise, before the kernel is ever called."""
    module = cpu_kernel_build.import_library(path, SOURCE)
    theirs = [(name, field.type.kind) for name, field
              in module.ffi.typeof("struct paged_attention_args").fields]
    ours = [(name, "pointer" if name in _POINTERS else "primitive") for name in KernelArgs._fields]
    if theirs != ours:
        differ = sorted({name for name, _ in set(theirs) ^ set(ours)}) or "the order"
        raise ValueError(f"the kernel's struct paged_attention_args and KernelArgs disagree on {differ}")
    return module


def work_splits(num_reqs: int, num_kv_heads: int, num_threads: int) -> int:
    """Work items per request: 1 (all kv heads together: each token's K/V is one contiguous
    read), or one per kv head when there are too few requests to keep the threads busy."""
    return num_kv_heads if num_reqs < 2 * num_threads else 1


class CpuKernels:
    """The compiled kernel, loaded once per backend (per worker)."""

    def __init__(self, library: Path | None = None):
        torch.get_num_threads()  # torch's OpenMP runtime is loaded first; the kernel shares it
        module = load_library(library or compile_library())
        self._kernel, ffi = module.lib.paged_attention, module.ffi
        self._new, self._cast = ffi.new, ffi.cast
        self._struct_type, self._void_p = ffi.typeof("struct paged_attention_args *"), ffi.typeof("void *")
        self._pointer_fields = [KernelArgs._fields.index(name) for name in _POINTERS]

    def _struct(self, args: KernelArgs):
        """The C struct of `args`; cffi converts each field by its declared type."""
        values = list(args)
        for i in self._pointer_fields:
            values[i] = self._cast(self._void_p, values[i])
        return self._new(self._struct_type, values)

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    def short_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        plan: "CpuPlan", scale: float, sliding_window: int | None,
                        soft_cap: float | None, out: torch.Tensor) -> None:
        """Rows of the plan's short requests of `out` := their attention (the C kernel)."""
        num_tokens, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
        if query.dtype != out.dtype or k_cache.dtype != v_cache.dtype:
            raise ValueError(f"dtypes differ: query {query.dtype}, out {out.dtype}, caches "
                             f"{k_cache.dtype}/{v_cache.dtype}")
        if not (self.supports(query.dtype) and self.supports(k_cache.dtype)):
            raise ValueError(f"unsupported dtypes: query {query.dtype}, cache {k_cache.dtype} "
                             "(the kernel takes fp32 or bf16)")
        if kv_dim != head_dim or num_heads % num_kv_heads or v_cache.shape != k_cache.shape:
            raise ValueError(f"query {tuple(query.shape)} does not fit caches "
                             f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
        if out.shape != query.shape:
            raise ValueError(f"out {tuple(out.shape)} != query {tuple(query.shape)}")
        if plan.block_size != block_size:
            raise ValueError(f"the plan is for blocks of {plan.block_size}, the cache has {block_size}")
        if plan.num_rows > num_tokens:
            raise ValueError(f"the plan's requests have {plan.num_rows} query rows, query {num_tokens}")
        if plan.num_short and not 0 <= plan.min_block_id <= plan.max_block_id < num_blocks:
            # the C code trusts every id it reads: an id outside the cache is a crash, not an error
            raise ValueError(f"block tables name blocks {plan.min_block_id}..{plan.max_block_id}; "
                             f"the cache has {num_blocks}")
        if query.device.type != "cpu" or query.stride(2) != 1 or query.stride(1) != head_dim:
            raise ValueError("query rows must be contiguous [heads, head_dim] on the CPU")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out),
                        ("block_tables", plan.block_tables), ("seq_lens", plan.seq_lens),
                        ("query_start_loc", plan.query_start_loc)):
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous CPU tensor")
        short = plan.short_reqs
        if short is not None and not (short.is_contiguous() and short.device.type == "cpu"
                                      and short.dtype == torch.int32 and short.shape == (plan.num_short,)):
            raise ValueError(f"the plan's short_reqs must be a contiguous int32 CPU tensor [{plan.num_short}]")
        spans = plan.bidir_spans
        if spans is not None and not (spans.is_contiguous() and spans.device.type == "cpu"
                                      and spans.dtype == torch.int32
                                      and spans.shape == (plan.num_rows, 2)):
            raise ValueError(f"the plan's bidir_spans must be a contiguous int32 CPU tensor "
                             f"[{plan.num_rows}, 2]")
        # One work item per request, with all its kv heads (each token's K/V is read as one
        # contiguous run); split by kv head when there are too few requests to keep every
        # thread busy. (torch.get_num_threads() also sets this thread's OpenMP thread count
        # to torch's, which the kernel's parallel region then uses.)
        splits = work_splits(plan.num_short, num_kv_heads, torch.get_num_threads())
        args = KernelArgs(
            query=query.data_ptr(), out=out.data_ptr(), k_cache=k_cache.data_ptr(),
            v_cache=v_cache.data_ptr(), block_tables=plan.block_tables.data_ptr(),
            table_stride=plan.block_tables.shape[1], seq_lens=plan.seq_lens.data_ptr(),
            query_start_loc=plan.query_start_loc.data_ptr(),
            reqs=0 if plan.short_reqs is None else plan.short_reqs.data_ptr(),
            bidir_spans=0 if spans is None else spans.data_ptr(), num_reqs=plan.num_short,
            q_row_stride=query.stride(0), num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, scale=scale,
            window=sliding_window or 0, soft_cap=soft_cap or 0.0, max_q_len=plan.max_q_len,
            max_scores=plan.max_scores, splits=splits, bf16=_DTYPES[query.dtype],
            kv_bf16=_DTYPES[k_cache.dtype])
        status = self._kernel(self._struct(args))
        if status != 0:
            raise MemoryError("the cpu attention kernel could not allocate its scratch memory")


@dataclass(frozen=True)
class CpuPlan:
    """Per-step inputs of the C kernel (int32, contiguous), plus the torch plan of the long
    prefill chunks."""

    block_tables: torch.Tensor  # int32 [R, max_blocks]
    seq_lens: torch.Tensor  # int32 [R]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    # int32 [num_short]: the requests with 1 <= q_len <= SHORT_MAX_Q_LEN; None: every
    # request (a decode-only step), in order
    short_reqs: torch.Tensor | None
    num_short: int
    max_q_len: int  # the largest q_len among them
    max_scores: int  # the largest q_len x keys scored (context, cut by the window) among them
    block_size: int
    min_block_id: int  # bounds on the block ids their contexts use (_block_id_range)
    max_block_id: int
    num_rows: int  # query rows of the whole batch
    long: torch_attention.AttentionPlan | None  # the other requests, for the torch path; None: none
    # int32 [num_rows, 2], contiguous: the rows' bidirectional spans, for the C kernel; None
    # when no short request has a row whose span reaches past it (the kernel gets NULL)
    bidir_spans: torch.Tensor | None = None


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, block_size: int,
                   sliding_window: int | None = None,
                   workspace: torch_attention.GatherWorkspace | None = None, *,
                   bidir_spans: torch.Tensor | None = None, host: HostLayout | None = None) -> CpuPlan:
    """Split the batch: short requests for the C kernel (with the bounds it needs, checked
    here once per step: ValueError for a block table too narrow for its context), the rest
    planned by the torch backend. `bidir_spans` (int32 [num_tokens, 2], kernels/reference.py)
    is checked here (ValueError), and handed on to each path only where it changes a row.
    `host`: the lengths as the host holds them (kernels/host_layout.py), read in place of
    the tensors."""
    reaching = None if bidir_spans is None else torch_attention.bidir_span_requests(
        bidir_spans, seq_lens, query_start_loc)
    starts = query_start_loc.cpu().numpy() if host is None else host.query_start_loc
    num_reqs, num_rows = len(starts) - 1, int(starts[-1])
    min_id = max_id = max_q_len = max_scores = 0
    if num_rows == num_reqs:  # one query row each (decodes): every request is short
        short, num_short, long = None, num_reqs, []
        if num_reqs:
            longest = int(seq_lens.max()) if host is None else host.max_seq_len
            min_id, max_id = _block_id_range(block_tables, -(-longest // block_size), host)
            max_q_len, max_scores = 1, longest if sliding_window is None else min(longest, sliding_window)
    else:
        lens = (seq_lens.cpu().numpy() if host is None else host.seq_lens).astype(np.int64)
        q_lens = np.diff(starts)
        short_rows = np.flatnonzero((q_lens >= 1) & (q_lens <= SHORT_MAX_Q_LEN))
        short, num_short = torch.from_numpy(short_rows.astype(np.int32)), short_rows.size
        long = np.flatnonzero(q_lens > SHORT_MAX_Q_LEN).tolist()
        if short_rows.size:
            needed = -(-lens[short_rows] // block_size)
            min_id, max_id = _block_id_range(block_tables, int(needed.max()), host, short_rows)
            short_q = q_lens[short_rows]
            keys = lens[short_rows] if sliding_window is None else np.minimum(lens[short_rows],
                                                                             sliding_window + short_q - 1)
            max_q_len, max_scores = int(short_q.max()), int((short_q * keys).max())  # rows x keys scored

    return CpuPlan(
        block_tables=_int32(block_tables), seq_lens=_int32(seq_lens), query_start_loc=_int32(query_start_loc),
        short_reqs=short, num_short=num_short,
        max_q_len=max_q_len, max_scores=max_scores,
        block_size=block_size, min_block_id=min_id, max_block_id=max_id, num_rows=num_rows,
        long=torch_attention.plan_attention(
            block_tables, seq_lens, query_start_loc, block_size, sliding_window, workspace, only=long,
            bidir_spans=bidir_spans if reaching and any(reaching[i] for i in long) else None,
            host=host) if long else None,
        bidir_spans=(bidir_spans[:num_rows].to(torch.int32).contiguous()
                     if reaching and any(reaching[i] for i in _short_list(short, num_short)) else None),
    )


def _short_list(short: torch.Tensor | None, count: int) -> list[int] | range:
    return range(count) if short is None else short.tolist()


def _block_id_range(tables: torch.Tensor, widest: int, host: HostLayout | None,
                    rows: np.ndarray | None = None) -> tuple[int, int]:
    """Bounds on the block ids in the first `widest` columns of `tables` ([R, W]; `rows` of
    it, or all): every entry the short requests' rows may read (a row's entries past its
    own context are block ids too: tables are padded with real ids or 0). From the host's
    bound where it has one (its ids were checked as they were written), else the smallest
    and largest entry. ValueError for a table narrower than `widest`."""
    if widest > tables.shape[1]:
        raise ValueError(f"a context needs {widest} blocks; the block tables have {tables.shape[1]} columns")
    if host is not None and host.block_ids_below is not None:
        return 0, host.block_ids_below - 1
    used = tables.cpu().numpy()
    used = (used if rows is None else used[rows])[:, :widest]
    return (int(used.min()), int(used.max())) if used.size else (0, 0)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def paged_attention(kernels: CpuKernels, query: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    plan: CpuPlan | None = None, out: torch.Tensor | None = None, *,
                    bidir_spans: torch.Tensor | None = None) -> torch.Tensor:
    """Same result as `paged_attention_reference`; `plan` (from this module's
    plan_attention, with the same sliding_window and bidir_spans) is reused across layers.
    `bidir_spans` only without a plan (a plan carries its own)."""
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1], sliding_window,
                              bidir_spans=bidir_spans)
    elif bidir_spans is not None:
        raise ValueError("pass bidir_spans to plan_attention: the plan carries them")
    if out is None:
        out = query.new_empty(query.shape)  # contiguous, whatever the query's strides
    if not (kernels.supports(query.dtype) and kernels.supports(k_cache.dtype)):
        raise ValueError(f"the cpu backend supports {sorted(map(str, _DTYPES))}, not query "
                         f"{query.dtype} / cache {k_cache.dtype} (the worker picks the torch backend "
                         "for other dtypes)")
    if plan.num_short:
        # Rows may be spaced apart (a view of the fused q/k projection): no copy needed.
        rows_ok = query.stride(2) == 1 and query.stride(1) == query.shape[2]
        kernels.short_attention(query if rows_ok else query.contiguous(), k_cache, v_cache, plan,
                                scale, sliding_window, soft_cap, out)
    if plan.long is not None and plan.long.prefills:
        torch_attention.paged_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                        query_start_loc, scale, sliding_window, soft_cap,
                                        plan.long, out)
    return out
