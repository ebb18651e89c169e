"""Parallel sampling, a mixin of BatchScheduler (scheduler_svc/batching.py), whose state
it reads and changes.

Parallel sampling (`NewRequest.n > 1`): the parent computes its prompt but the last token,
then (in `update`, once it has) forks into n children `f"{request_id}/{i}"` that share
every block (`KVCacheManager.fork`); the parent is forgotten (finished_request_ids) and
each child goes to the worker as a new request holding the shared table, with
`child_seed(seed, i)` when the parent had a seed (ids and seeds: proto/parallel.py). A
child's first step computes the last prompt token into its last block: when that block
is partly filled and still shared, the child gets a fresh block and the step carries the
copy (`blocks_to_copy`) -- all but the last child to get there copy; the last one keeps
the original. Aborting the parent's id aborts the parent before its fork and its
unfinished children after; a child's id aborts that child alone (before the fork there is
no such child yet and the abort is ignored: the gateway stops a choice only after its
first token).
"""

import bisect

import msgspec

from proto.parallel import child_request_id, child_seed
from scheduler_svc.request import RequestState, RequestStatus, by_sort_key


class ForkMixin:
    """BatchScheduler's forking of n > 1 parents into children, and their bookkeeping."""

    def _make_children(self, parent: RequestState) -> list[RequestState]:
        seed = parent.sampling.seed
        return [RequestState(
            request_id=child_request_id(parent.request_id, i), token_ids=list(parent.token_ids),
            num_prompt_tokens=parent.num_prompt_tokens,
            sampling=(parent.sampling if seed is None
                      else msgspec.structs.replace(parent.sampling, seed=child_seed(seed, i))),
            reply_channel=parent.reply_channel, arrival_time=parent.arrival_time,
            priority=parent.priority, num_computed_tokens=parent.num_computed_tokens,
            status=parent.status, block_hashes=list(parent.block_hashes),
            parent_id=parent.request_id) for i in range(parent.n)]

    def _fork(self, parent: RequestState) -> None:
        """Replace a running parent that computed all of its prompt but the last token by
        its n children, sharing its blocks; the worker forgets the parent."""
        pid = parent.request_id
        children = self._make_children(parent)
        self.running.remove(parent)
        del self._requests[pid]
        for child in children:
            self.kv.fork(pid, child.request_id)
            self._requests[child.request_id] = child
            self._unsent.add(child.request_id)
            bisect.insort(self.running, child, key=by_sort_key)
        self.kv.free(pid)
        self._children[pid] = {child.request_id for child in children}
        self._load_tokens += (len(children) - 1) * parent.num_tokens
        parent.status = RequestStatus.FINISHED
        self._finished_ids.append(pid)
        self.num_forks += len(children)

    def _forget_child(self, req: RequestState) -> None:
        if req.parent_id is not None and (siblings := self._children.get(req.parent_id)):
            siblings.discard(req.request_id)
            if not siblings:
                del self._children[req.parent_id]

    def has_children(self, parent_id: str) -> bool:
        """True while some child forked from `parent_id` is unfinished here."""
        return bool(self._children.get(parent_id))

