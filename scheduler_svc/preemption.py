"""Taking requests off this worker's GPU blocks, a mixin of BatchScheduler
(scheduler_svc/batching.py), whose state it reads and changes: preemption (by recompute,
or by swap to the worker's CPU swap space; when and whom schedule() decides, as the
batching module docstring says) and draining every request when the worker is lost.
"""

import bisect

from scheduler_svc.request import RequestState, RequestStatus, by_sort_key


class PreemptionMixin:
    """BatchScheduler's `_preempt` and `drain`."""

    def _preempt(self, req: RequestState) -> None:
        """Preempt a request already removed from `running`: by swap when that is the
        mode and the CPU swap space has room for its blocks, else by recompute (always for
        a forked child the worker has not seen yet)."""
        req.num_preemptions += 1
        self.num_preemptions += 1
        rid = req.request_id
        self._copies.pop(rid, None)  # its copy-on-write target goes back to the pool
        if rid in self._unsent:
            self._unsent.discard(rid)
        elif self.config.preemption_mode == "swap" and self.kv.can_swap_out(rid):
            self._swap_out[rid] = self.kv.swap_out(rid)
            self._replaced.discard(rid)
            req.status = RequestStatus.SWAPPED
            self.num_swapped_out += 1
            bisect.insort(self.swapped, req, key=by_sort_key)
            return
        self.kv.free(rid)
        req.reset_for_recompute()
        # Back by (priority, arrival): the front of the queue unless a request of higher
        # priority waits, so it resumes before anything that arrived after it.
        bisect.insort(self.waiting, req, key=by_sort_key)
        self._finished_ids.append(req.request_id)

    # -- worker loss ---------------------------------------------------------------------

    def drain(self) -> list[RequestState]:
        """Remove and return every unfinished request, in (priority, arrival) order, reset
        to recompute elsewhere (`add_state` on another scheduler); frees every block and
        forgets the steps in flight. Tokens they sampled are lost and will be sampled
        again, so the gateway may see an output index twice.

        If this worker is used again, the next step tells it to forget the drained requests.
        """
        states = sorted(self.waiting + self.running + self.swapped, key=by_sort_key)
        for req in self.running + self.swapped:
            self.kv.free(req.request_id)
            self._finished_ids.append(req.request_id)
        for req in states:
            req.reset_for_recompute()
        self.waiting, self.running, self.swapped = [], [], []
        self._swap_out, self._swap_in, self._copies, self._replaced = {}, [], {}, set()
        self._unsent, self._children = set(), {}  # children re-route as n == 1 requests
        self._requests.clear()
        self._load_tokens = 0
        self._in_flight = []
        self._ahead_blocked = False
        return states
