"""The sampler's fused races against their torch reference (worker_svc/sampler.py's
`exponential_race`), draw for draw: the C kernel (kernels/cpu_sampling.py) here; the Triton
kernel (kernels/triton_sampling.py) in Triton's interpreter on the CPU (a subprocess with
TRITON_INTERPRET=1, `test_cases_in_triton_interpreter`) and compiled on CUDA under the
`gpu` marker (Gemma 3's 262k vocabulary at batch 256, and inside a CUDA graph)."""

import os

import pytest
import torch

from kernels.cpu_sampling import CpuRace
from proto import worker_pb2
from worker_svc.sampler import SamplingBatch, exponential_race, sample

I64 = 2**63
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")
ON_CUDA = torch.cuda.is_available() and not INTERPRETER
BLOCK = 2048  # kernels/triton_sampling.BLOCK (checked below): tiles the cases cross


def _triton():
    return pytest.importorskip("kernels.triton_sampling")


@pytest.fixture(scope="module")
def cpu_race() -> CpuRace:
    return CpuRace()


IMPLS = [pytest.param("c", id="c")] + (
    [pytest.param("triton", id="triton-interp")] if INTERPRETER else []) + [
    pytest.param("triton-cuda", id="triton-cuda", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not ON_CUDA, reason="needs CUDA (and TRITON_INTERPRET unset)")])]


@pytest.fixture(params=IMPLS)
def impl(request, cpu_race):
    """(the race, its device)."""
    if request.param == "c":
        return cpu_race, "cpu"
    race = _triton().exponential_race
    assert _triton().BLOCK == BLOCK
    return race, "cpu" if request.param == "triton" else "cuda"


def _batch(rows: int, vocab: int, device: str, seed: int, scale: float = 3.0):
    gen = torch.Generator().manual_seed(seed)
    probs = (scale * torch.randn(rows, vocab, generator=gen)).softmax(dim=-1)
    seeds = torch.randint(-I64, I64 - 1, (rows,), dtype=torch.int64, generator=gen)
    seeds[0] = -I64  # the extremes of the int64 patterns
    if rows > 1:
        seeds[1] = I64 - 1
    return probs.to(device), seeds.to(device)


def _shapes(device: str):
    if device == "cuda":
        return [(1, 32000), (64, 128256), (256, 262208), (7, 151936)]
    return [(1, 1), (3, 7), (4, BLOCK), (5, BLOCK + 1), (9, 3 * BLOCK - 5), (64, 1536)]


def test_draws_what_the_torch_race_draws(impl):
    race, device = impl
    for i, (rows, vocab) in enumerate(_shapes(device)):
        for scale in (0.1, 3.0, 30.0):  # flat, as sampled logits are, and peaked
            probs, seeds = _batch(rows, vocab, device, seed=i, scale=scale)
            got = race(probs, seeds)
            assert got.dtype == torch.int64 and got.shape == (rows,) and got.device == probs.device
            assert torch.equal(got, exponential_race(probs, seeds)), (rows, vocab, scale)


def test_larger_vocabularies_on_the_cpu(cpu_race):
    """The C kernel at real vocabularies (Llama 3's, Qwen's), one thread and several."""
    for i, (rows, vocab) in enumerate([(32, 32000), (8, 151936)]):
        probs, seeds = _batch(rows, vocab, "cpu", seed=20 + i)
        want = exponential_race(probs, seeds)
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                assert torch.equal(cpu_race(probs, seeds), want), (rows, vocab, n)
        finally:
            torch.set_num_threads(threads)


def test_rows_with_a_stride_and_a_strided_seed_vector(impl):
    race, device = impl
    rows, vocab = _shapes(device)[-1]
    probs, seeds = _batch(rows, vocab + 3, device, seed=11)
    view = probs[:, 3:]  # rows vocab long, vocab + 3 apart
    twice = torch.stack([seeds, seeds], dim=1)[:, 0]  # stride 2
    assert torch.equal(race(view, twice), exponential_race(view.contiguous(), seeds))


def test_nan_is_the_largest_and_ties_take_the_first(impl):
    race, device = impl
    vocab = 2 * BLOCK + 100
    probs = torch.zeros(5, vocab, device=device)  # all zero: every x ties at 0 -> index 0
    probs[1, [5, vocab - 1]] = float("nan")  # the first NaN
    probs[2, [BLOCK + 3, 2 * BLOCK + 7]] = float("nan")  # in later tiles
    probs[3] = float("nan")
    probs[4, [7, 9]] = 1.0  # the rest zero: one of the two, as the noise says
    seeds = torch.arange(5, dtype=torch.int64, device=device)
    want = exponential_race(probs, seeds)
    assert want.tolist()[:4] == [0, 5, BLOCK + 3, 0] and want[4] in (7, 9)
    assert torch.equal(race(probs, seeds), want)


def test_rows_of_tiny_values_below_the_normal_range(impl):
    """Rows of subnormal values (where the C kernel's bound, made for normal floats, is
    not used: it skips nothing while its best is below 2**-100) draw what the torch race
    draws."""
    race, device = impl
    for i, scale in enumerate((2.0 ** -126, 2.0 ** -135, 2.0 ** -140, 2.0 ** -149)):
        probs, seeds = _batch(16, 700, "cpu", seed=40 + i)
        probs, seeds = (probs * scale).to(device), seeds.to(device)
        assert torch.equal(race(probs, seeds), exponential_race(probs, seeds)), scale


def test_sample_takes_the_kernel_as_its_race(impl):
    race, device = impl
    rows, vocab = _shapes(device)[-1]
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab, generator=gen).to(device)
    batch = SamplingBatch.build([worker_pb2.SamplingParams(temperature=0.8 if i % 3 else 0.0, top_k=50)
                                 for i in range(rows)],
                                [i * 7 if i % 2 else None for i in range(rows)], vocab, device)
    a = sample(logits, batch, torch.Generator(device).manual_seed(1), race=race)
    b = sample(logits, batch, torch.Generator(device).manual_seed(1))
    assert torch.equal(a, b)


def test_bad_inputs_are_refused(impl):
    race, _ = impl
    probs = torch.rand(2, 10)
    seeds = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="fp32"):
        race(probs.double(), seeds)
    with pytest.raises(ValueError, match="contiguous rows"):
        race(probs.t(), seeds)
    with pytest.raises(ValueError, match="int64"):
        race(probs, seeds.int())
    with pytest.raises(ValueError, match=r"int64 \[2\]"):
        race(probs, seeds[:1])
    assert race(torch.rand(0, 10), torch.zeros(0, dtype=torch.int64)).shape == (0,)


def test_the_cpu_backend_samples_with_the_c_race():
    from kernels.backend import get_attention_backend
    assert isinstance(get_attention_backend("cpu").exponential_race, CpuRace)
    assert get_attention_backend("torch").exponential_race is None


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA (and TRITON_INTERPRET unset)")
def test_race_inside_a_cuda_graph():
    race = _triton().exponential_race
    probs, seeds = _batch(256, 262208, "cuda", seed=3)
    static_p, static_s = probs.clone(), seeds.clone()
    race(static_p, static_s)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = race(static_p, static_s)
    fresh_p, fresh_s = _batch(256, 262208, "cuda", seed=4)
    static_p.copy_(fresh_p)
    static_s.copy_(fresh_s)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, exponential_race(fresh_p, fresh_s))


@pytest.mark.skipif(INTERPRETER, reason="this process is the interpreter run")
def test_cases_in_triton_interpreter():
    """Every non-gpu case above, the Triton kernel on the CPU, in a subprocess with
    TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    from tests.support.triton_cases import run_in_interpreter
    run_in_interpreter(__file__)
