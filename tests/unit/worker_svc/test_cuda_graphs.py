"""CUDA graphs for decode steps (worker_svc/cuda_graphs.py) against eager steps, on CUDA
(`gpu` marker: skipped without CUDA; `make gpu-check` runs them on a lent GPU).

Per family, in fp32: the same requests -- continuous batching with chunked prefill,
prompts and generations crossing the tiny presets' 48-token sliding windows (KV cache
groups of their own for Qwen2, Mistral and Gemma 3), more running requests than the
largest graph holds (those steps run eagerly) -- give the same tokens with graphs as with
--enforce-eager, greedy and seeded sampling alike, and the graphs were replayed. Images
through graphs: tests/gpu/test_gemma3_vision_cuda.py.

Without CUDA, the same path with the capture replaced: `CpuReplay` keeps DecodeGraphs'
sizes and buffers and runs the layers eagerly on the graph buffers at their fixed
addresses, as a replayed graph reads them (the device's copy apart from the host's, as on
a GPU), so the runner's choice of steps, the padding and the slicing of the outputs are
checked against eager steps on every CPU run; and the capture sizes, and that a CPU runner
captures nothing.
"""

import pytest
import torch
from tests.support.runner_helpers import MiniScheduler, make_runner, prompts

from modeling.attention_metadata import AttentionMetadata, GroupAttention
from worker_svc.config import RunnerConfig
from worker_svc.cuda_graphs import DecodeGraphs, capture_sizes, decode_graph_sizes
from worker_svc.input_batch import InputBatch

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
LARGEST = 8  # the largest captured batch here: the 12-request case runs some steps eagerly


def generate(model_dir, enforce_eager: bool, lengths: list[int], max_tokens: list[int], **sampling):
    runner = make_runner(model_dir, block_size=16, num_blocks=160, device="cuda", dtype="float32",
                         enforce_eager=enforce_eager, max_cudagraph_capture_size=LARGEST)
    sched = MiniScheduler(runner, block_size=16, num_blocks=160, token_budget=40)
    for i, (p, n) in enumerate(zip(prompts(len(lengths), lengths), max_tokens)):
        sched.add(f"r{i}", p, n, **(dict(sampling, seed=sampling["seed"] + i) if "seed" in sampling else sampling))
    sched.run(max_steps=400)
    return [sched.outputs(f"r{i}") for i in range(len(lengths))], runner


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("arch", FAMILIES)
def test_graph_replay_equals_eager(family_model_dir, arch):
    lengths, max_tokens = [7, 70, 3, 33, 52, 5, 9, 40, 2, 61, 17, 8], [30, 20, 40, 12, 25, 50, 6, 33, 45, 9, 27, 44]
    graphs, runner = generate(family_model_dir(arch), False, lengths, max_tokens)
    assert runner.graphs is not None and runner.graphs.replays > 0, arch
    eager, runner = generate(family_model_dir(arch), True, lengths, max_tokens)
    assert runner.graphs is None
    assert graphs == eager, arch


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_seeded_sampling_through_graphs_equals_eager(family_model_dir, arch):
    lengths, max_tokens = [12, 30, 5, 21], [40, 25, 33, 18]
    sampling = dict(temperature=0.8, top_p=0.9, top_k=50, seed=7)
    graphs, runner = generate(family_model_dir(arch), False, lengths, max_tokens, **sampling)
    assert runner.graphs.replays > 0
    eager, _ = generate(family_model_dir(arch), True, lengths, max_tokens, **sampling)
    assert graphs == eager


class CpuReplay(DecodeGraphs):
    """DecodeGraphs with each graph's launches run eagerly on the CPU, on the graph buffers
    the capture laid out (the attention plan, which the Triton kernels do not need, made at
    replay from what the buffers hold)."""

    def capture(self, device):
        self._views = {size: self.inputs.prepare([], self.plan_fn, self.windows, pad_to=size)
                       for size in self.sizes}

    def replay(self, size):
        batch, block_size = self._views[size], self.inputs.block_size
        attn = batch.attn
        groups = tuple(GroupAttention(g.slot_mapping, g.block_tables,
                                      self.plan_fn(g.block_tables, attn.seq_lens, attn.query_start_loc, block_size,
                                                   window))
                       for g, window in zip(attn.groups, self.windows))
        self.replays += 1
        return self.model.hidden_states(batch.input_ids, batch.positions,
                                        AttentionMetadata(groups, attn.seq_lens, attn.query_start_loc),
                                        self.kv_caches)


def cpu_generate(model_dir, replayed: bool, lengths: list[int], max_tokens: list[int]):
    runner = make_runner(model_dir, block_size=4, num_blocks=256)
    if replayed:
        runner.inputs = InputBatch(runner.kv_layout.num_groups, 4, runner.inputs.width,
                                   runner.model_config.vocab_size, runner.device, graph_capacity=LARGEST,
                                   separate_device_memory=True)
        runner.graphs = CpuReplay(runner.model, runner.inputs, (runner.kv_cache.k_caches, runner.kv_cache.v_caches),
                                  runner.plan_attention, runner.kv_layout.windows, capture_sizes(LARGEST))
        runner.graphs.capture(runner.device)
    sched = MiniScheduler(runner, block_size=4, num_blocks=256, token_budget=40)
    for i, (p, n) in enumerate(zip(prompts(len(lengths), lengths), max_tokens)):
        sched.add(f"r{i}", p, n)
    sched.run(max_steps=400)
    return [sched.outputs(f"r{i}") for i in range(len(lengths))], runner


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_padded_decode_steps_on_graph_buffers_equal_eager_on_the_cpu(family_model_dir, arch):
    lengths, max_tokens = [7, 70, 3, 33, 52, 5, 9, 40, 2, 61, 17, 8], [30, 20, 40, 12, 25, 50, 6, 33, 45, 9, 27, 44]
    replayed, runner = cpu_generate(family_model_dir(arch), True, lengths, max_tokens)
    assert runner.graphs.replays > 20
    eager, _ = cpu_generate(family_model_dir(arch), False, lengths, max_tokens)
    assert replayed == eager


def test_capture_sizes_are_vllms():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4] + list(range(8, 65, 8))
    assert capture_sizes(300) == [1, 2, 4] + list(range(8, 257, 8)) + [272, 288, 300]


def test_graphs_only_on_cuda_with_triton_and_not_eager():
    config = RunnerConfig(model="m")
    assert decode_graph_sizes(config, torch.device("cpu"), "cpu") == []
    assert decode_graph_sizes(config, torch.device("cuda"), "torch") == []
    assert decode_graph_sizes(RunnerConfig(model="m", enforce_eager=True), torch.device("cuda"), "triton") == []
    assert decode_graph_sizes(RunnerConfig(model="m", max_cudagraph_capture_size=16), torch.device("cuda"),
                              "triton") == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="enforce-eager"):
        decode_graph_sizes(RunnerConfig(model="m", max_cudagraph_capture_size=0), torch.device("cuda"), "triton")


def test_a_cpu_runner_captures_nothing(family_model_dir):
    runner = make_runner(family_model_dir("llama"), block_size=16, num_blocks=16)
    assert runner.graphs is None
