"""What one model step launches, for bench/compute/roofline.py's --count-kernels: the CUDA kernels
(torch.profiler, with their device time summed: the step's busy time) on a GPU; on the CPU
the aten operators that did work (views, reshapes and allocations left out), counted
with a TorchDispatchMode."""

from __future__ import annotations

from collections.abc import Callable

import torch


def count_kernels(device: torch.device, step: Callable[[], object]) -> dict:
    """What one step launches: CUDA kernels from torch.profiler on a GPU; on the CPU, the
    aten operators that did work (views, reshapes and allocations left out)."""
    from torch.profiler import ProfilerActivity, profile

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize(device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.lower().startswith(("memcpy", "memset"))]
        # the device's busy time: what the step would take if the host never made it wait
        return {"kind": "CUDA kernels", "count": len(kernels),
                "busy_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3}
    return {"kind": "aten operators doing work", "count": _count_ops(step)}


def _count_ops(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    free = ("view", "_unsafe_view", "as_strided", "t", "transpose", "expand", "split", "split_with_sizes",
            "slice", "select", "unsqueeze", "squeeze", "detach", "alias", "empty", "empty_like",
            "empty_strided", "reshape", "permute", "unbind", "chunk", "narrow", "_reshape_alias",
            "lift_fresh")

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] not in free:
                self.count += 1
            return func(*args, **(kwargs or {}))

    with Count() as counter:
        fn()
    return counter.count
