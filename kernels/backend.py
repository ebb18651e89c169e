"""Pick the attention backend a worker runs: the functions that touch the paged KV cache.

Every backend offers the same four calls (signatures as in kernels/torch_attention.py):
`plan(block_tables, seq_lens, query_start_loc, block_size, sliding_window, workspace, *,
bidir_spans=None, host=None)` once per step and window (`host`: the lengths as the host
already holds them, kernels/host_layout.py), `paged_attention(..., plan=plan)` and
`write_kv(...)` per layer, `copy_blocks(...)` for copy-on-write; `new_workspace()` makes the
scratch memory a worker keeps for its life. `bidir_spans` (int32 [num_tokens, 2] on the
query's device: each row's bidirectional block [s, e), [0, 0] for none; Gemma 3's images,
the rule in kernels/reference.py) travels in the plan; None is the plain causal contract,
at its cost.

Beside them, `layer_ops`: the decoder layer's fused elementwise calls (norms with the
residual add, RoPE with the cache write, the gated activation; kernels/torch_layer_ops.py
says what each computes): the torch module on the torch and cpu backends, its Triton twin
(kernels/triton_layer_ops.py, one launch each) on the triton backend. And
`exponential_race`, the sampler's noise and argmax in one pass (kernels/cpu_sampling.py on
the cpu backend, kernels/triton_sampling.py on the triton backend; None on torch: the
sampler's own torch ops).

"torch" (kernels/torch_attention.py) runs anywhere. "cpu" (kernels/cpu_attention.py) is
torch plus a C kernel for decode rows (and the C race), compiled on first use with the
machine's C compiler.
"triton" (kernels/triton_attention.py,
kernels/triton_cache.py) runs on CUDA devices, or on the CPU in Triton's interpreter when
TRITON_INTERPRET=1 was set before the kernels were imported (tests only: it is slow).
"auto" is triton on CUDA, cpu on the CPU (torch, with a warning, when no C compiler can
build the kernel). The Triton modules are imported only when
asked for, so a machine without triton still serves with torch.
"""

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels import cpu_attention, cpu_sampling, torch_attention, torch_layer_ops

log = logging.getLogger("pagedserve.kernels")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    plan: Callable
    paged_attention: Callable
    write_kv: Callable
    copy_blocks: Callable
    new_workspace: Callable
    layer_ops: ModuleType = torch_layer_ops
    # the sampler's noise race (worker_svc/sampler.py's `exponential_race` contract): a
    # fused kernel, or None for the sampler's own torch version
    exponential_race: Callable | None = None


TORCH_BACKEND = AttentionBackend(
    name="torch",
    plan=torch_attention.plan_attention,
    paged_attention=torch_attention.paged_attention,
    write_kv=torch_attention.write_kv,
    copy_blocks=torch_attention.copy_blocks,
    new_workspace=torch_attention.GatherWorkspace,
)


def cpu_backend() -> AttentionBackend:
    """The torch backend with decode rows and the sampler's race in C; RuntimeError when
    the kernels cannot be compiled or loaded here."""
    try:
        kernels, race = cpu_attention.CpuKernels(), cpu_sampling.CpuRace()
    except (OSError, ImportError, ValueError) as exc:  # a module could not be loaded
        raise RuntimeError(f"loading the cpu kernels failed: {exc}") from exc
    return AttentionBackend(
        name="cpu",
        plan=cpu_attention.plan_attention,
        paged_attention=functools.partial(cpu_attention.paged_attention, kernels),
        write_kv=torch_attention.write_kv,
        copy_blocks=torch_attention.copy_blocks,
        new_workspace=torch_attention.GatherWorkspace,
        exponential_race=race,
    )


def triton_backend(device: torch.device) -> AttentionBackend:
    """The Triton backend for `device`; ImportError when triton is missing or too old,
    ValueError when the kernels cannot run on that device."""
    from kernels import triton_attention, triton_cache, triton_layer_ops, triton_sampling  # imports triton

    if device.type == "cuda" and triton_attention.INTERPRETED:
        raise ValueError("the Triton kernels were imported with TRITON_INTERPRET=1 and would "
                         "run in the CPU interpreter; unset it to run them on CUDA")
    if device.type == "cpu" and not triton_attention.INTERPRETED:
        raise ValueError("the triton backend runs on CUDA devices; on the CPU only in Triton's "
                         "interpreter (set TRITON_INTERPRET=1 before importing the kernels, "
                         "tests only); use attention_backend='torch' or 'auto'")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"the triton backend runs on CUDA devices, not {device.type!r}")
    return AttentionBackend(
        name="triton",
        plan=triton_attention.plan_attention,
        paged_attention=triton_attention.paged_attention,
        write_kv=triton_cache.write_kv,
        copy_blocks=triton_cache.copy_blocks,
        new_workspace=triton_attention.TritonWorkspace,
        layer_ops=triton_layer_ops,
        exponential_race=triton_sampling.exponential_race,
    )


def get_attention_backend(name: str = "auto", device: str | torch.device = "cpu",
                          dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """"torch": the torch backend; "cpu": torch plus the C decode kernel (CPU devices,
    fp32/bf16 models); "triton": the Triton kernels (errors say why they cannot run here);
    "auto": triton on CUDA, cpu on the CPU (torch for fp16 models), each falling back to
    torch with a warning when it cannot run."""
    device = torch.device(device)  # validates the device string early, with torch's own message
    if name == "torch":
        return TORCH_BACKEND
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the cpu backend runs on the CPU, not {device.type!r}")
        if not cpu_attention.CpuKernels.supports(dtype):
            raise ValueError(f"the cpu backend's kernel takes fp32 or bf16, not {dtype}; use torch")
        return cpu_backend()
    if name == "auto" and device.type == "cpu" and not cpu_attention.CpuKernels.supports(dtype):
        return TORCH_BACKEND
    if name == "triton":
        return triton_backend(device)
    if name == "auto":
        try:
            return triton_backend(device) if device.type == "cuda" else cpu_backend()
        except (ImportError, ValueError, RuntimeError) as exc:
            log.warning("attention backend 'auto' on %s falls back to torch: %s", device, exc)
            return TORCH_BACKEND
    raise ValueError(f"unknown attention backend {name!r}; choose 'auto', 'torch', 'cpu' or 'triton'")
