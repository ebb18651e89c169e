"""Parallel sampling (`NewRequest.n > 1`): forking a parent into children that share its
blocks, and copying a shared block before a child writes into it.

The parent computes its prompt but the last token, then (when the step that did so comes
back) forks into n children `f"{request_id}/{i}"` that share every block
(`KVCacheManager.fork`); the parent is forgotten (finished_request_ids) and each child
goes to the worker as a new request holding the shared table, with `child_seed(seed, i)`
when the parent had a seed (ids and seeds: proto/parallel.py). A child's first step
computes the last prompt token into its last block: when that block is partly filled and
still shared, the child gets a fresh block and the step carries the copy
(`blocks_to_copy`) -- all but the last child to get there copy; the last one keeps the
original. Aborting the parent's id aborts the parent before its fork and its unfinished
children after; a child's id aborts that child alone (before the fork there is no such
child yet and the abort is ignored: the gateway stops a choice only after its first token).

Invariants (`check_integrity`): a child not sent yet is running; only such a child has a
copy pending; every parent's children are unfinished here.
"""

import msgspec

from kvstore.kv_cache_manager import KVCacheManager
from proto.parallel import child_request_id, child_seed
from scheduler_svc.policy.queues import RequestQueues
from scheduler_svc.policy.request import SchedulerRequest


def make_children(parent: SchedulerRequest) -> list[SchedulerRequest]:
    """The parent's n children, each where the parent is (tokens, computed tokens, hashes,
    the prefix-cache hit its admission reported, the images of the prompt they share)."""
    seed = parent.sampling.seed
    return [SchedulerRequest(
        request_id=child_request_id(parent.request_id, i), token_ids=list(parent.token_ids),
        num_prompt_tokens=parent.num_prompt_tokens,
        sampling=(parent.sampling if seed is None
                  else msgspec.structs.replace(parent.sampling, seed=child_seed(seed, i))),
        reply_channel=parent.reply_channel, arrival_time=parent.arrival_time,
        priority=parent.priority, num_computed_tokens=parent.num_computed_tokens,
        block_hashes=list(parent.block_hashes), parent_id=parent.request_id,
        num_cached_tokens=parent.num_cached_tokens, mm_inputs=parent.mm_inputs) for i in range(parent.n)]


class ForkManager:
    """The forked parents' unfinished children, the children the worker has not seen yet,
    and the copies on write the next step carries."""

    def __init__(self, kv: KVCacheManager) -> None:
        self._kv = kv
        self._children: dict[str, set[str]] = {}  # parent id -> its unfinished children here
        self._unsent: set[str] = set()  # forked children the worker has not seen yet
        self._copies: dict[str, list[tuple[int, int]]] = {}  # by child: (src, dst) pairs for the next step
        self.num_forks = 0  # children forked since start
        self.num_cow_copies = 0  # shared, partly filled blocks copied on write since start

    def fork(self, parent: SchedulerRequest) -> list[SchedulerRequest]:
        """The children of a running parent that computed all of its prompt but the last
        token, each holding the parent's blocks (which the parent gives up). The caller
        puts them in its place."""
        children = make_children(parent)
        for child in children:
            self._kv.fork(parent.request_id, child.request_id)
            self._unsent.add(child.request_id)
        self._kv.free(parent.request_id)
        self._children[parent.request_id] = {child.request_id for child in children}
        self.num_forks += len(children)
        return children

    def adopt(self, child: SchedulerRequest) -> None:
        """A child that arrives on its own (re-routed from a lost worker, or made at once
        from a parent with a one-token prompt): its parent's entry lasts until it is done."""
        assert child.parent_id is not None
        self._children.setdefault(child.parent_id, set()).add(child.request_id)

    def children_of(self, parent_id: str) -> list[str]:
        """The unfinished children of `parent_id` here, sorted."""
        return sorted(self._children.get(parent_id, ()))

    def has_children(self, parent_id: str) -> bool:
        return bool(self._children.get(parent_id))

    def has_unsent(self) -> bool:
        """True while some forked child has not been sent to the worker."""
        return bool(self._unsent)

    def is_unsent(self, request_id: str) -> bool:
        return request_id in self._unsent

    def mark_sent(self, request_id: str) -> None:
        """The child goes to the worker in full in the step being planned."""
        self._unsent.discard(request_id)

    def copy_on_write(self, req: SchedulerRequest) -> bool:
        """Before a child the worker has not seen writes into its last block: when that
        block is shared and partly filled, a fresh one in its place and the copy for the
        next step. False when no block is free for it."""
        if req.request_id not in self._unsent:
            return True
        pairs = self._kv.copy_on_write(req.request_id, req.num_computed_tokens)
        if pairs is None:
            return False
        if pairs:
            self._copies[req.request_id] = pairs
            self.num_cow_copies += len(pairs)
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies the next step carries; none are pending after."""
        copies = [pair for pairs in self._copies.values() for pair in pairs]
        self._copies = {}
        return copies

    def preempted(self, request_id: str) -> bool:
        """A running request is preempted: its copy does not go out (its target block goes
        back with its others). True when it is a child the worker has not seen, which
        must be recomputed (the worker holds nothing of it to swap)."""
        self._copies.pop(request_id, None)
        if request_id in self._unsent:
            self._unsent.discard(request_id)
            return True
        return False

    def forget(self, req: SchedulerRequest) -> None:
        """The request finished or was aborted."""
        self._copies.pop(req.request_id, None)
        self._unsent.discard(req.request_id)
        if req.parent_id is not None and (siblings := self._children.get(req.parent_id)):
            siblings.discard(req.request_id)
            if not siblings:
                del self._children[req.parent_id]

    def clear(self) -> None:
        """Every request left (drained): children re-route as requests of n == 1."""
        self._children, self._unsent, self._copies = {}, set(), {}

    def check_integrity(self, queues: RequestQueues) -> None:
        running = {req.request_id for req in queues.running}
        assert self._unsent <= running, f"unsent children not running: {self._unsent - running}"
        assert self._copies.keys() <= self._unsent, "a copy-on-write for a request already sent"
        for parent_id, children in self._children.items():
            assert children and all(child in queues for child in children), (
                f"parent {parent_id}: children {children} not all unfinished here")
