"""Whether a model's weights fit on its device, asked before they are made: a checkpoint
too large for the device is refused at start with the numbers, not with an out-of-memory
error halfway through its load (or the host's OOM killer)."""

from __future__ import annotations

import torch
from torch import nn


def weights_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """The bytes of `module`'s parameters (each once, however often tied) in `dtype`."""
    return sum(p.numel() for p in module.parameters()) * torch.empty((), dtype=dtype).element_size()


def free_bytes(device: torch.device) -> int | None:
    """What `device` has free: a GPU's free memory; for the CPU the host's MemAvailable
    (Linux); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return None


def check_fits(module: nn.Module, dtype: torch.dtype, device: torch.device | str, what: str,
               free: int | None = None) -> None:
    """MemoryError, with the numbers, when `module`'s weights in `dtype` need more than
    `device` has free (`free`: that amount, read from the device when None)."""
    device = torch.device(device)
    need = weights_bytes(module, dtype)
    free = free_bytes(device) if free is None else free
    if free is not None and need > free:
        raise MemoryError(f"{what}'s weights need {need / 2**30:.2f} GiB in {str(dtype).removeprefix('torch.')} "
                          f"on {device}, which has {free / 2**30:.2f} GiB free: choose a smaller --dtype, a "
                          f"device with more memory, or free some")
