"""Accounting of one worker's KV cache and scheduling, as BatchScheduler.stats() reports it.

The field names are WorkerStats' (proto/messages.py), which carries them through Redis.
"""

import time
from dataclasses import asdict, dataclass

from proto.messages import WorkerStats


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

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def scheduler_stats(sched) -> SchedulerStats:
    """A BatchScheduler's block pool and prefix cache accounting now (O(num_blocks))."""
    kv, pool = sched.kv, sched.kv.block_pool
    used = kv.num_blocks - kv.num_free_blocks
    # Shared blocks are full: subtract the tokens block tables count more than once.
    held = (sum(req.num_computed_tokens for req in sched.running)
            - kv.block_size * kv.num_shared_references())
    slots = used * kv.block_size
    return SchedulerStats(
        num_blocks=kv.num_blocks, num_used_blocks=used,
        num_cached_blocks=pool.num_cached_free_blocks(), num_free_blocks=kv.num_free_blocks,
        num_running=sched.num_running, num_waiting=sched.num_waiting,
        num_preemptions=sched.num_preemptions, num_steps=sched.num_steps,
        prefix_cache_queries=sched.prefix_cache_queries,
        prefix_cache_hits=sched.prefix_cache_hits, num_evicted_blocks=pool.num_evictions,
        kv_waste=1.0 - held / slots if slots else 0.0,
        num_swapped=len(sched.swapped), num_swapped_out=sched.num_swapped_out,
        num_cpu_blocks=kv.num_cpu_blocks, num_free_cpu_blocks=kv.cpu_pool.num_free_blocks,
        num_forks=sched.num_forks, num_cow_copies=sched.num_cow_copies,
        num_aborted=sched.num_aborted, num_steps_ahead=sched.num_steps_ahead)


def worker_stats(scheduler, worker_id: str, check: bool, recorder) -> WorkerStats:
    """`scheduler`'s accounting and `recorder`'s histograms (scheduler_svc.metrics.WorkerRecorder)
    as the WorkerStats message; with `check`, after running check_integrity() (O(blocks):
    callers do it when idle) and recording its complaint."""
    problem = None
    if check:
        try:
            scheduler.check_integrity()
        except AssertionError as exc:
            problem = str(exc) or "check_integrity failed"
    requests, steps = recorder.snapshot(scheduler)
    return WorkerStats(worker_id=worker_id, integrity_error=problem, updated_at=time.time(),
                       requests=requests, steps=steps, **asdict(scheduler.stats()))
