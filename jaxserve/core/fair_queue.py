"""The scheduler's waiting requests, in service order (plain Python, no JAX).

Strict priority levels first (lower value first: see `jaxserve.core.request.ServiceClass`). Within a
level, the tenants share by tokens with start-time fair queuing (SFQ; Goyal, Vin and Cheng,
SIGCOMM 1996): each tenant has a FIFO queue; a tenant's head request gets the start tag
S = max(V, F), where F is the finish tag of the tenant's previous request and V the level's virtual
time (the start tag of the last request admitted); the head with the smallest S goes next, and
admitting it charges its tokens, F = S + tokens / weight. Why SFQ and not deficit round robin: the
tags need no quantum to tune, a tenant that was idle starts at V, so it goes next whatever the
others have queued (a flood raises nobody else's wait beyond its share), and a request's cost
may be corrected after the fact by moving F, which is what a token reservation needs:
admission charges prompt + max_tokens, and the request's end settles the charge to the tokens it
really used (`settle`).

Costs: O(log T) per push, admission and removal (T: tenants waiting at that level), O(log L) for
the level (L: distinct priorities waiting), whatever the queue's length. A preempted request goes
back to the front of its tenant's queue with its original tag (it is not charged twice), so it
resumes before the tenant's later requests.

Shedding (`shed_order`): the never-started requests of levels less important than the
newcomer's, least important level first; within a level, tenants most over their share first
(queued requests / weight, largest first); within a tenant, the newest first.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Iterator

from sortedcontainers import SortedDict

from jaxserve.core.request import Request, RequestStatus


class _TenantQueue:
    __slots__ = ("tenant", "level", "requests", "finish", "weight", "num_charged", "num_new",
                 "version")

    def __init__(self, tenant: str, level: "_Level", weight: float):
        self.tenant = tenant
        self.level = level
        self.requests: OrderedDict[str, Request] = OrderedDict()  # FIFO, head first
        self.finish = 0.0  # F: finish tag of the last charged request
        self.weight = weight  # the latest request's (the tenants file may change)
        self.num_charged = 0  # admitted requests whose charge is not settled yet
        self.num_new = 0  # waiting requests never admitted (the ones that may be shed)
        self.version = 0  # bumps when the head or its tag changes: older heap entries are stale


class _Level:
    __slots__ = ("priority", "vtime", "tenants", "heap", "num_waiting", "num_new")

    def __init__(self, priority: int):
        self.priority = priority
        self.vtime = 0.0  # V
        self.tenants: dict[str, _TenantQueue] = {}
        self.heap: list[tuple[float, int, int, _TenantQueue]] = []  # (S, arrival, version, queue)
        self.num_waiting = 0
        self.num_new = 0


class FairQueue:
    def __init__(self):
        self._levels: SortedDict[int, _Level] = SortedDict()
        self._queue_of: dict[str, _TenantQueue] = {}  # waiting request id -> its tenant queue
        self._arrival: dict[str, int] = {}  # request id -> arrival order (tie-break), while live
        self._charges: dict[str, tuple[_TenantQueue, float, int]] = {}  # id -> (queue, S, tokens)
        self._count = itertools.count()

    # ---- contents ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._queue_of)

    def __bool__(self) -> bool:
        return bool(self._queue_of)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._queue_of

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, level by level (not in service order within a level)."""
        for level in self._levels.values():
            for tq in level.tenants.values():
                yield from tq.requests.values()

    def num_new_by_priority(self) -> dict[int, int]:
        """Waiting requests never admitted, per priority: the ones `shed_order` may pick."""
        return {p: lv.num_new for p, lv in self._levels.items() if lv.num_new}

    # ---- in and out --------------------------------------------------------------------------

    def push(self, request: Request) -> None:
        """A new request, at the back of its tenant's queue."""
        self._arrival[request.request_id] = next(self._count)
        self._insert(request, front=False)

    def push_front(self, request: Request) -> None:
        """A preempted request, back at the front of its tenant's queue with its old tag."""
        self._insert(request, front=True)

    def remove(self, request: Request) -> None:
        """Take a waiting request out (it ended while queued). Settle separately."""
        self._detach(request, new=request.request_id not in self._charges)

    def admit(self, request: Request) -> None:
        """The head of its tenant's queue starts: charge it on its first admission."""
        rid = request.request_id
        tq = self._queue_of[rid]
        assert next(iter(tq.requests)) == rid, "only a tenant's head is admitted"
        start = self._head_tag(tq)
        new = rid not in self._charges
        if new:
            tokens = request.num_prompt_tokens + (request.max_tokens or 0)
            self._charges[rid] = (tq, start, tokens)
            tq.finish = start + tokens / request.weight
            tq.num_charged += 1
        tq.level.vtime = max(tq.level.vtime, start)
        self._detach(request, new)

    def settle(self, request: Request) -> None:
        """The request ended: its charge becomes the tokens it used (prompt + outputs)."""
        self._arrival.pop(request.request_id, None)
        entry = self._charges.pop(request.request_id, None)
        if entry is None:
            return
        tq, _, charged = entry
        tq.finish += (request.num_tokens - charged) / request.weight
        tq.num_charged -= 1
        if tq.requests and next(iter(tq.requests.values())).request_id not in self._charges:
            self._retag(tq)  # its head's tag derives from F
        self._tidy(tq)

    # ---- order -------------------------------------------------------------------------------

    def peek(self) -> Request | None:
        """The next request in service order."""
        for level in self._levels.values():
            tq = self._top(level)
            if tq is not None:
                return next(iter(tq.requests.values()))
        return None

    def admission_pass(self) -> "AdmissionPass":
        return AdmissionPass(self)

    def shed_order(self, below: int) -> Iterator[Request]:
        """Never-started requests of priorities after `below`, in the order to shed them. Do not
        change the queue while iterating."""
        for priority in reversed(self._levels.keys()):
            if priority <= below:
                return
            level = self._levels[priority]
            for tq in sorted(level.tenants.values(), key=lambda q: -q.num_new / q.weight):
                for request in reversed(tq.requests.values()):
                    if request.status == RequestStatus.WAITING:
                        yield request

    # ---- internals ---------------------------------------------------------------------------

    def _insert(self, request: Request, front: bool) -> None:
        level = self._levels.get(request.priority)
        if level is None:
            level = self._levels[request.priority] = _Level(request.priority)
        tq = level.tenants.get(request.tenant)
        if tq is None:
            tq = level.tenants[request.tenant] = _TenantQueue(request.tenant, level,
                                                              request.weight)
        tq.weight = request.weight
        rid = request.request_id
        tq.requests[rid] = request
        if front:
            tq.requests.move_to_end(rid, last=False)
        self._queue_of[rid] = tq
        level.num_waiting += 1
        if rid not in self._charges:
            tq.num_new += 1
            level.num_new += 1
        if front or len(tq.requests) == 1:
            self._retag(tq)

    def _detach(self, request: Request, new: bool) -> None:
        tq = self._queue_of.pop(request.request_id)
        was_head = next(iter(tq.requests)) == request.request_id
        del tq.requests[request.request_id]
        tq.level.num_waiting -= 1
        if new:
            tq.num_new -= 1
            tq.level.num_new -= 1
        if was_head:
            self._retag(tq)
        self._tidy(tq)

    def _head_tag(self, tq: _TenantQueue) -> float:
        head = next(iter(tq.requests))
        charge = self._charges.get(head)
        return charge[1] if charge is not None else max(tq.level.vtime, tq.finish)

    def _retag(self, tq: _TenantQueue) -> None:
        tq.version += 1
        if tq.requests:
            level = tq.level
            heapq.heappush(level.heap, (self._head_tag(tq), self._arrival[next(iter(tq.requests))],
                                        tq.version, tq))
            if len(level.heap) > 2 * len(level.tenants) + 16:  # stale entries: rebuild
                level.heap = [e for e in level.heap if e[2] == e[3].version and e[3].requests]
                heapq.heapify(level.heap)

    @staticmethod
    def _top(level: _Level) -> _TenantQueue | None:
        """The level's tenant queue whose head goes next (stale heap entries are dropped)."""
        heap = level.heap
        while heap:
            _, _, version, tq = heap[0]
            if version == tq.version and tq.requests:
                return tq
            heapq.heappop(heap)
        return None

    def _tidy(self, tq: _TenantQueue) -> None:
        """Forget what no longer matters: idle tenants at or behind V, an empty level."""
        level = tq.level
        idle = [tq]
        if not level.num_waiting:
            # Idle level (SFQ): V moves to the largest finish tag, so past use stops counting
            # against anyone once nobody waits.
            level.vtime = max([level.vtime] + [q.finish for q in level.tenants.values()])
            idle = list(level.tenants.values())
        for q in idle:
            if not q.requests and not q.num_charged and q.finish <= level.vtime:
                del level.tenants[q.tenant]
        if not level.tenants:
            del self._levels[level.priority]


class AdmissionPass:
    """One step's walk through the queue in service order, used as a context manager. For each
    request it yields, the caller calls `admit` (it starts; its tenant's next request may follow),
    `pass_over` (its tenant waits for this step) or `FairQueue.remove` (it ended), or stops."""

    def __init__(self, queue: FairQueue):
        self._queue = queue
        self._passed: set[int] = set()
        self._popped: list[tuple[_Level, tuple]] = []

    def __enter__(self) -> "AdmissionPass":
        return self

    def __exit__(self, *exc) -> None:
        for level, entry in self._popped:  # passed-over tenants keep their place
            heapq.heappush(level.heap, entry)
        self._popped = []

    def __iter__(self) -> Iterator[Request]:
        while (request := self._next()) is not None:
            yield request

    def admit(self, request: Request) -> None:
        self._queue.admit(request)

    def pass_over(self, request: Request) -> None:
        self._passed.add(id(self._queue._queue_of[request.request_id]))

    def _next(self) -> Request | None:
        for level in self._queue._levels.values():
            while (tq := FairQueue._top(level)) is not None:
                if id(tq) not in self._passed:
                    return next(iter(tq.requests.values()))
                self._popped.append((level, heapq.heappop(level.heap)))
        return None
