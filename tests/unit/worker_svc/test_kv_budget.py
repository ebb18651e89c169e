"""--gpu-memory-utilization: the KV cache gets the GPU's allowed share minus what is in use."""

import pytest
import torch

from compose.cli import build_parser
from compose.commands import _runner_config
from worker_svc.config import RunnerConfig
from worker_svc.kv_budget import kv_bytes_for_utilization, kv_cache_bytes
from worker_svc.model_runner import ModelRunner

GIB = 2**30


def test_the_share_minus_what_is_in_use():
    # 80 GiB device, 10 GiB in use (weights, other processes): 90% allows 72 GiB, 62 for KV
    assert kv_bytes_for_utilization(70 * GIB, 80 * GIB, 0.9) == 62 * GIB
    assert kv_bytes_for_utilization(80 * GIB, 80 * GIB, 1.0) == 80 * GIB


@pytest.mark.parametrize("utilization", [0.0, -0.5, 1.5])
def test_a_fraction_or_a_clear_error(utilization):
    with pytest.raises(ValueError, match="expected a fraction"):
        kv_bytes_for_utilization(GIB, 2 * GIB, utilization)


def test_too_little_left_is_a_clear_error():
    with pytest.raises(ValueError, match="in use already"):
        kv_bytes_for_utilization(10 * GIB, 80 * GIB, 0.5)  # 70 GiB in use, 40 allowed


def test_fixed_size_unless_asked_and_cuda_only():
    assert kv_cache_bytes(torch.device("cpu"), 123, None) == 123
    with pytest.raises(ValueError, match="needs a CUDA device"):
        kv_cache_bytes(torch.device("cpu"), 123, 0.9)


def test_the_flag_reaches_the_runner_config():
    args = build_parser().parse_args(["worker", "--model", "m", "--gpu-memory-utilization", "0.85"])
    assert _runner_config(args).gpu_memory_utilization == 0.85
    assert _runner_config(build_parser().parse_args(["worker", "--model", "m"])).gpu_memory_utilization is None


def test_a_cpu_worker_refuses_it(tiny_model_dir):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ModelRunner(RunnerConfig(model=str(tiny_model_dir), gpu_memory_utilization=0.5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_worker_fills_its_share(tiny_model_dir):
    free, total = torch.cuda.mem_get_info()
    utilization = (total - free) / total + 0.05  # 5% of the device for the cache, about
    runner = ModelRunner(RunnerConfig(model=str(tiny_model_dir), device="cuda", gpu_memory_utilization=utilization))
    cache = runner.kv_cache.nbytes
    assert 0.03 * total < cache <= 0.05 * total + 2**20, (cache, total)
    free_after, _ = torch.cuda.mem_get_info()
    assert free_after >= total * (1 - utilization) - 64 * 2**20  # what it left free stays free
