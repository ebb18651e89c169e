"""The cpu backend's C kernel (kernels/cpu_attention.py) against the plain-torch reference:
fresh random inputs per case, mixed batches, outputs poisoned with NaN before each call."""

import dataclasses
import platform

import numpy as np
import pytest
import torch

from kernels import cpu_attention, torch_attention
from kernels.backend import get_attention_backend
from kernels.host_layout import HostLayout
from kernels.reference import paged_attention_reference
from tests.unit.kernels.test_kernels import FP32, MIXES, make_case

# Beyond MIXES: q_len right at and just past the kernel's threshold, and a batch with a
# request whose first query row is its first token (zero cached tokens) beside decodes.
CASES = {**MIXES,
         "threshold": [(cpu_attention.SHORT_MAX_Q_LEN, cpu_attention.SHORT_MAX_Q_LEN),
                       (40, cpu_attention.SHORT_MAX_Q_LEN), (41, cpu_attention.SHORT_MAX_Q_LEN + 1),
                       (3, 2), (90, 1)],
         "many_decodes": [(s, 1) for s in range(1, 120, 7)]}


X86 = platform.machine() in ("x86_64", "AMD64")


@pytest.fixture(scope="module", params=["native", "portable"])
def kernels(request):
    """The kernel as the worker builds it (-march=native: AVX-512 intrinsics where the CPU has
    them), and built without AVX-512, so that the portable loops are tested on this CPU too."""
    if request.param == "native":
        return cpu_attention.CpuKernels()
    return portable_kernels()


def portable_kernels() -> cpu_attention.CpuKernels:
    """The kernel built without AVX-512 (its portable loops); skips where that is the native build."""
    if not X86:
        pytest.skip("the portable build is the native one on this CPU")
    return cpu_attention.CpuKernels(cpu_attention.compile_library(extra_flags=("-mno-avx512f",)))


def _run(kernels, case, scale, dtype=torch.float32, **options):
    query, k_cache, v_cache, bt, seq_lens, qsl = case
    ref = paged_attention_reference(query, k_cache, v_cache, bt, seq_lens, qsl, scale, **options)
    out = torch.full_like(query, float("nan"))
    cpu_attention.paged_attention(kernels, query, k_cache, v_cache, bt, seq_lens, qsl, scale,
                                  out=out, **options)
    return out, ref


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("block_size,heads", [(16, (8, 2)), (5, (4, 4)), (32, (12, 3))])
def test_matches_reference(kernels, name, block_size, heads):
    for seed, share in [(1, False), (2, True)]:
        case = make_case(seed + block_size, CASES[name], block_size=block_size, num_heads=heads[0],
                         num_kv_heads=heads[1], head_dim=64, share_first_block=share)
        out, ref = _run(kernels, case, 64 ** -0.5)
        torch.testing.assert_close(out, ref, **FP32)


@pytest.mark.parametrize("head_dim", [40, 72, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_with_and_without_a_whole_vector(kernels, head_dim, dtype):
    """head_dim a multiple of 16 (the AVX-512 loops) or not (the portable ones on any build)."""
    case = make_case(11, CASES["mixed"], block_size=16, num_heads=8, num_kv_heads=2,
                     head_dim=head_dim, dtype=dtype)
    out, ref = _run(kernels, case, head_dim ** -0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, **FP32)
    else:
        assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2


@pytest.mark.parametrize("sliding_window,soft_cap", [(8, None), (None, 5.0), (20, 3.0), (1, None)])
@pytest.mark.parametrize("name", ["mixed", "threshold"])  # threshold: multi-row short requests
def test_window_and_soft_cap(kernels, name, sliding_window, soft_cap):
    case = make_case(7, CASES[name], block_size=8)
    out, ref = _run(kernels, case, 0.2, sliding_window=sliding_window, soft_cap=soft_cap)
    torch.testing.assert_close(out, ref, **FP32)


@pytest.mark.parametrize("scale", [1.0, 3.0, 6.0])
def test_peaked_softmax_whose_small_terms_underflow(kernels, scale):
    """Scores tens to hundreds apart: most of each row's exponentials are far below fp32's
    smallest normal (the AVX-512 exp gives 0 below e^-88) and the rest must sum as the
    reference's do. The scores' rounding error grows with their size (with the scale), and
    the softmax turns an error in a score into a relative one in its weight: the tolerance
    grows with the scale (at 6.0 a Xeon's einsum in the reference and the kernel differed
    by 2.5e-5)."""
    case = make_case(13, CASES["mixed"], block_size=16, num_heads=8, num_kv_heads=2, head_dim=64)
    out, ref = _run(kernels, case, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=FP32["atol"] * scale, rtol=FP32["rtol"] * scale)


def test_a_nan_in_the_cache_is_not_hidden(kernels):
    """A NaN key makes every query that sees it NaN, as in the reference: the softmax's exp
    passes a NaN score on instead of treating it as a masked one."""
    query, k_cache, v_cache, bt, seq_lens, qsl = make_case(17, [(40, 1), (40, 1)], block_size=16,
                                                           num_heads=8, num_kv_heads=2, head_dim=64)
    k_cache[bt[0, 1], 3, 0, 5] = float("nan")  # request 0's token 19, kv head 0
    out, ref = _run(kernels, (query, k_cache, v_cache, bt, seq_lens, qsl), 64 ** -0.5)
    assert out[0, :4].isnan().all() and ref[0, :4].isnan().all()  # the query heads of kv head 0
    torch.testing.assert_close(out[0, 4:], ref[0, 4:], **FP32)
    torch.testing.assert_close(out[1], ref[1], **FP32)


def test_query_rows_spaced_apart_are_read_in_place(kernels):
    """The model hands over q as a view of its fused q/k projection: rows (heads + kv_heads)
    * head_dim apart. The kernel reads them where they are."""
    query, k_cache, v_cache, bt, seq_lens, qsl = make_case(9, CASES["mixed"], num_heads=8, num_kv_heads=2,
                                                           head_dim=64)
    wide = torch.cat([query, torch.full_like(query[:, :2], float("nan"))], dim=1)  # + 2 heads of NaN
    spaced = wide[:, :8]
    assert not spaced.is_contiguous()
    out, ref = _run(kernels, (spaced, k_cache, v_cache, bt, seq_lens, qsl), 64 ** -0.5)
    torch.testing.assert_close(out, ref, **FP32)


def test_bf16_close_to_reference(kernels):
    case = make_case(5, CASES["mixed"], dtype=torch.bfloat16, head_dim=64)
    out, ref = _run(kernels, case, 0.15)
    assert out.dtype == torch.bfloat16
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < 2e-2


@pytest.mark.parametrize("name", ["mixed", "threshold", "many_decodes"])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 20, "soft_cap": 3.0}], ids=["plain", "window"])
def test_fp32_queries_over_a_bf16_cache(kernels, name, options):
    """--kv-cache-dtype bfloat16 on an fp32 model: the kernel reads bf16 K/V for fp32 query
    rows and writes fp32 out, computing as the reference does on the same (widened) K/V."""
    query, k_cache, v_cache, bt, seq_lens, qsl = make_case(21, CASES[name], head_dim=64)
    case = (query, k_cache.bfloat16(), v_cache.bfloat16(), bt, seq_lens, qsl)
    out, ref = _run(kernels, case, 0.125, **options)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **FP32)


def test_the_torch_backend_widens_a_bf16_cache_for_fp32_queries():
    """The long prefill chunks (and the torch backend's decodes) gather the bf16 blocks and
    compute in the query's dtype."""
    query, k_cache, v_cache, bt, seq_lens, qsl = make_case(22, CASES["mixed"], head_dim=64)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    ref = paged_attention_reference(query, k_cache, v_cache, bt, seq_lens, qsl, 0.125)
    out = torch_attention.paged_attention(query, k_cache, v_cache, bt, seq_lens, qsl, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **FP32)


def test_fp16_models_get_the_torch_backend(kernels):
    assert get_attention_backend("auto", "cpu", torch.float16).name == "torch"
    assert get_attention_backend("auto", "cpu", torch.bfloat16).name == "cpu"
    with pytest.raises(ValueError, match="fp32 or bf16"):
        get_attention_backend("cpu", "cpu", torch.float16)
    case = make_case(6, CASES["decode_only"], dtype=torch.float16)
    with pytest.raises(ValueError, match="torch backend"):
        _run(kernels, case, 0.15)


def test_plan_is_reusable_across_layers_and_thread_counts(kernels):
    """5 requests: with 1 thread one work item per request, with 3 one per (request, kv head)."""
    query, k_cache, v_cache, bt, seq_lens, qsl = make_case(11, CASES["decode_only"], num_kv_heads=4)
    plan = cpu_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1])
    assert cpu_attention.work_splits(5, 4, 1) == 1 and cpu_attention.work_splits(5, 4, 3) == 4
    threads = torch.get_num_threads()
    try:
        for layer_seed, num_threads in enumerate([1, 3, 2]):
            torch.set_num_threads(num_threads)
            g = torch.Generator().manual_seed(100 + layer_seed)
            k2, v2 = torch.randn(k_cache.shape, generator=g), torch.randn(v_cache.shape, generator=g)
            ref = paged_attention_reference(query, k2, v2, bt, seq_lens, qsl, 0.1)
            out = torch.full_like(query, float("nan"))
            cpu_attention.paged_attention(kernels, query, k2, v2, bt, seq_lens, qsl, 0.1, plan=plan, out=out)
            torch.testing.assert_close(out, ref, **FP32)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["decode_only", "threshold", "many_decodes"])
@pytest.mark.parametrize("window", [None, 24])
def test_a_plan_from_the_host_layout_is_the_plan_from_the_tensors(kernels, name, window):
    """The persistent batch hands the plan the lengths it already holds
    (kernels/host_layout.py): the same plan (a decode-only step's short requests are every
    request: no index list, NULL for the kernel), the same output."""
    query, k_cache, v_cache, bt, seq_lens, qsl = make_case(5, CASES[name], block_size=16)
    host = HostLayout(seq_lens.numpy().astype(np.int32), qsl.numpy().astype(np.int32), int(seq_lens.max()))
    from_tensors = cpu_attention.plan_attention(bt, seq_lens, qsl, 16, window)
    from_host = cpu_attention.plan_attention(bt, seq_lens, qsl, 16, window, host=host)
    decode_only = name != "threshold"
    assert (from_host.short_reqs is None) == (from_tensors.short_reqs is None) == decode_only
    for field in ("num_short", "max_q_len", "max_scores", "min_block_id", "max_block_id", "num_rows"):
        assert getattr(from_host, field) == getattr(from_tensors, field), field
    if not decode_only:
        assert from_host.short_reqs.tolist() == from_tensors.short_reqs.tolist()
        assert from_host.long.decode_rows.tolist() == from_tensors.long.decode_rows.tolist()
    ref = paged_attention_reference(query, k_cache, v_cache, bt, seq_lens, qsl, 0.1, sliding_window=window)
    out = torch.full_like(query, float("nan"))
    cpu_attention.paged_attention(kernels, query, k_cache, v_cache, bt, seq_lens, qsl, 0.1,
                                  sliding_window=window, plan=from_host, out=out)
    torch.testing.assert_close(out, ref, **FP32)
    # ids checked as they were written: the plan takes the bound, and the kernel holds it
    # against the cache it reads
    num_blocks = k_cache.shape[0]
    bounded = cpu_attention.plan_attention(bt, seq_lens, qsl, 16, window,
                                           host=dataclasses.replace(host, block_ids_below=num_blocks))
    assert (bounded.min_block_id, bounded.max_block_id) == (0, num_blocks - 1)
    out = torch.full_like(query, float("nan"))
    cpu_attention.paged_attention(kernels, query, k_cache, v_cache, bt, seq_lens, qsl, 0.1,
                                  sliding_window=window, plan=bounded, out=out)
    torch.testing.assert_close(out, ref, **FP32)
    beyond = cpu_attention.plan_attention(bt, seq_lens, qsl, 16, window,
                                          host=dataclasses.replace(host, block_ids_below=num_blocks + 1))
    with pytest.raises(ValueError, match="block tables name blocks"):
        cpu_attention.paged_attention(kernels, query, k_cache, v_cache, bt, seq_lens, qsl, 0.1,
                                      sliding_window=window, plan=beyond)


def test_bad_block_tables_raise_instead_of_reading_out_of_bounds(kernels):
    query, k_cache, v_cache, bt, seq_lens, qsl = make_case(4, CASES["decode_only"])
    for bad_id in (k_cache.shape[0], -1):
        tables = bt.clone()
        tables[2, 0] = bad_id
        with pytest.raises(ValueError, match="block tables name blocks"):
            cpu_attention.paged_attention(kernels, query, k_cache, v_cache, tables, seq_lens, qsl, 0.1)
    narrow = bt[:, :1].contiguous()  # request 3 has 100 tokens: 7 blocks of 16
    with pytest.raises(ValueError, match="needs 7 blocks"):
        cpu_attention.plan_attention(narrow, seq_lens, qsl, k_cache.shape[1])
    plan = cpu_attention.plan_attention(bt, seq_lens, qsl, 32)
    with pytest.raises(ValueError, match="blocks of 32"):
        cpu_attention.paged_attention(kernels, query, k_cache, v_cache, bt, seq_lens, qsl, 0.1, plan=plan)


def test_wrapper_checks_inputs(kernels):
    query, k_cache, v_cache, bt, seq_lens, qsl = make_case(3, CASES["decode_only"], head_dim=64)
    plan = cpu_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1])
    with pytest.raises(ValueError, match="dtypes"):
        kernels.short_attention(query, k_cache.double(), v_cache.double(), plan, 0.1, None, None,
                                torch.empty_like(query))
    with pytest.raises(ValueError, match="does not fit"):
        kernels.short_attention(query[..., :32].contiguous(), k_cache, v_cache, plan, 0.1, None,
                                None, torch.empty_like(query[..., :32]))
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.cat([k_cache, k_cache], -1)[..., :64]  # same shape, not contiguous
        kernels.short_attention(query, strided, strided, plan, 0.1, None, None,
                                torch.empty_like(query))
    for short in (torch.arange(5), torch.arange(4, dtype=torch.int32)):  # int64; one request short
        with pytest.raises(ValueError, match="short_reqs"):
            kernels.short_attention(query, k_cache, v_cache, dataclasses.replace(plan, short_reqs=short),
                                    0.1, None, None, torch.empty_like(query))


def test_library_is_built_once_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))
    first = cpu_attention.compile_library()
    assert first.parent == tmp_path and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_attention.compile_library() == first and first.stat().st_mtime_ns == mtime
    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_attention.compile_library("no-such-cc")


def test_backend_selector_picks_cpu_kernel_on_cpu():
    assert get_attention_backend("auto", "cpu").name == "cpu"
    assert get_attention_backend("cpu", "cpu").name == "cpu"
    with pytest.raises(ValueError, match="runs on the CPU"):
        get_attention_backend("cpu", "meta")


def _variant(tmp_path, edit_header=lambda text: text, edit_source=lambda text: text):
    """Copies of the kernel's declaration and source, edited."""
    header, source = tmp_path / "cpu_attention.h", tmp_path / "cpu_attention.c"
    header.write_text(edit_header(cpu_attention.HEADER.read_text()))
    source.write_text(edit_source(cpu_attention.SOURCE.read_text()))
    return {"header": header, "source": source}


def test_a_kernel_that_disagrees_with_its_declaration_does_not_build(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    prototype = "int paged_attention(const struct paged_attention_args *args);"
    assert prototype in cpu_attention.HEADER.read_text()
    extra_argument = _variant(tmp_path, edit_header=lambda text: text.replace(
        prototype, "int paged_attention(const struct paged_attention_args *args, int64_t extra);"))
    with pytest.raises(RuntimeError, match="conflicting types for .paged_attention"):
        cpu_attention.compile_library(**extra_argument)
    no_splits = _variant(tmp_path, edit_header=lambda text: text.replace("    int64_t splits;", ""))
    with pytest.raises(RuntimeError, match="no member named .splits"):
        cpu_attention.compile_library(**no_splits)
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built is cached


def test_a_python_side_that_disagrees_with_the_struct_fails_at_load(tmp_path, monkeypatch):
    """A kernel built consistently with a field the Python side does not know (and missing
    one it sets) is refused when it is loaded, before any call."""
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    rename = lambda text: text.replace("splits", "num_splits")  # noqa: E731
    library = cpu_attention.compile_library(**_variant(tmp_path, rename, rename))
    with pytest.raises(ValueError, match=r"disagree on \['num_splits', 'splits'\]"):
        cpu_attention.CpuKernels(library)
    # The same fields in another order would fill the struct wrongly: refused too.
    swap = lambda text: text.replace("    float scale;\n", "").replace(  # noqa: E731
        "    int64_t window;", "    int64_t window;\n    float scale;")
    library = cpu_attention.compile_library(**_variant(tmp_path, swap))
    with pytest.raises(ValueError, match="disagree on the order"):
        cpu_attention.CpuKernels(library)


def test_each_field_is_converted_by_its_declared_type(kernels):
    """A value of the wrong type is refused on its way into the struct, never misread."""
    args = cpu_attention.KernelArgs(**dict.fromkeys(cpu_attention.KernelArgs._fields, 0))
    assert kernels._struct(args._replace(num_reqs=3)).num_reqs == 3
    for field, wrong in [("num_reqs", 1.5), ("query", None), ("bf16", "0"), ("splits", 2**70)]:
        with pytest.raises((TypeError, OverflowError)):
            kernels._struct(args._replace(**{field: wrong}))


def test_the_source_ships_with_the_package():
    """pip installs kernels/*.c and *.h beside the module (the Docker image installs the same way)."""
    import tomllib

    pyproject = tomllib.loads((cpu_attention.SOURCE.parent.parent / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["kernels"]
    for path in (cpu_attention.SOURCE, cpu_attention.HEADER):
        assert any(path.match(pattern) for pattern in shipped), path


def test_without_a_compiler_auto_falls_back_to_torch_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CC", "no-such-cc")
    with caplog.at_level("WARNING", logger="pagedserve.kernels"):
        assert get_attention_backend("auto", "cpu").name == "torch"
    assert "falls back to torch" in caplog.text and "no C compiler" in caplog.text
    with pytest.raises(RuntimeError, match="no C compiler"):
        get_attention_backend("cpu", "cpu")
