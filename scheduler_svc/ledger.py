"""Where every request the scheduler service holds is, from its stream entry to its end.

A request read from the stream is in exactly one place at a time:
  on a worker    routed: that worker's BatchScheduler holds it (`owner`);
  parked         no live worker yet: it waits in `unassigned` until one joins;
  in transit     being routed (after a worker joined, or re-routed after a worker loss):
                 taken out of `in_transit` one by one as it is routed; an abort meanwhile
                 takes it out first, so it is not routed at all.
Its stream entry id is kept until it is finished (or aborted, or given up on), then
acknowledged. A request of n > 1 has one entry, its parent's; its children
(`<id>/<i>`, proto/parallel.py) live on the parent's worker after the fork, or -- after a
worker loss -- one by one wherever each was routed, each owned and counted on its own.
Also kept: how often each request lost its worker, and aborts that overtook their request
(boundedly), so the request is dropped when it does arrive.
"""

from __future__ import annotations

from collections import OrderedDict
from types import MappingProxyType
from typing import TYPE_CHECKING, Union

from proto.messages import NewRequest
from proto.parallel import parent_request_id
from scheduler_svc.policy.request import SchedulerRequest

if TYPE_CHECKING:
    from scheduler_svc.worker_pool import WorkerHandle

# A request waiting for a worker: as read from the stream, or as drained from a lost worker.
Unrouted = Union[NewRequest, SchedulerRequest]


class RequestLedger:
    def __init__(self, max_early_aborts: int) -> None:
        self._entries: dict[str, bytes] = {}  # request id -> its stream entry, acked when done
        self._owner: dict[str, WorkerHandle] = {}  # request id -> the worker holding it
        self._unassigned: list[Unrouted] = []  # parked: waiting for a live worker
        self._in_transit: list[Unrouted] = []  # being routed
        self._losses: dict[str, int] = {}  # request id -> workers it lost
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._max_early_aborts = max_early_aborts

    # -- reading (views: change them through the methods below) -------------------------

    @property
    def entries(self) -> MappingProxyType[str, bytes]:
        return MappingProxyType(self._entries)

    @property
    def owners(self) -> MappingProxyType[str, WorkerHandle]:
        return MappingProxyType(self._owner)

    @property
    def unassigned(self) -> tuple[Unrouted, ...]:
        return tuple(self._unassigned)

    @property
    def in_transit(self) -> tuple[Unrouted, ...]:
        return tuple(self._in_transit)

    def is_early_abort(self, request_id: str) -> bool:
        return request_id in self._early_aborts

    # -- a stream entry ------------------------------------------------------------------

    def open(self, request_id: str, entry_id: bytes) -> None:
        """A NewRequest read from the stream, about to be routed."""
        self._entries[request_id] = entry_id

    def take_early_abort(self, request_id: str) -> bool:
        """True (and forgotten) when the request was aborted before it came."""
        if request_id not in self._early_aborts:
            return False
        del self._early_aborts[request_id]
        return True

    def close(self, request_id: str) -> bytes | None:
        """The request is done here: forgotten everywhere; its stream entry id, if it has
        one, to acknowledge."""
        self._owner.pop(request_id, None)
        self._losses.pop(request_id, None)
        return self._entries.pop(request_id, None)

    def remember_early_abort(self, request_id: str) -> None:
        """An abort of a request not seen yet (the gateway's XADD of it may still come)."""
        self._early_aborts[request_id] = None
        while len(self._early_aborts) > self._max_early_aborts:
            self._early_aborts.popitem(last=False)

    # -- where it is ---------------------------------------------------------------------

    def assign(self, request_id: str, handle: WorkerHandle) -> None:
        self._owner[request_id] = handle

    def lost_worker(self, request_id: str) -> int:
        """Its worker is gone (the request is being re-routed); how many workers it lost."""
        self._owner.pop(request_id, None)
        self._losses[request_id] = count = self._losses.get(request_id, 0) + 1
        return count

    def park(self, item: Unrouted) -> None:
        self._unassigned.append(item)

    def take_parked(self) -> list[Unrouted]:
        """Every parked request, to route now (a worker joined)."""
        parked, self._unassigned = self._unassigned, []
        return parked

    def start_transit(self, items: list[Unrouted]) -> None:
        self._in_transit.extend(items)

    def end_transit(self, item: Unrouted) -> bool:
        """Take `item` out of transit; False if it was not there (an abort took it)."""
        before = len(self._in_transit)
        self._in_transit = [r for r in self._in_transit if r is not item]
        return len(self._in_transit) < before

    # -- aborts and parallel sampling ----------------------------------------------------

    def take_unrouted(self, request_id: str) -> list[str]:
        """Take the request and its children (n > 1) out of `unassigned` and `in_transit`,
        so nothing routes them afterwards; their ids."""
        def hit(item: Unrouted) -> bool:
            return item.request_id == request_id or parent_request_id(item.request_id) == request_id
        gone = [item.request_id for item in (*self._unassigned, *self._in_transit) if hit(item)]
        if gone:
            self._unassigned = [item for item in self._unassigned if not hit(item)]
            self._in_transit = [item for item in self._in_transit if not hit(item)]
        return gone

    def assigned_children(self, parent_id: str) -> list[str]:
        """Children of `parent_id` routed one by one (after a worker loss) to some worker."""
        return [rid for rid in self._owner if parent_request_id(rid) == parent_id]

    def holders(self, request_id: str) -> list[WorkerHandle]:
        """Every worker that may hold the request: its own, its parent's (a forked child
        lives there) and its children's (each routed on its own), each once."""
        parent_id = parent_request_id(request_id)
        found = (self._owner.get(request_id), self._owner.get(parent_id) if parent_id else None,
                 *(self._owner[rid] for rid in self.assigned_children(request_id)))
        return list({id(h): h for h in found if h is not None}.values())

    def has_unrouted_children(self, parent_id: str) -> bool:
        """True while a child of `parent_id` is parked or in transit."""
        return any(parent_request_id(item.request_id) == parent_id
                   for item in (*self._unassigned, *self._in_transit))
