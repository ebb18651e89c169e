"""Pick the attention backend a worker runs: the functions that touch the paged KV cache.

Every backend offers the same four calls (signatures as in kernels/torch_attention.py):
`plan(block_tables, seq_lens, query_start_loc, block_size, sliding_window, workspace)` once
per step, `paged_attention(..., plan=plan)` and `write_kv(...)` per layer, `copy_blocks(...)`
for copy-on-write; `new_workspace()` makes the scratch memory a worker keeps for its life.
Today only the torch backend exists; Triton kernels come later.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import torch_attention


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    plan: Callable
    paged_attention: Callable
    write_kv: Callable
    copy_blocks: Callable
    new_workspace: Callable


TORCH_BACKEND = AttentionBackend(
    name="torch",
    plan=torch_attention.plan_attention,
    paged_attention=torch_attention.paged_attention,
    write_kv=torch_attention.write_kv,
    copy_blocks=torch_attention.copy_blocks,
    new_workspace=torch_attention.Workspace,
)


def get_attention_backend(name: str = "auto", device: str | torch.device = "cpu") -> AttentionBackend:
    """"auto" and "torch" give the torch backend on any device; "triton" is not built yet."""
    torch.device(device)  # validates the device string early, with torch's own message
    if name in ("auto", "torch"):
        return TORCH_BACKEND
    if name == "triton":
        raise NotImplementedError(
            "the triton attention backend does not exist yet; use attention_backend='torch' "
            "(or 'auto')")
    raise ValueError(f"unknown attention backend {name!r}; choose 'auto', 'torch' or 'triton'")
