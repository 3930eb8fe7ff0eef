"""FairQueue: strict priority, start-time fair queuing by tokens among tenants, shedding order."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.fair_queue import FairQueue
from jaxserve.core.request import Request, RequestStatus, ServiceClass

_ids = itertools.count()


def req(tenant: str, prompt: int = 4, max_tokens: int = 4, weight: float = 1.0,
        priority: int = 0) -> Request:
    return Request(f"{tenant}-{next(_ids)}", [1] * prompt, tenant=tenant, weight=weight,
                   priority=priority, max_tokens=max_tokens)


def serve_next(q: FairQueue, used: int | None = None) -> Request:
    """Admit the next request and end it at once, having used `used` output tokens (default:
    all it reserved)."""
    r = q.peek()
    q.admit(r)
    r.output_token_ids = [0] * (r.max_tokens if used is None else used)
    r.status = RequestStatus.FINISHED_LENGTH
    q.settle(r)
    return r


def test_one_tenant_is_fcfs_and_priorities_are_strict():
    q = FairQueue()
    rs = [req("a", priority=p) for p in (1, 0, 0, -1, 1)]
    for r in rs:
        q.push(r)
    assert len(q) == 5 and rs[2] in q
    order = [serve_next(q) for _ in range(5)]
    assert order == [rs[3], rs[1], rs[2], rs[0], rs[4]]
    assert not q and q.peek() is None


def test_a_preempted_request_goes_back_to_the_front_and_is_charged_once():
    q = FairQueue()
    a1, a2, b1 = req("a"), req("a"), req("b")
    for r in (a1, a2, b1):
        q.push(r)
    q.admit(a1)
    a1.status = RequestStatus.PREEMPTED
    q.push_front(a1)  # preempted: its old start tag (0) puts it before b1 (tag 0, later arrival)
    assert q.peek() is a1
    q.admit(a1)
    assert q.peek() is b1  # a's next request waits for its share: a1 was charged once, not twice


def test_settling_refunds_unused_tokens():
    # a reserves 4 + 60 but uses 4 + 1: after settling, it is not held back for 60 tokens.
    q = FairQueue()
    for _ in range(3):
        q.push(req("a", max_tokens=60))
        q.push(req("b", max_tokens=4))
    served = [serve_next(q, used=1 if q.peek().tenant == "a" else None).tenant
              for _ in range(6)]
    assert served == ["a", "b", "a", "b", "a", "b"]
    q2 = FairQueue()  # without settling (all 60 used), b goes twice for each a
    for _ in range(3):
        q2.push(req("a", max_tokens=60))
    for _ in range(6):
        q2.push(req("b", max_tokens=4))
    assert [serve_next(q2).tenant for _ in range(4)] == ["a", "b", "b", "b"]


def test_a_flood_does_not_delay_another_tenant_beyond_its_share():
    """However many requests tenant a has queued, b's new request is the next to start."""
    for flood in (20, 1000):
        q = FairQueue()
        for _ in range(flood):
            q.push(req("a"))
        for _ in range(3):
            serve_next(q)
        b = req("b")
        q.push(b)
        assert q.peek() is b
        serve_next(q)
        # b is idle again; a keeps the server, and b's next request again goes first.
        assert all(serve_next(q).tenant == "a" for _ in range(5))
        b2 = req("b")
        q.push(b2)
        assert q.peek() is b2
        # ...but an idle tenant banks no credit (its tag starts at V): with more of b queued,
        # a and b alternate instead of b taking the server until it catches up.
        for _ in range(3):
            q.push(req("b"))
        assert [serve_next(q).tenant for _ in range(6)] == ["b", "a", "b", "a", "b", "a"]


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.integers(1, 5), min_size=2, max_size=4),
       sizes=st.lists(st.tuples(st.integers(1, 16), st.integers(0, 16)), min_size=8, max_size=8),
       used=st.lists(st.floats(0, 1), min_size=8, max_size=8))
def test_backlogged_tenants_get_tokens_in_the_ratio_of_their_weights(weights, sizes, used):
    """SFQ's fairness bound, at every point while all tenants are backlogged: the served tokens
    W_i (prompt + outputs used, after settling) satisfy |W_i/w_i - W_j/w_j| <= l_i/w_i + l_j/w_j
    (l: the largest request). So the shares converge to the weight ratio."""
    q = FairQueue()
    tenants = [f"t{i}" for i in range(len(weights))]
    per_tenant = 40
    for k in range(per_tenant):  # interleaved arrivals, request sizes cycling per tenant
        for i, t in enumerate(tenants):
            prompt, out = sizes[(k + i) % len(sizes)]
            q.push(req(t, prompt, out, weights[i]))
    largest = max(p + o for p, o in sizes)
    served = dict.fromkeys(tenants, 0)
    left = dict.fromkeys(tenants, per_tenant)
    n = 0
    while all(left.values()):
        r = q.peek()
        k = n % len(used)
        serve_next(q, used=int(used[k] * r.max_tokens))
        served[r.tenant] += r.num_tokens
        left[r.tenant] -= 1
        n += 1
        for i, j in itertools.combinations(range(len(tenants)), 2):
            gap = abs(served[tenants[i]] / weights[i] - served[tenants[j]] / weights[j])
            assert gap <= largest / weights[i] + largest / weights[j] + 1e-9, (served, n)
    total, wsum = sum(served.values()), sum(weights)
    for i, t in enumerate(tenants):  # and the shares at the end, for the record
        assert abs(served[t] / total - weights[i] / wsum) <= 2 * len(tenants) * largest / total


def test_shed_order_lowest_class_then_over_share_tenant_then_newest():
    q = FairQueue()
    B, S, I = ServiceClass.BATCH, ServiceClass.STANDARD, ServiceClass.INTERACTIVE
    light = [req("light", priority=B, weight=4) for _ in range(3)]  # 3 / 4: within its share
    heavy = [req("heavy", priority=B) for _ in range(3)]  # 3 / 1: over it
    std = [req("std", priority=S) for _ in range(2)]
    inter = [req("inter", priority=I)]
    for r in light + heavy + std + inter:
        q.push(r)
    started = std[0]
    q.admit(started)
    started.status = RequestStatus.PREEMPTED
    q.push_front(started)  # started once: never shed
    assert list(q.shed_order(I)) == heavy[::-1] + light[::-1] + std[1:]
    assert list(q.shed_order(S)) == heavy[::-1] + light[::-1]
    assert list(q.shed_order(B)) == []
    assert q.num_new_by_priority() == {B: 6, S: 1, I: 1}
    for r in list(q):
        q.remove(r)
        r.status = RequestStatus.FINISHED_SHED
        q.settle(r)
    assert not q and q.num_new_by_priority() == {}


def test_admission_pass_passes_over_a_tenant_for_one_pass():
    q = FairQueue()
    a1, a2, b1 = req("a"), req("a"), req("b")
    for r in (a1, a2, b1):
        q.push(r)
    seen = []
    with q.admission_pass() as order:
        for r in order:
            seen.append(r)
            if r.tenant == "a":
                order.pass_over(r)
            else:
                order.admit(r)
    assert seen == [a1, b1]
    assert q.peek() is a1  # a keeps its place for the next pass
