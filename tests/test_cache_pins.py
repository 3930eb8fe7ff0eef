"""Prompt-cache pins (Anthropic's cache_control) in the host-side page pool and the scheduler:
a pin keeps its prefix through LRU pressure, expires lazily, holds its bounds, and stays within
its tenant's salt."""

from __future__ import annotations

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.cache import KVCacheManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler


def _run(kv: KVCacheManager, req: Request) -> None:
    """Admit a request, compute its whole prompt (pages indexed), and free it."""
    assert kv.admit(req, kv.lookup_prefix(req), req.num_tokens - len(kv.lookup_prefix(req)) * 4)
    req.num_computed_tokens = req.num_tokens
    kv.register_full_pages(req)


def _flood(kv: KVCacheManager, n: int, base: int = 1000) -> None:
    for i in range(n):
        r = Request(f"flood{i}", list(range(base + 100 * i, base + 100 * i + 16)))
        _run(kv, r)
        kv.free(r)


def test_pin_keeps_prefix_through_lru_pressure_and_unpinned_is_evicted():
    kv = KVCacheManager(num_pages=17, page_size=4, pin_pool_fraction=0.5)  # 16 usable
    pinned, plain = Request("p", list(range(9))), Request("q", list(range(500, 509)))
    for r in (pinned, plain):
        _run(kv, r)
    assert kv.pin(pinned, 8, 300, now=0) == 8  # 2 full pages, newly pinned
    kv.free(pinned)
    kv.free(plain)
    kv.check_invariants()
    _flood(kv, 8)  # 32 pages of other prompts through a 16-page pool
    kv.check_invariants()
    assert len(kv.lookup_prefix(Request("p2", list(range(9))))) == 2
    assert kv.lookup_prefix(Request("q2", list(range(500, 509)))) == []
    assert kv.num_pinned_pages == 2 and kv.num_pins == 1


def test_pin_expires_lazily_then_lru_evicts_and_renewal_extends():
    kv = KVCacheManager(num_pages=17, page_size=4, pin_pool_fraction=0.5)
    r = Request("p", list(range(9)))
    _run(kv, r)
    assert kv.pin(r, 8, 300, now=0) == 8
    assert kv.pin(r, 8, 3600, now=10) == 0  # same prefix: renewed, not a new pin
    assert kv.num_pins == 1 and kv.num_pinned_pages == 2
    kv.free(r)
    kv.expire_pins(now=301)  # the 1h renewal still holds it
    assert kv.num_pins == 1
    kv.expire_pins(now=3610)
    assert kv.num_pins == 0 and kv.num_pinned_pages == 0
    kv.check_invariants()
    assert len(kv.lookup_prefix(Request("p2", list(range(9))))) == 2  # cached, unpinned
    _flood(kv, 8)
    assert kv.lookup_prefix(Request("p3", list(range(9)))) == []
    kv.check_invariants()


def test_pool_bound_refuses_new_pin_and_tenant_bound_drops_its_oldest():
    kv = KVCacheManager(num_pages=17, page_size=4, pin_pool_fraction=0.25,
                        max_pins_per_salt=2)  # at most 4 pinned pages
    assert kv.max_pinned_pages == 4
    big = Request("big", list(range(21)), cache_salt="tenant:a")
    _run(kv, big)
    assert kv.pin(big, 20, 300, now=0) == 0  # 5 pages > 4: not made
    assert kv.num_pins == 0
    kv.free(big)
    reqs = [Request(f"a{i}", list(range(100 * i, 100 * i + 5)), cache_salt="tenant:a")
            for i in range(1, 4)]
    for r in reqs:
        _run(kv, r)
        assert kv.pin(r, 4, 300, now=0) == 4
        kv.free(r)
    assert kv.num_pins == 2  # the third dropped the tenant's oldest
    assert kv.lookup_prefix(Request("x", list(range(100, 105)), cache_salt="tenant:a")) != []
    _flood(kv, 8)
    assert kv.lookup_prefix(Request("y", list(range(100, 105)), cache_salt="tenant:a")) == []
    assert len(kv.lookup_prefix(Request("z", list(range(300, 305)), cache_salt="tenant:a"))) == 1
    other = Request("b", list(range(700, 705)), cache_salt="tenant:b")
    _run(kv, other)
    assert kv.pin(other, 4, 300, now=0) == 4  # another tenant's pin: its own count
    other2 = Request("b2", list(range(800, 813)), cache_salt="tenant:b")
    _run(kv, other2)
    assert kv.pin(other2, 12, 300, now=0) == 0  # 3 pinned + 3 > 4: refused, a's pins stay
    assert kv.num_pins == 3 and kv.num_pinned_pages == 3
    kv.free(other)
    kv.free(other2)
    kv.check_invariants()


def test_pins_are_per_salt():
    kv = KVCacheManager(num_pages=17, page_size=4, pin_pool_fraction=0.5)
    a = Request("a", list(range(9)), cache_salt="tenant:a")
    _run(kv, a)
    assert kv.pin(a, 8, 300, now=0) == 8
    kv.free(a)
    b = Request("b", list(range(9)), cache_salt="tenant:b")
    assert kv.lookup_prefix(b) == []  # a's pin does not serve b
    _run(kv, b)
    assert kv.pin(b, 8, 300, now=0) == 8  # b's own pin, not a renewal of a's
    kv.free(b)
    assert kv.num_pins == 2
    kv.check_invariants()


def test_scheduler_pins_once_computed_counts_creation_and_expires_on_its_step():
    now = [0.0]
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=64),
                      CacheConfig(page_size=4), num_pages=17, clock=lambda: now[0])
    r = Request("r", list(range(11)), max_tokens=1, cache_pins=((8, 300.0),))
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, [5])  # one logits row: the prompt's last token
    assert r.cache_pins == () and r.num_cache_creation_tokens == 8
    assert sched.cache.num_pins == 1
    sched.finish_request("r", RequestStatus.FINISHED_STOPPED)
    again = Request("s", list(range(11)), max_tokens=1, cache_pins=((8, 300.0),))
    sched.add_request(again)
    out = sched.schedule()
    sched.update_from_output(out, [5])
    assert again.num_cached_prompt_tokens == 8 and again.num_cache_creation_tokens == 0
    stats = sched.stats()
    assert (stats.num_pins, stats.pinned_pages, stats.pins_expired) == (1, 2, 0)
    now[0] = 301.0
    sched.schedule()
    assert sched.cache.num_pins == 0
    stats = sched.stats()
    assert (stats.num_pins, stats.pinned_pages, stats.pins_expired) == (0, 0, 1)
    sched.cache.check_invariants()


def test_pin_metrics():
    from jaxserve.core.engine import EngineStats
    from jaxserve.telemetry.metrics import ServerMetrics

    stats = EngineStats(0, 0, 2, 0, 16, 0, 0, 0, 0, 0, 0, {}, num_pins=1, pinned_pages=2,
                        pins_expired=3)
    text = ServerMetrics(lambda: {"tiny": [stats]}).render().decode()
    samples = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("jaxserve:kv_cache_pin")}
    assert samples == {"jaxserve:kv_cache_pins": 1, "jaxserve:kv_cache_pinned_pages": 2,
                       "jaxserve:kv_cache_pins_expired_total": 3}


def test_pins_give_way_to_a_request_that_cannot_start_on_an_idle_engine():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=64, enable_chunked_prefill=False),
                      CacheConfig(page_size=4), num_pages=17, clock=lambda: 0.0)
    kv = sched.cache  # 16 usable pages, at most 4 pinned
    for i in range(2):
        r = Request(f"p{i}", list(range(100 * i, 100 * i + 9)))
        _run(kv, r)
        assert kv.pin(r, 8, 3600, now=0) == 8
        kv.free(r)
    _flood(kv, 4)  # the cached-free pages: other prompts, not pinned
    big = Request("big", list(range(5000, 5050)), max_tokens=1)  # 13 pages > 16 - 4 pinned
    sched.add_request(big)
    out = sched.schedule()
    assert out is not None and big.status == RequestStatus.RUNNING
    assert kv.num_pins == 1  # only the oldest gave way
    assert len(kv.lookup_prefix(Request("p1again", list(range(100, 109))))) == 2
    kv.check_invariants()
