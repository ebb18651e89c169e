"""How much memory the KV cache gets: a fixed size (--kv-cache-memory), or, on a GPU, a
share of the device (--gpu-memory-utilization, as vLLM's flag): the worker may fill
`utilization` of the GPU's total memory, so the cache gets that share minus what is in
use already once the model is loaded (its weights, and anything else on the GPU). The
rest, `1 - utilization`, stays free for the forward pass's activations and other tenants."""

from __future__ import annotations

import torch


def kv_bytes_for_utilization(free_bytes: int, total_bytes: int, utilization: float) -> int:
    """The KV cache's share of a device with `free_bytes` of `total_bytes` free."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization {utilization}: expected a fraction in (0, 1]")
    in_use = total_bytes - free_bytes
    budget = int(total_bytes * utilization) - in_use
    if budget <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: {in_use / 2**30:.2f} GiB of the GPU's "
            f"{total_bytes / 2**30:.2f} GiB are in use already (the model and other processes), "
            f"more than the {utilization:.0%} allowed: raise it, or free the GPU")
    return budget


def kv_cache_bytes(device: torch.device, fixed_bytes: int, utilization: float | None) -> int:
    """`fixed_bytes` unless a utilization is given; that needs a CUDA device."""
    if utilization is None:
        return fixed_bytes
    if device.type != "cuda":
        raise ValueError(f"--gpu-memory-utilization needs a CUDA device, not {device}: "
                         "size a CPU worker's cache with --kv-cache-memory")
    free, total = torch.cuda.mem_get_info(device)
    return kv_bytes_for_utilization(free, total, utilization)
