"""CUDA graphs for pure-decode steps: a step of a small model is one graph launch.

Without them a decode step on a GPU is bound by the host: every kernel of every layer
(nine a layer, modeling/decoder.py) is launched from Python, one after another,
and the GPU waits between them. A graph records the launches of the model's layers once
and replays them with one call.

    capture (at start, once the KV cache exists; vLLM's sizes [1, 2, 4, 8, 16, ..., 256],
    then every 16, up to --max-cudagraph-capture-size), largest first into ONE memory pool
    that the smaller graphs reuse:
        lay out a batch of b padding rows in the persistent batch's graph buffers
            (worker_svc/input_batch.py: row 0, position 0, slot -1 -- K/V written nowhere)
        run model.hidden_states on them twice, eagerly (Triton compiles for this size)
        capture model.hidden_states on them: its outputs, [b, hidden] x 2, are the graph's
    replay (a step where every request decodes one token and samples it, at most the
    largest size, no image or prompt logprobs):
        the persistent batch lays the step out in the same buffers, padded to the next
        size b, and copies them to the device; graph b replays; the final norm and the LM
        head run eagerly on the real rows (so a graph holds [b, hidden], not [b, vocab]).

Attention inside the graph reads context lengths, the query layout and the step's block
tables from those buffers (kernels/triton_attention.py launches from shapes alone and never
syncs with the host), which is why only the triton backend captures.

Memory: before the KV cache is sized, `profile` runs the layers once at the largest size on
a one-block cache and returns its peak activation memory plus the graphs' outputs; the
runner takes that from the KV cache's share of the GPU (--gpu-memory-utilization), and
`capture` logs what the pool really took. A capture that does not fit fails the start with
the memory it needed (never a silent fallback to eager).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker_svc.input_batch import InputBatch

log = logging.getLogger(__name__)


def capture_sizes(max_size: int) -> list[int]:
    """vLLM's batch sizes up to `max_size` (which is always one of them): 1, 2, 4, then
    every 8 up to 256, then every 16."""
    sizes = [s for s in (1, 2, 4) if s <= max_size] + list(range(8, min(max_size, 256) + 1, 8)) \
        + list(range(272, max_size + 1, 16))
    if max_size not in sizes:
        sizes.append(max_size)
    return sizes


def decode_graph_sizes(config, device: torch.device, backend: str) -> list[int]:
    """The batch sizes to capture for a runner (`config`: its RunnerConfig) on `device`
    with the attention `backend`: none on a CPU, with enforce_eager, or with a backend that
    plans on the host (each case logged)."""
    if device.type != "cuda":
        return []
    if config.enforce_eager:
        log.info("CUDA graphs off (--enforce-eager): every step runs eagerly")
        return []
    if backend != "triton":
        log.info("CUDA graphs off: the %s attention backend plans each step on the host", backend)
        return []
    if config.max_cudagraph_capture_size < 1:
        raise ValueError(f"--max-cudagraph-capture-size {config.max_cudagraph_capture_size}: must be >= 1 "
                         "(--enforce-eager turns CUDA graphs off)")
    return capture_sizes(config.max_cudagraph_capture_size)


@dataclass(frozen=True)
class CaptureReport:
    sizes: tuple[int, ...]
    seconds: float
    pool_bytes: int  # the device memory the graphs took (free memory before minus after)

    def describe(self) -> str:
        return (f"CUDA graphs for {len(self.sizes)} decode batch sizes ({self.sizes[0]}..{self.sizes[-1]}) "
                f"captured in {self.seconds:.1f} s, {self.pool_bytes / 2**20:.0f} MiB")


class GraphMemoryError(RuntimeError):
    """The graphs do not fit in what the KV cache left."""


class DecodeGraphs:
    """One CUDA graph of `model.hidden_states` per batch size in `sizes`, reading the
    persistent batch's graph buffers (`inputs` must have been made with a graph capacity
    of at least max(sizes))."""

    def __init__(self, model, inputs: InputBatch, kv_caches, plan_fn: Callable,
                 windows: Sequence[int | None], sizes: Sequence[int]):
        self.model, self.inputs, self.kv_caches = model, inputs, kv_caches
        self.plan_fn, self.windows = plan_fn, tuple(windows)
        self.sizes = sorted(sizes)
        self.replays = 0  # steps replayed so far
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}

    @staticmethod
    def profile(model, inputs: InputBatch, kv_caches, plan_fn: Callable, windows: Sequence[int | None],
                sizes: Sequence[int], device: torch.device) -> int:
        """Bytes the graphs will hold: the layers' peak activation memory at the largest size,
        run here once on `kv_caches` (a one-block cache will do: padding rows read block 0
        and write nowhere), plus every graph's two [b, hidden] outputs."""
        size = max(sizes)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        batch = inputs.prepare([], plan_fn, windows, pad_to=size)
        with torch.inference_mode():
            y, _ = model.hidden_states(batch.input_ids, batch.positions, batch.attn, kv_caches)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        outputs = 2 * sum(sizes) * y.shape[-1] * y.element_size()
        return peak + outputs

    def capture(self, device: torch.device, needed_bytes: int = 0) -> CaptureReport:
        """Capture every size; `needed_bytes`: what `profile` said they would take (for the
        message should they not fit)."""
        start = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(device)
        pool = None
        stream = torch.cuda.Stream(device)
        try:
            with torch.inference_mode():
                for size in reversed(self.sizes):
                    batch = self.inputs.prepare([], self.plan_fn, self.windows, pad_to=size)
                    args = (batch.input_ids, batch.positions, batch.attn, self.kv_caches)
                    stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(stream):
                        for _ in range(2):  # compiles this size's kernels, settles the allocator
                            self.model.hidden_states(*args)
                    torch.cuda.current_stream(device).wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        outputs = self.model.hidden_states(*args)
                    pool = graph.pool()
                    self._graphs[size] = (graph, outputs)
        except torch.cuda.OutOfMemoryError as exc:
            free, total = torch.cuda.mem_get_info(device)
            needed = f"about {needed_bytes / 2**30:.2f} GiB needed, " if needed_bytes else ""
            raise GraphMemoryError(
                f"capturing CUDA graphs for decode batches up to {max(self.sizes)} ran out of GPU memory "
                f"({needed}{free / 2**30:.2f} of {total / 2**30:.2f} GiB free after the KV cache): lower "
                "--gpu-memory-utilization or --max-cudagraph-capture-size, or run with --enforce-eager"
            ) from exc
        torch.cuda.synchronize(device)
        free_after, _ = torch.cuda.mem_get_info(device)
        return CaptureReport(tuple(self.sizes), time.perf_counter() - start, free_before - free_after)

    def size_for(self, num_reqs: int) -> int | None:
        """The smallest captured size holding `num_reqs` requests; None above the largest."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run graph `size` on what the persistent batch last laid out in its graph buffers
        (InputBatch.prepare(..., pad_to=size)); its outputs, as model.hidden_states'."""
        graph, outputs = self._graphs[size]
        graph.replay()
        self.replays += 1
        return outputs
