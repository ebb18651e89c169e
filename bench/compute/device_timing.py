"""Timing on the device for the GPU benches (bench/compute/kernels.py, bench/compute/vision_tower.py): the
median of CUDA-event intervals, the L2 cache emptied before each (wall clock on the CPU,
where the benches only smoke-test themselves), and the two roofs measured with it.

`kernel_time` times a CUDA graph of the call instead, where it can be captured: the
device's time alone, without the gaps while the host launches each kernel (a decode step
replays a graph in the worker; in an eager prefill step the host runs ahead of the
device's matmuls). A call that cannot be captured is timed as it is, and says so."""

from __future__ import annotations

import statistics
import time

import torch


def device_time(fn, iters: int, flush: torch.Tensor) -> float:
    """Median seconds of `fn()` over `iters` runs, L2 emptied before each (CUDA events;
    wall clock on the CPU, where this only smoke-tests the script)."""
    fn()  # warm-up (and Triton compile)
    times = []
    for _ in range(iters):
        flush.zero_()
        if flush.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(flush: torch.Tensor, iters: int, numel: int) -> float:
    """Bytes/s of a device-to-device copy (2 GiB on a GPU), counting the read and the write."""
    src = torch.empty(numel, dtype=torch.int16, device=flush.device).random_()
    dst = torch.empty_like(src)
    seconds = device_time(lambda: dst.copy_(src), iters, flush)
    return 2 * src.numel() * src.element_size() / seconds


def matmul_rate(dtype: torch.dtype, flush: torch.Tensor, iters: int, n: int) -> float:
    a = torch.randn(n, n, device=flush.device, dtype=dtype)
    b = torch.randn(n, n, device=flush.device, dtype=dtype)
    return 2 * n**3 / device_time(lambda: a @ b, iters, flush)


def kernel_time(fn, iters: int, flush: torch.Tensor, graphs: bool = True, label: str = "") -> float:
    """device_time of a CUDA graph replaying `fn` (captured after a warm-up on a side stream),
    or of `fn` itself off CUDA, with graphs=False, or when capture fails (printed)."""
    if not (graphs and flush.is_cuda):
        return device_time(fn, iters, flush)
    try:
        fn()  # compiles, allocates, picks kernels
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:
        print(f"graph capture failed{' for ' + label if label else ''} ({str(exc).splitlines()[0][:160]}): "
              "timed launch by launch", flush=True)
        torch.cuda.synchronize()
        return device_time(fn, iters, flush)
    seconds = device_time(graph.replay, iters, flush)
    del graph
    return seconds
