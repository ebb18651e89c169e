"""What a decode step's CUDA graph captures -- `model.hidden_states` on the persistent
batch's graph buffers, with the CUDA path's kernels (the triton backend: paged attention and
the fused layer ops) -- can be captured: proven on the CPU, where no graph can be, with the
Triton kernels in Triton's interpreter (this file reruns itself in a subprocess with
TRITON_INTERPRET=1, as tests/unit/kernels/test_triton_kernels.py does).

Every aten operator the step runs is recorded. A CUDA graph replays a fixed list of
launches on fixed addresses, so the step must
- never read a tensor's value on the host (`.item()`, `.tolist()`, `bool(t)`, nonzero...:
  a host sync, forbidden while capturing);
- run the same operators on tensors of the same shapes whatever the step holds: two decode
  steps padded to the same size, with other contexts, block tables, tokens and padding,
  record the same list (no data-dependent shape, no branch on values);
and it does, for a family with one KV cache group (Llama) and one with sliding layers in
groups of their own, q/k norms, Gemma's norms and a soft cap (Gemma 3). The GPU run of the
same path against eager steps: tests/unit/worker_svc/test_cuda_graphs.py.
"""

import random

import pytest
import torch
from tests.support.runner_helpers import make_runner, runner_state

from proto import worker_pb2
from tests.support.triton_cases import INTERPRETER, run_in_interpreter

# Operators that read values on the host, or whose output shape depends on values.
HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "unique",
              "_unique2", "repeat_interleave", "tolist"}


def record(fn) -> list[tuple[str, tuple]]:
    """(operator, shapes of its tensor arguments) of every aten call `fn` makes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list[tuple[str, tuple]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            self.calls.append((func.__name__, shapes))
            return func(*args, **(kwargs or {}))

    with Record() as rec:
        fn()
    return rec.calls


def decode_step(runner, states, size: int, seed: int):
    """The graph region of a decode step of `states` padded to `size`, after moving each
    request to a random point of its prompt (other contexts, other tokens)."""
    rnd = random.Random(seed)
    for state in states:
        state.num_computed_tokens = rnd.randrange(len(state.token_ids) - 1)
        del state.token_ids[state.num_computed_tokens + 1:]
    batch = runner.inputs.prepare([(s, 1) for s in states], runner.plan_attention, runner.kv_layout.windows,
                                  pad_to=size)
    kv = (runner.kv_cache.k_caches, runner.kv_cache.v_caches)
    with torch.inference_mode():
        return record(lambda: runner.model.hidden_states(batch.input_ids, batch.positions, batch.attn, kv))


@pytest.mark.skipif(not INTERPRETER, reason="runs in Triton's interpreter (test_in_triton_interpreter)")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decode_step_reads_nothing_on_the_host_and_has_fixed_shapes(family_model_dir, arch):
    runner = make_runner(family_model_dir(arch), block_size=4, num_blocks=64, attention_backend="triton")
    assert runner.backend.name == "triton"
    runner.inputs = type(runner.inputs)(runner.kv_layout.num_groups, 4, runner.inputs.width,
                                        runner.model_config.vocab_size, runner.device, graph_capacity=8)
    rnd = random.Random(0)
    groups = runner.kv_layout.num_groups
    states = []
    for i in range(5):  # tables of 20 blocks: contexts up to 80 tokens, past the 48-token windows
        ids = [rnd.randrange(3, 1000) for _ in range(rnd.randrange(20, 80))]
        blocks = rnd.sample(range(64 * groups), 20 * groups)  # distinct blocks in each group
        states.append(runner_state(runner, worker_pb2.NewRequestData(
            request_id=f"r{i}", token_ids=ids, num_prompt_tokens=len(ids), block_ids=blocks)))
    first = decode_step(runner, states, 8, seed=1)
    names = {name.split(".")[0] for name, _ in first}
    assert not names & HOST_READS, names & HOST_READS
    assert decode_step(runner, states[:3], 8, seed=2) == first  # fewer requests, same padded size
    assert decode_step(runner, states, 8, seed=3) == first


def test_in_triton_interpreter():
    """The cases above, on the CPU, in a subprocess with TRITON_INTERPRET=1."""
    if INTERPRETER:
        pytest.skip("already in the interpreter")
    run_in_interpreter(__file__)
