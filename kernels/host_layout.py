"""What the host already knows of a step's attention metadata, handed to a backend's plan
so that it reads neither the tensors back nor reduces them again.

The worker's persistent batch (worker_svc/input_batch.py) writes `seq_lens` and
`query_start_loc` into a host staging buffer before its one copy to the device, and knows
the longest context from the Python pass that laid them out. A plan given a HostLayout
reads those: no device-to-host copy (a synchronisation on a GPU), no `max` over the
tensor. It also bounds the block ids: the batch checks each id as it is written into a
table (worker_svc/input_batch.py `limit_block_ids`), so a plan need not scan the step's
tables to prove that a kernel reads inside the cache. Without a HostLayout (tests, a kernel
called on its own) a plan reads the tensors and scans the tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class HostLayout:
    """`seq_lens` [R] and `query_start_loc` [R + 1]: numpy int32, equal to the step's
    tensors of those names; `max_seq_len`: the largest of `seq_lens` (1 for no request);
    `block_ids_below`: every id in the step's block tables is in [0, block_ids_below)
    (None: not known, the plan scans the tables)."""

    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    max_seq_len: int
    block_ids_below: int | None = None
