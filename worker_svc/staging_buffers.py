"""A step's staging buffer: the int32 memory the persistent batch (worker_svc/input_batch.py)
lays a step's inputs out in, in host memory (pinned on a GPU), and its twin on the device,
filled by ONE non-blocking copy per step.

The buffer is cut into named sections (input_ids, positions, one slots row per KV cache
group, query_start_loc, the per-request sections, the table diffs), each with a view on
the host (numpy) and on the device (torch); the sampling settings' float sections and the
seeds' int64 section are views of the same int32 memory. On the CPU host and device are
one memory and nothing is copied. On a GPU the buffer remembers its last copy, so the host
side is written again only once that copy has left it (`writable`).
"""

from __future__ import annotations

import numpy as np
import torch

# int32 sections of a staging buffer, in order: name -> (length in tokens, in requests)
# multiples; "slots" has one token-length section per KV cache group.
_TOKEN_SECTIONS = ("input_ids", "positions")
_REQUEST_SECTIONS = ("seq_lens", "logits_indices", "row_ids", "temperatures", "greedy", "top_ks",
                     "top_ps", "min_ps", "seeded", "ahead_dst", "ahead_src")
_FLOAT_SECTIONS = ("temperatures", "top_ps", "min_ps")
# int64 sections (two int32 each per request), first in the buffer: 8-byte aligned
_INT64_SECTIONS = ("seed_bits",)


class StagingBuffers:
    """A staging buffer of int32 for `tokens` tokens, `requests` requests and `diffs` table
    diffs, in host memory (pinned where the device is a GPU), and its twin on the device
    (the same memory unless `separate`); named views of both."""

    def __init__(self, tokens: int, requests: int, diffs: int, groups: int, device: torch.device,
                 separate: bool):
        self.tokens, self.requests, self.diffs = tokens, requests, diffs
        spans: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, length in ([(n, 2 * requests) for n in _INT64_SECTIONS]
                             + [(n, tokens) for n in _TOKEN_SECTIONS] + [("slots", groups * tokens)]
                             + [("query_start_loc", requests + 1)]
                             + [(n, requests) for n in _REQUEST_SECTIONS]
                             + [("diff_index", diffs), ("diff_value", diffs)]):
            spans[name] = (offset, length)
            offset += length
        self.host_tensor = torch.zeros(offset, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.device_tensor = torch.zeros(offset, dtype=torch.int32, device=device) if separate else self.host_tensor
        host = self.host_tensor.numpy()
        self.host: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, (start, length) in spans.items():
            h, d = host[start:start + length], self.device_tensor[start:start + length]
            if name in _FLOAT_SECTIONS:
                h, d = h.view(np.float32), d.view(torch.float32)
            elif name in _INT64_SECTIONS:
                h, d = h.view(np.int64), d.view(torch.int64)
            self.host[name], self.dev[name] = h, d
        self.host["slots"] = self.host["slots"].reshape(groups, tokens)
        self.dev["slots"] = self.dev["slots"].view(groups, tokens)
        self.separate = separate
        self._copied: torch.cuda.Event | None = None  # the last copy, on a GPU
        # What the sampling settings' sections hold (InputBatch._stage_sampling's key: the
        # rows, in order, and the version of their settings), and what was derived from
        # them; None: nothing yet. A step with the same key rewrites only the seeds.
        self.sampling_staged: tuple | None = None

    def writable(self) -> StagingBuffers:
        """The host buffer, once the last copy from it is done (at once but on a GPU)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self

    def fits(self, tokens: int, requests: int, diffs: int) -> bool:
        return tokens <= self.tokens and requests <= self.requests and diffs <= self.diffs

    def commit(self) -> None:
        """The one host-to-device copy of the step (none on the CPU)."""
        if self.separate:
            self.device_tensor.copy_(self.host_tensor, non_blocking=True)
            if self.device_tensor.is_cuda:
                self._copied = torch.cuda.Event()
                self._copied.record()
