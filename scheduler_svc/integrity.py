"""BatchScheduler's self-check: a mixin of BatchScheduler (scheduler_svc/batching.py).

Invariants (checked by `check_integrity`):
- every unfinished request is in exactly one of `waiting`, `running` and `swapped`, each
  sorted by (priority, arrival, request id);
- a swapped request holds CPU blocks for exactly its computed tokens and no GPU blocks;
- a waiting request holds no blocks and has num_computed_tokens == 0;
- a running request's block table covers exactly its computed tokens
  (cdiv(num_computed_tokens, block_size) blocks), and it has tokens left to compute
  (counting those in flight) unless the step that catches it up is in flight; its tokens
  in flight (num_pending) are the steps in flight that sample for it (at most two steps
  are in flight); waiting and swapped requests have none;
- len(running) <= max_num_seqs; load_tokens is the sum of the unfinished requests'
  tokens; the KV manager's own invariants hold.
"""

from kvstore.kv_cache_manager import cdiv
from scheduler_svc.request import RequestStatus, by_sort_key


class IntegrityMixin:
    """BatchScheduler's `check_integrity`."""

    def check_integrity(self) -> None:
        """Raise AssertionError with a clear message unless every invariant in the module
        docstring holds."""
        self.kv.check_integrity()
        waiting_ids = [req.request_id for req in self.waiting]
        running_ids = [req.request_id for req in self.running]
        swapped_ids = [req.request_id for req in self.swapped]
        assert not set(waiting_ids) & set(running_ids), (
            f"requests both waiting and running: {set(waiting_ids) & set(running_ids)}")
        assert sorted(waiting_ids + running_ids + swapped_ids) == sorted(self._requests), (
            "waiting + running + swapped differ from the unfinished requests")
        assert self.swapped == sorted(self.swapped, key=by_sort_key), "swapped is out of order"
        for req in self.swapped:
            rid = req.request_id
            assert req.status is RequestStatus.SWAPPED, f"swapped {rid} is {req.status}"
            assert not self.kv.block_ids(rid), f"swapped {rid} holds GPU blocks"
            assert self.kv.num_swapped_blocks(rid) == cdiv(req.num_computed_tokens, self.kv.block_size), (
                f"swapped {rid} holds {self.kv.num_swapped_blocks(rid)} CPU blocks for "
                f"{req.num_computed_tokens} computed tokens")
        total = sum(req.num_tokens for req in self._requests.values())
        assert self._load_tokens == total, f"load_tokens {self._load_tokens} != {total}"
        assert self.waiting == sorted(self.waiting, key=by_sort_key), "waiting is out of order"
        assert self.running == sorted(self.running, key=by_sort_key), "running is out of order"
        assert self._num_seqs() <= self.config.max_num_seqs, (
            f"{self._num_seqs()} sequences running > max_num_seqs {self.config.max_num_seqs}")
        assert self._unsent <= set(running_ids), f"unsent children not running: {self._unsent}"
        assert self._copies.keys() <= self._unsent, "a copy-on-write for a request already sent"
        for parent_id, children in self._children.items():
            assert children and children <= self._requests.keys(), (
                f"parent {parent_id}: children {children} not all unfinished here")
        for req in self.waiting:
            assert req.status is RequestStatus.WAITING, f"waiting {req.request_id} is {req.status}"
            assert req.num_computed_tokens == 0, f"waiting {req.request_id} has computed tokens"
            assert not self.kv.block_ids(req.request_id), f"waiting {req.request_id} holds blocks"
        in_flight = {rid for f in self._in_flight for rid in f.step.num_scheduled_tokens}
        assert len(self._in_flight) <= 2, f"{len(self._in_flight)} steps in flight"
        for req in self.waiting + self.swapped:
            assert req.num_pending == 0, f"{req.request_id} is {req.status} with tokens in flight"
        sampling: dict[int, int] = {}  # id(request) -> steps in flight that sample for it
        for f in self._in_flight:
            for req, _, _, samples in f.reqs:
                sampling[id(req)] = sampling.get(id(req), 0) + samples
        for req in self.running:
            rid = req.request_id
            assert req.status is RequestStatus.RUNNING, f"running {rid} is {req.status}"
            num_blocks = len(self.kv.block_ids(rid))
            assert num_blocks == cdiv(req.num_computed_tokens, self.kv.block_size), (
                f"running {rid} holds {num_blocks} blocks for {req.num_computed_tokens} "
                f"computed tokens (block size {self.kv.block_size})")
            samples = sampling.get(id(req), 0)
            assert req.num_pending == samples, (
                f"running {rid} has {req.num_pending} tokens pending, steps in flight sample {samples}")
            lacking = req.num_tokens + req.num_pending - req.num_computed_tokens
            assert lacking > 0 or (lacking == 0 and rid in in_flight), (
                f"running {rid} has {req.num_computed_tokens} of {req.num_tokens} "
                f"(+{req.num_pending} in flight) tokens computed")
        assert set(self.kv.request_ids()) <= set(running_ids), (
            f"blocks held by requests not running: {set(self.kv.request_ids()) - set(running_ids)}")
