"""Preemption: how a running request gives up its GPU blocks when the pool runs out.

When and whom the planner decides (scheduler_svc/policy/planner.py: the running request with the
largest (priority, arrival)); this decides how:
  recompute  its blocks are freed (cached ones stay cached), it goes back to waiting with
             num_computed_tokens = 0, and the worker forgets it (finished_request_ids);
  swap       (preemption_mode "swap", when the worker's CPU swap space holds its blocks)
             its blocks move to CPU blocks -- the step's blocks_to_swap_out -- it waits in
             `swapped` keeping num_computed_tokens, and the worker keeps its state
             (swapped_out_request_ids). A child the worker has not seen yet is always
             recomputed.
"""

from collections.abc import Callable

from kvstore.kv_cache_manager import KVCacheManager
from scheduler_svc.policy.queues import RequestQueues
from scheduler_svc.policy.request import SchedulerRequest


class Preemptor:
    """Preempts requests, and keeps the swap-outs the next step carries."""

    def __init__(self, preemption_mode: str, kv: KVCacheManager, queues: RequestQueues,
                 forget: Callable[[str], None]) -> None:
        self._swap = preemption_mode == "swap"
        self._kv = kv
        self._queues = queues
        self._forget = forget  # the worker drops the request in the next step
        # (gpu, cpu) block pairs by request, for the next step; an abort before it goes
        # out drops the request's own.
        self._swap_outs: dict[str, list[tuple[int, int]]] = {}
        self.num_preemptions = 0  # since start, by recompute or swap
        self.num_swapped_out = 0  # since start, by swap

    def preempt(self, req: SchedulerRequest, may_swap: bool = True) -> None:
        """Preempt a request the caller took off running (`RequestQueues.pop_victim`): by
        swap when that is the mode, `may_swap` and the swap space has room for its blocks,
        else by recompute."""
        req.num_preemptions += 1
        self.num_preemptions += 1
        rid = req.request_id
        if may_swap and self._swap and self._kv.can_swap_out(rid):
            self._swap_outs[rid] = self._kv.swap_out(rid)
            self._queues.park_swapped(req)
            self.num_swapped_out += 1
            return
        self._kv.free(rid)
        self._queues.requeue(req)
        self._forget(rid)

    def drop(self, request_id: str) -> None:
        """The request was aborted: a swap-out of its blocks must not go out (its CPU
        blocks are free for another)."""
        self._swap_outs.pop(request_id, None)

    def take_swap_outs(self) -> dict[str, list[tuple[int, int]]]:
        """The swap-outs the next step carries, by request; none are pending after."""
        swap_outs, self._swap_outs = self._swap_outs, {}
        return swap_outs

    def clear(self) -> None:
        """Every request left (drained)."""
        self._swap_outs = {}
