"""The sampling settings of the persistent batch's rows (worker_svc/input_batch.py), and a
step's staging of them.

Each row keeps its request's temperature, top-k, top-p and min-p, normalised once
(worker_svc/sampler.py `row_settings`), and its seed where it has one. A step stages the
sampling rows' settings into its staging buffer (worker_svc/staging_buffers.py), and each
seeded row's seed for the output position it samples now (`position_seeds`). The same rows
with the same settings as the last step staged in that buffer keep their sections: only
the seeds are written again (a decode batch's rows change only as requests come and go).
"""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.sampler import GREEDY_EPS, RowSeeds, SamplingBatch, position_seeds, row_settings
from worker_svc.staging_buffers import StagingBuffers


class SamplingRows:
    """`rows` rows of settings (grown by `grow`); `vocab_size` bounds top-k."""

    def __init__(self, rows: int, vocab_size: int):
        self.vocab_size = vocab_size
        self._settings = np.zeros((rows, 4), dtype=np.float64)  # temperature, top_k, top_p, min_p
        self._seeds = np.zeros(rows, dtype=np.int64)  # each row's request seed, where it has one
        self._seeded = np.zeros(rows, dtype=bool)
        self._drawing: set[int] = set()  # rows that draw (not greedy): a step without them stages nothing
        self._version = 0  # bumped whenever a row's settings may change

    def set(self, row: int, params) -> None:
        """`row`'s settings from a request's `params` (proto SamplingParams)."""
        self._version += 1
        settings = self._settings[row] = row_settings(params, self.vocab_size)
        self._seeded[row] = params.HasField("seed")
        self._seeds[row] = params.seed
        if settings[0] >= GREEDY_EPS:
            self._drawing.add(row)
        else:
            self._drawing.discard(row)

    def remove(self, row: int) -> None:
        self._drawing.discard(row)

    def clear(self) -> None:
        self._version += 1
        self._drawing.clear()

    def grow(self, rows: int) -> None:
        more = rows - len(self._seeds)
        self._version += 1
        self._settings = np.concatenate([self._settings, np.zeros((more, 4))])
        self._seeds = np.concatenate([self._seeds, np.zeros(more, dtype=np.int64)])
        self._seeded = np.concatenate([self._seeded, np.zeros(more, dtype=bool)])

    def stage(self, buf: StagingBuffers, rows: list[int], positions: list[int]):
        """Stage the settings of the sampling rows (`rows` of the persistent batch, each
        sampling output position `positions[i]`); returns a function of the device views
        giving the step's SamplingBatch (its per-step edits are the runner's), or None when
        no row samples. The settings of the same rows, unchanged since the last step that
        staged them in this buffer, are left where they are: only the seeds are new."""
        count = len(rows)
        if not count:
            return None
        if not self._drawing or self._drawing.isdisjoint(rows):  # all greedy

            def greedy(d: dict[str, torch.Tensor]) -> SamplingBatch:  # the settings are not read
                return SamplingBatch(temperatures=d["temperatures"][:count], greedy=d["greedy"][:count],
                                     top_ks=None, top_ps=None, seeds=None, all_greedy=True)
            return greedy
        h = buf.host
        key = (self._version, tuple(rows))
        staged = buf.sampling_staged
        if staged is None or staged[0] != key:
            staged = buf.sampling_staged = (key, *self._stage_settings(h, rows))
        _, use_k, use_p, use_min_p, all_greedy, any_greedy, seeds = staged
        if seeds is not None:  # each seeded row's seed for the output position it samples now
            h["seed_bits"][:count] = position_seeds(seeds, np.array(positions, dtype=np.int64))

        def on_device(d: dict[str, torch.Tensor]) -> SamplingBatch:
            return SamplingBatch(
                temperatures=d["temperatures"][:count], greedy=d["greedy"][:count],
                top_ks=d["top_ks"][:count] if use_k else None, top_ps=d["top_ps"][:count] if use_p else None,
                seeds=RowSeeds(d["seed_bits"][:count], d["seeded"][:count]) if seeds is not None else None,
                all_greedy=all_greedy, any_greedy=any_greedy,
                min_ps=d["min_ps"][:count] if use_min_p else None)
        return on_device

    def _stage_settings(self, h: dict[str, np.ndarray], rows: list[int]) -> tuple:
        """The settings' sections for `rows`, and what the sampler needs to know of them:
        (top-k used, top-p used, min-p used, all greedy, any greedy, the rows' request seeds
        or None when no row is seeded)."""
        count = len(rows)
        settings = self._settings[rows]
        temps = settings[:, 0]
        greedy = temps < GREEDY_EPS
        h["temperatures"][:count] = np.where(greedy, 1.0, temps)
        h["greedy"][:count] = greedy
        h["top_ks"][:count] = settings[:, 1]
        h["top_ps"][:count] = settings[:, 2]
        h["min_ps"][:count] = settings[:, 3]
        drawn = settings[~greedy]
        seeded = self._seeded[rows]
        h["seeded"][:count] = seeded
        return (bool((drawn[:, 1] < self.vocab_size).any()), bool((drawn[:, 2] < 1.0).any()),
                bool((drawn[:, 3] > 0.0).any()), bool(greedy.all()), bool(greedy.any()),
                self._seeds[rows] if seeded.any() else None)
