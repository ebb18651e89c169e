"""Accounting of one worker's KV cache and scheduling, as BatchScheduler.stats() reports it.

The field names are WorkerStats' (proto/messages.py), which carries them through Redis.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    num_blocks: int  # total
    num_used_blocks: int  # held by running requests (shared ones counted once)
    num_cached_blocks: int  # held by none but still cached: reusable by a hit until evicted
    num_free_blocks: int  # held by none, cached ones included: what allocation can take
    num_running: int
    num_waiting: int
    num_preemptions: int  # since the scheduler started, as every counter below
    num_steps: int
    prefix_cache_queries: int  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found (not computed again)
    num_evicted_blocks: int  # cached blocks taken for other contents
    # 1 - tokens whose K/V the used blocks hold / their slots: the partly filled last block
    # of each running request (shared blocks are full and counted once).
    kv_waste: float
    num_swapped: int = 0  # requests swapped out to CPU blocks now
    num_swapped_out: int = 0  # swap-outs since the scheduler started (preemptions by swap)
    num_cpu_blocks: int = 0  # the worker's swap space
    num_free_cpu_blocks: int = 0
    num_forks: int = 0  # children forked for parallel sampling (n > 1)
    num_cow_copies: int = 0  # partly filled shared blocks copied on write
    num_aborted: int = 0  # requests aborted while waiting, running or swapped
    num_steps_ahead: int = 0  # steps planned while the step before ran (async scheduling)
    # per KV cache group (kvstore/kv_cache_groups.py): its window (0: full attention), and
    # the blocks the requests' tables hold in it (all groups share num_blocks)
    group_windows: tuple[int, ...] = ()
    group_used_blocks: tuple[int, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
