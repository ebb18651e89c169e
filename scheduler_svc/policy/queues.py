"""Every unfinished request of one worker's scheduler, and the queue it is in.

Three queues, each sorted by (priority, arrival, request id) (`SchedulerRequest.sort_key`):
  waiting  new, preempted by recompute or re-routed; the head is admitted first;
  running  admitted, holding GPU blocks; the tail is preempted first;
  swapped  preempted by swap, holding CPU blocks; the head resumes first.
A request's status says which queue holds it; only this class changes either. It also
keeps the load: the tokens (prompt + outputs so far) of every request here.

Invariants (`check_integrity`): every unfinished request is in exactly one queue, the one
its status names; each queue is sorted; waiting requests have no computed tokens, waiting
and swapped ones no tokens in flight; the running ones count at most max_num_seqs
sequences (a parent of n > 1 counts as n); load_tokens is the sum of their tokens.
"""

import bisect

from proto.messages import FinishReason
from scheduler_svc.policy.request import RequestStatus, SchedulerRequest, by_sort_key

_WAITING, _RUNNING, _SWAPPED = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.SWAPPED


class RequestQueues:
    def __init__(self) -> None:
        self._requests: dict[str, SchedulerRequest] = {}  # every unfinished request, by id
        self._waiting: list[SchedulerRequest] = []
        self._running: list[SchedulerRequest] = []
        self._swapped: list[SchedulerRequest] = []
        self._load_tokens = 0
        self.num_aborted = 0  # requests aborted while waiting, running or swapped, since start

    # -- reading (the lists are the queues themselves: change them only through methods) --

    @property
    def waiting(self) -> list[SchedulerRequest]:
        return self._waiting

    @property
    def running(self) -> list[SchedulerRequest]:
        return self._running

    @property
    def swapped(self) -> list[SchedulerRequest]:
        return self._swapped

    @property
    def load_tokens(self) -> int:
        return self._load_tokens

    def get(self, request_id: str) -> SchedulerRequest | None:
        return self._requests.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __bool__(self) -> bool:
        return bool(self._requests)

    def num_running_seqs(self) -> int:
        """Sequences running: a parent not forked yet counts as its n children."""
        return sum(req.n for req in self._running)

    # -- entering and leaving ---------------------------------------------------------------

    def add(self, req: SchedulerRequest) -> None:
        """A new (or re-routed) request, at its place in the waiting queue."""
        req.status = _WAITING
        self._enter(req)
        bisect.insort(self._waiting, req, key=by_sort_key)

    def add_running(self, req: SchedulerRequest) -> None:
        """A forked child: running from the start, on its parent's (shared) blocks."""
        req.status = _RUNNING
        self._enter(req)
        bisect.insort(self._running, req, key=by_sort_key)

    def _enter(self, req: SchedulerRequest) -> None:
        self._requests[req.request_id] = req
        self._load_tokens += req.num_tokens

    def finish(self, req: SchedulerRequest, reason: FinishReason | None) -> RequestStatus:
        """Take the request out of its queue for good: finished or aborted (`reason`), or
        a parent replaced by its children (None). Returns the status it had."""
        status = req.status
        {_WAITING: self._waiting, _RUNNING: self._running, _SWAPPED: self._swapped}[status].remove(req)
        del self._requests[req.request_id]
        self._load_tokens -= req.num_tokens
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if reason == "abort":
            self.num_aborted += 1
        return status

    def drain(self) -> list[SchedulerRequest]:
        """Remove every request; returns them in (priority, arrival) order, WAITING, reset
        to be recomputed elsewhere."""
        states = sorted(self._requests.values(), key=by_sort_key)
        for req in states:
            req.reset_for_recompute()
            req.status = _WAITING
        self._requests.clear()
        self._waiting, self._running, self._swapped = [], [], []
        self._load_tokens = 0
        return states

    # -- moving between queues ----------------------------------------------------------------

    def admit_head(self, num_computed_tokens: int) -> SchedulerRequest:
        """The head of the waiting queue starts running, its first `num_computed_tokens`
        already computed (a prefix-cache hit). Its first admission's hit is the one the
        client is told of (`num_cached_tokens`: prompt tokens only)."""
        req = self._waiting.pop(0)
        req.status = _RUNNING
        req.num_computed_tokens = num_computed_tokens
        if req.num_cached_tokens is None:
            req.num_cached_tokens = min(num_computed_tokens, req.num_prompt_tokens)
        bisect.insort(self._running, req, key=by_sort_key)
        return req

    def pop_victim(self) -> SchedulerRequest:
        """Take the running request preempted first (the largest sort key) off running;
        the caller requeues or swaps it."""
        return self._running.pop()

    def requeue(self, req: SchedulerRequest) -> None:
        """A request preempted by recompute: back to waiting by (priority, arrival) -- the
        front unless a request of higher priority waits -- its K/V forgotten."""
        req.reset_for_recompute()
        req.status = _WAITING
        bisect.insort(self._waiting, req, key=by_sort_key)

    def park_swapped(self, req: SchedulerRequest) -> None:
        """A request preempted by swap: its K/V in CPU blocks until it resumes."""
        req.status = _SWAPPED
        bisect.insort(self._swapped, req, key=by_sort_key)

    def resume_head_swapped(self) -> SchedulerRequest:
        """The head of the swapped queue runs again (on the GPU blocks it was just given)."""
        req = self._swapped.pop(0)
        req.status = _RUNNING
        bisect.insort(self._running, req, key=by_sort_key)
        return req

    def append(self, req: SchedulerRequest, token_id: int) -> None:
        """A token sampled for a running request came back: one of its tokens, no longer
        in flight."""
        req.token_ids.append(token_id)
        req.num_pending -= 1
        self._load_tokens += 1

    # -- self-check ---------------------------------------------------------------------------

    def check_integrity(self, max_num_seqs: int) -> None:
        """Raise AssertionError unless the invariants in the module docstring hold."""
        queued = [req.request_id for q in (self._waiting, self._running, self._swapped) for req in q]
        assert sorted(queued) == sorted(self._requests), (
            "waiting + running + swapped differ from the unfinished requests")
        for status, queue in ((_WAITING, self._waiting), (_RUNNING, self._running), (_SWAPPED, self._swapped)):
            assert queue == sorted(queue, key=by_sort_key), f"{status.value} is out of order"
            for req in queue:
                assert req.status is status, f"{status.value} {req.request_id} is {req.status}"
                assert self._requests[req.request_id] is req, f"{req.request_id} is queued twice"
        for req in self._waiting:
            assert req.num_computed_tokens == 0, f"waiting {req.request_id} has computed tokens"
        for req in self._waiting + self._swapped:
            assert req.num_pending == 0, f"{req.request_id} is {req.status} with tokens in flight"
        num_seqs = self.num_running_seqs()
        assert num_seqs <= max_num_seqs, f"{num_seqs} sequences running > max_num_seqs {max_num_seqs}"
        total = sum(req.num_tokens for req in self._requests.values())
        assert self._load_tokens == total, f"load_tokens {self._load_tokens} != {total}"
