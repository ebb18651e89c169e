"""The persistent batch: what the worker keeps of its requests between steps, laid out for
one copy to the device per step.

Each request the worker holds owns a *row* (`InputBatch.add`, freed by `remove`) for as
long as it holds it. A row keeps the request's block table of each KV cache group and its
sampling settings (temperature, top-k, top-p, min-p, normalised once, worker_svc/sampling_rows.py:
worker_svc/sampler.py `row_settings`). Row 0 is nobody's: its tables are zeros, the rows a
CUDA graph pads its batch with read it (kvstore/cache_tensors.py: block 0 holds finite
values), and write to slot -1 (nowhere).

The block tables live twice: in host memory (numpy, `[G, rows, max_blocks_per_req]`, the
truth, where the slot mapping is computed) and on the device. A step's new and replaced
block ids change the host rows and are remembered as (flat index, id) pairs; `prepare`
ships them with the step's inputs and scatters them into the device tables with one
index_put_. On the CPU the two are one memory.

A step (`prepare`): the scheduled (request, tokens) pairs in batch order become, in a
staging buffer of int32 (pinned host memory on a GPU; worker_svc/staging_buffers.py):

    input_ids [T]    the tokens computed now          positions [T]    their positions
    slots [G, T]     where each token's K/V go in each group's blocks (table[p // bs] * bs + p % bs)
    seq_lens [R]     each request's context after the step
    query_start_loc [R + 1]                            logits_indices [S]  the rows that sample
    row_ids [R]      each request's row               the sampling rows' settings [S] x 4
    seed_bits [S]    int64: each seeded sampling row's seed for this position (position_seeds)
    ahead_dst/src    the tokens in flight: where in input_ids, and where in the ids sampled
                     by the step launched before (prepare's ahead_ids)
    table diffs      (flat index, block id) pairs

built in one Python pass over the requests (a decoding request's slot from its table row;
a prefill chunk's slots with numpy), one assignment per section (a numpy call costs more
than a few requests' Python: docs/benchmarks.md, "The worker's host work per step"; the
same rows' sampling settings are left in place from the step before). The buffer goes to
the device in ONE non-blocking copy, the diffs are scattered, and each group's step block
table is gathered from the device tables by `row_ids` (one index_select). Nothing else is
built per step: the attention metadata, the logits rows and the sampling settings are
views of that copy.

Two buffers exist. The eager one is sized for the step (grown when a step needs more); the
graph one is fixed at `graph_capacity` requests, so that captured CUDA graphs
(worker_svc/cuda_graphs.py) read their inputs at fixed addresses: `prepare(..., pad_to=b)`
lays a pure-decode step out there, padded to `b` rows (row 0, position 0, slot -1,
context 1). Both are reused every step. On the device, a step's copy is ordered after the
kernels of the step before, so it never overwrites inputs still being read; on the host,
`prepare` waits until the step before's copy has left a buffer before writing it again
(the step before may still be running: the runner launches a step ahead of the one before
finishing, worker_svc/model_runner.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kernels.host_layout import HostLayout
from modeling.attention_metadata import AttentionMetadata, GroupAttention
from worker_svc.batch import FlatBatch, bidir_spans_of, effective_window, whole_image_slices
from worker_svc.request_state import RequestState
from worker_svc.sampling_rows import SamplingRows
from worker_svc.staging_buffers import StagingBuffers

DUMMY_ROW = 0
_NO_DIFFS = np.zeros(0, dtype=np.int64)
_NO_DIFFS.flags.writeable = False


class InputBatch:
    """Rows of per-request state on the host and the device, and the step's inputs built
    from them (module docstring). `max_blocks_per_req`: the widest block table a request
    may have (max_model_len / block_size, rounded up). `separate_device_memory`: keep the
    device's copy apart from the host's, as on a GPU (default: unless the device is the
    CPU; tests set it on the CPU to check the GPU's bookkeeping)."""

    def __init__(self, num_groups: int, block_size: int, max_blocks_per_req: int, vocab_size: int,
                 device: torch.device, graph_capacity: int = 0, rows: int = 64,
                 separate_device_memory: bool | None = None):
        self.num_groups, self.block_size, self.width = num_groups, block_size, max_blocks_per_req
        self.device = device
        self._on_gpu = device.type != "cpu" if separate_device_memory is None else separate_device_memory
        self._tables = np.zeros((num_groups, rows, max_blocks_per_req), dtype=np.int32)
        self._tables_dev = self._device_tables()
        self._num_blocks = np.zeros(rows, dtype=np.int64)
        self._sampling = SamplingRows(rows, vocab_size)  # each row's sampling settings
        self._free = list(range(rows - 1, DUMMY_ROW, -1))  # row 0 is nobody's
        self._pending: list[np.ndarray] = []  # flat indices of host table entries to ship
        self._block_limit: int | None = None  # every id set is below it, once known (limit_block_ids)
        self._eager = StagingBuffers(64, 16, 64, num_groups, device, self._on_gpu)
        # a graph step's diffs: a new block per request and group fits; more (a swapped-in
        # request's whole table) go ahead through the eager buffers
        self._graph = StagingBuffers(graph_capacity, graph_capacity, 2 * graph_capacity * num_groups, num_groups,
                                     device, self._on_gpu) if graph_capacity else None
        if self._graph is not None:  # each group's step table for graph steps, at a fixed address
            self.graph_tables = torch.zeros(num_groups, graph_capacity, max_blocks_per_req,
                                            dtype=torch.int32, device=device)

    # -- rows ------------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return self._tables.shape[1]

    def _device_tables(self) -> torch.Tensor:
        host = torch.from_numpy(self._tables)
        return host.to(self.device, copy=True) if self._on_gpu else host

    def add(self, params, block_tables: Sequence[Sequence[int]]) -> int:
        """A row for a new request: its sampling `params` (proto SamplingParams) and block
        tables (one list per group); returns the row."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        try:
            self.set_blocks(row, block_tables, replace=True)
        except ValueError:  # refused: the row stays free
            self._free.append(row)
            raise
        self._sampling.set(row, params)
        return row

    def remove(self, row: int) -> None:
        self._num_blocks[row] = 0
        self._sampling.remove(row)
        self._free.append(row)

    def clear(self) -> None:
        self._sampling.clear()
        self._num_blocks[:] = 0
        self._free = list(range(self.num_rows - 1, DUMMY_ROW, -1))

    def limit_block_ids(self, num_blocks: int) -> None:
        """From now on every block id set must name one of the KV cache's `num_blocks`
        blocks (set_blocks: ValueError otherwise), and the attention plans take that bound
        (kernels/host_layout.py) instead of reading each step's tables for it."""
        if self._tables.size and not 0 <= int(self._tables.min()) <= int(self._tables.max()) < num_blocks:
            raise ValueError(f"the block tables already name blocks outside the cache's {num_blocks}")
        self._block_limit = num_blocks

    def set_blocks(self, row: int, block_ids: Sequence[Sequence[int]], replace: bool) -> None:
        """Each group's `block_ids[g]` appended to the row's table, or, with `replace`, as
        its table (the same count in every group)."""
        start = 0 if replace else int(self._num_blocks[row])
        count = len(block_ids[0])
        end = start + count
        if end > self.width:
            raise ValueError(f"a block table of {end} blocks is wider than the {self.width} blocks "
                             f"max_model_len allows")
        if any(len(ids) != count for ids in block_ids):
            raise ValueError(f"KV cache groups got {[len(ids) for ids in block_ids]} block ids: "
                             "every group gets the same count")
        limit = self._block_limit
        if limit is not None and count and any(min(ids) < 0 or max(ids) >= limit for ids in block_ids):
            bad = next(i for ids in block_ids for i in ids if not 0 <= i < limit)
            raise ValueError(f"block id {bad} is outside the KV cache's {limit} blocks")
        for g, ids in enumerate(block_ids):
            self._tables[g, row, start:end] = ids
        self._num_blocks[row] = end
        if self._on_gpu and count:
            cols = np.arange(start, end)
            self._pending.append(((np.arange(self.num_groups)[:, None] * self.num_rows + row) * self.width
                                  + cols[None, :]).ravel())

    def drop_blocks(self, row: int) -> None:
        """Swapped out: no table until a replace brings one back."""
        self._num_blocks[row] = 0

    def _grow(self) -> None:
        old = self.num_rows
        rows = old * 2
        tables = np.zeros((self.num_groups, rows, self.width), dtype=np.int32)
        tables[:, :old] = self._tables
        self._tables = tables
        self._tables_dev = self._device_tables()  # the whole table, so nothing is pending
        self._pending.clear()
        self._num_blocks = np.concatenate([self._num_blocks, np.zeros(old, dtype=np.int64)])
        self._sampling.grow(rows)
        self._free.extend(range(rows - 1, old - 1, -1))

    # -- the step --------------------------------------------------------------------------------

    def prepare(self, scheduled: Sequence[tuple[RequestState, int]], plan_fn: Callable,
                windows: Sequence[int | None], pad_to: int | None = None,
                ahead_ids: torch.Tensor | None = None) -> FlatBatch:
        """The step's FlatBatch (worker_svc/batch.py) for `scheduled` (request, tokens to
        compute) in batch order. `plan_fn`: the attention backend's plan, called once per
        KV cache group with its window. `pad_to`: lay a pure-decode step out in the graph
        buffers, padded to that many requests (None: the eager buffers, unpadded).
        `ahead_ids`: the sampled ids, still on the device, of the step launched before
        this one and not finished yet: a request whose next token is one of them
        (num_computed_tokens == len(token_ids); at `req.ahead` in them) computes it from
        there, copied into input_ids on the device after the step's one copy."""
        num_reqs = len(scheduled)
        bs, groups, host_tables, have = self.block_size, range(self.num_groups), self._tables, self._num_blocks
        rows: list[int] = []
        ends: list[int] = []
        query_start_loc = [0]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in groups]
        samplers: list[RequestState] = []
        sample_rows: list[int] = []  # their rows of the batch (logits_indices) ...
        sampler_rows: list[int] = []  # ... their rows of the persistent batch ...
        sample_positions: list[int] = []  # ... and the output position each samples
        images = []
        ahead_dst: list[int] = []  # batch positions whose token is in ahead_ids ...
        ahead_src: list[int] = []  # ... at these indices
        token = width = 0
        for req, n in scheduled:  # per-request scalars in Python: a handful of requests' numpy calls cost more
            start, row, tokens = req.num_computed_tokens, req.row, req.token_ids
            end = start + n
            known = len(tokens)
            if start == known:  # its next token was sampled by the step in flight
                if ahead_ids is None or n != 1:
                    raise ValueError(f"request {req.request_id!r}: its next token is not sampled yet")
                known += 1
            if n <= 0 or end > known:
                raise ValueError(f"request {req.request_id!r}: cannot compute {n} tokens from "
                                 f"{start} (it has {len(tokens)})")
            need = -(-end // bs)
            if need > have[row]:
                raise ValueError(f"request {req.request_id!r}: {end} tokens need {need} blocks, its "
                                 f"block table has {int(have[row])}")
            width = max(width, need)
            rows.append(row)
            ends.append(end)
            if n == 1:
                if start < len(tokens):
                    ids.append(tokens[start])
                else:
                    ids.append(0)
                    ahead_dst.append(token)
                    ahead_src.append(req.ahead)
                positions.append(start)
                for g in groups:
                    slots[g].append(int(host_tables[g, row, start // bs]) * bs + start % bs)
            else:
                ids.extend(tokens[start:end])
                positions.extend(range(start, end))
                chunk = np.arange(start, end)
                for g in groups:
                    slots[g].extend((host_tables[g, row, chunk // bs] * bs + chunk % bs).tolist())
            if start < req.images_end:
                images.extend((req, s) for s in whole_image_slices(req, start, n, token))
            token += n
            query_start_loc.append(token)
            if end == known:
                samplers.append(req)
                sample_rows.append(token - 1)
                sampler_rows.append(row)
                sample_positions.append(known - req.num_prompt_tokens)
        num_tokens = token
        diffs = np.concatenate(self._pending) if self._pending else _NO_DIFFS
        self._pending.clear()

        if pad_to is not None:
            buf = self._graph
            if buf is None or num_tokens != num_reqs or pad_to > buf.requests or num_reqs > pad_to or images:
                raise ValueError(f"a graph step takes a pure-decode batch of at most {pad_to} requests")
            if len(diffs) > buf.diffs:  # too many for the graph buffers: ahead, on their own
                self._apply_diffs(self._eager_buffers(0, 0, len(diffs)), diffs)
                diffs = diffs[:0]
            width = self.width
            buf.writable()
        else:
            buf = self._eager_buffers(num_tokens, num_reqs, len(diffs))
        total_tokens = num_tokens if pad_to is None else pad_to
        total_reqs = num_reqs if pad_to is None else pad_to
        h = buf.host
        h["input_ids"][:num_tokens] = ids
        h["positions"][:num_tokens] = positions
        for g in groups:
            h["slots"][g, :num_tokens] = slots[g]
        h["query_start_loc"][:num_reqs + 1] = query_start_loc
        h["seq_lens"][:num_reqs] = ends
        h["row_ids"][:num_reqs] = rows
        h["logits_indices"][:len(sample_rows)] = sample_rows
        if total_tokens > num_tokens:  # graph padding: rows nobody reads, writing nowhere
            h["input_ids"][num_tokens:total_tokens] = 0
            h["positions"][num_tokens:total_tokens] = 0
            h["slots"][:, num_tokens:total_tokens] = -1
            h["query_start_loc"][num_reqs + 1:total_reqs + 1] = np.arange(num_reqs + 1, total_reqs + 1)
            h["seq_lens"][num_reqs:total_reqs] = 1
            h["row_ids"][num_reqs:total_reqs] = DUMMY_ROW
            h["logits_indices"][len(sample_rows):total_reqs] = np.arange(len(sample_rows), total_reqs)
        if ahead_dst:
            h["ahead_dst"][:len(ahead_dst)] = ahead_dst
            h["ahead_src"][:len(ahead_src)] = ahead_src
        sampling = self._sampling.stage(buf, sampler_rows, sample_positions)
        self._apply_diffs(buf, diffs)
        d = buf.dev
        if ahead_dst:  # stream-ordered after the copy: the ids never visit the host
            count = len(ahead_dst)
            d["input_ids"].index_put_((d["ahead_dst"][:count],),
                                      ahead_ids.index_select(0, d["ahead_src"][:count]).to(torch.int32))
        row_ids = d["row_ids"][:total_reqs]
        if pad_to is not None:
            tables = self.graph_tables[:, :pad_to]
            for g in range(self.num_groups):
                torch.index_select(self._tables_dev[g], 0, row_ids, out=tables[g])
        else:
            tables = self._tables_dev[:, :, :width].index_select(1, row_ids)
        seq_lens = d["seq_lens"][:total_reqs]
        query_start_loc = d["query_start_loc"][:total_reqs + 1]
        bidir_spans = bidir_spans_of(images, num_tokens, self.device) if images else None
        max_seq_len = max(ends, default=1)
        host = HostLayout(h["seq_lens"][:total_reqs], h["query_start_loc"][:total_reqs + 1], max_seq_len,
                          self._block_limit)
        groups = tuple(
            GroupAttention(slot_mapping=d["slots"][g, :total_tokens], block_tables=tables[g],
                           plan=plan_fn(tables[g], seq_lens, query_start_loc, self.block_size,
                                        effective_window(window, max_seq_len), bidir_spans=bidir_spans,
                                        host=host))
            for g, window in enumerate(windows))
        return FlatBatch(
            input_ids=d["input_ids"][:total_tokens],
            positions=d["positions"][:total_tokens],
            attn=AttentionMetadata(groups=groups, seq_lens=seq_lens, query_start_loc=query_start_loc,
                                   bidir_spans=bidir_spans),
            logits_indices=d["logits_indices"][:len(sample_rows) if pad_to is None else pad_to],
            sampling_requests=tuple(samplers),
            images=tuple(images),
            sampling=sampling(d) if sampling is not None else None,
        )

    def _eager_buffers(self, tokens: int, requests: int, diffs: int) -> StagingBuffers:
        """The eager buffers, grown (at least doubled) when they hold less than asked."""
        if not self._eager.fits(tokens, requests, diffs):
            old = self._eager
            self._eager = StagingBuffers(max(tokens, old.tokens * 2), max(requests, old.requests * 2),
                                         max(diffs, old.diffs * 2), self.num_groups, self.device, self._on_gpu)
        return self._eager.writable()

    def _apply_diffs(self, buf: StagingBuffers, diffs: np.ndarray) -> None:
        """Ship `buf` to the device with the table entries `diffs` (flat indices), and
        scatter those into the device tables."""
        count = len(diffs)
        if count:
            buf.host["diff_index"][:count] = diffs
            buf.host["diff_value"][:count] = self._tables.reshape(-1)[diffs]
        buf.commit()
        if count:
            self._tables_dev.view(-1)[buf.dev["diff_index"][:count]] = buf.dev["diff_value"][:count]
