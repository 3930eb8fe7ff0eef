"""Page pool and prefix cache: refcounts, eviction order, hit verification, and a random-operation
property test against a model of what each page holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core import cache as cache_mod
from jaxserve.executor.batch_plan import NULL_PAGE
from jaxserve.core.cache import KVCacheManager
from jaxserve.errors import ConfigError
from jaxserve.core.request import Request


def _computed(kv: KVCacheManager, req: Request, n: int) -> None:
    """What the runner + scheduler do after a step: n more tokens are in the cache."""
    req.num_computed_tokens += n
    kv.register_full_pages(req)


def test_null_page_is_never_handed_out_and_pool_fills_exactly():
    kv = KVCacheManager(num_pages=5, page_size=4)
    r = Request("a", list(range(16)))
    assert kv.admit(r, [], 16)
    assert sorted(r.page_table) == [1, 2, 3, 4] and NULL_PAGE not in r.page_table
    assert kv.num_free_pages == 0 and kv.num_pages_in_use == 4
    kv.check_invariants()
    with pytest.raises(ConfigError):
        KVCacheManager(num_pages=1, page_size=4)


def test_failed_allocation_leaves_no_partial_state():
    kv = KVCacheManager(num_pages=4, page_size=4)  # 3 usable pages
    a, b = Request("a", list(range(8))), Request("b", list(range(100, 108)))
    assert kv.admit(a, [], 8)
    assert not kv.admit(b, [], 8)
    assert b.page_table == [] and b.num_computed_tokens == 0
    _computed(kv, a, 8)
    a.output_token_ids.append(7)
    assert kv.allocate(a, 1) and len(a.page_table) == 3
    a.output_token_ids.extend(range(4))
    _computed(kv, a, 1)
    before = list(a.page_table)
    assert not kv.allocate(a, 4)  # needs a 4th page
    assert a.page_table == before
    kv.check_invariants()
    kv.free(a)
    assert kv.num_pages_in_use == 0 and kv.num_free_pages == 3
    kv.check_invariants()


def test_prefix_hit_shares_pages_and_never_covers_the_whole_sequence():
    kv = KVCacheManager(num_pages=16, page_size=4)
    a = Request("a", list(range(12)))
    assert kv.admit(a, kv.lookup_prefix(a), 12)
    _computed(kv, a, 12)
    # Same 12 tokens: only 2 of the 3 full pages may be reused, the last token must be computed.
    b = Request("b", list(range(12)))
    hits = kv.lookup_prefix(b)
    assert hits == a.page_table[:2]
    assert kv.admit(b, hits, 4)
    assert b.num_computed_tokens == 8 and b.page_table[:2] == a.page_table[:2]
    assert b.page_table[2] != a.page_table[2]
    kv.check_invariants()
    # A longer prompt with the same beginning reuses all three pages.
    c = Request("c", list(range(12)) + [99])
    assert kv.lookup_prefix(c) == a.page_table
    # A different first page breaks the chain even if later pages have equal tokens.
    d = Request("d", [50] + list(range(1, 12)) + [99])
    assert kv.lookup_prefix(d) == []
    assert kv.prefix_cache_queries == 24 and kv.prefix_cache_hits == 8


def test_pages_are_shared_only_under_the_same_cache_salt():
    from jaxserve.gateway.deadlines import request_qos
    from jaxserve.gateway.tenants import Tenant

    kv = KVCacheManager(num_pages=16, page_size=4)
    a = Request("a", list(range(12)), cache_salt="tenant:acme")
    assert kv.admit(a, kv.lookup_prefix(a), 12)
    _computed(kv, a, 12)
    assert kv.lookup_prefix(Request("b", list(range(13)), cache_salt="tenant:evil")) == []
    assert kv.lookup_prefix(Request("c", list(range(13)))) == []
    assert kv.lookup_prefix(Request("d", list(range(13)), cache_salt="tenant:acme")) \
        == a.page_table
    salts = {request_qos(t, 0.0).cache_salt for t in (
        Tenant("acme"), Tenant("x", cache_sharing_group="org"),
        Tenant("y", cache_sharing_group="org"))}
    assert salts == {"tenant:acme", "group:org"}


def test_hash_collision_is_caught_by_token_comparison(monkeypatch):
    monkeypatch.setattr(cache_mod, "hash_page", lambda parent, tokens: b"same")
    kv = KVCacheManager(num_pages=8, page_size=2)
    a = Request("a", [1, 2, 3])
    assert kv.admit(a, [], 3)
    _computed(kv, a, 3)
    assert kv.lookup_prefix(Request("b", [1, 2, 9])) == a.page_table[:1]
    assert kv.lookup_prefix(Request("c", [7, 7, 9])) == []


def test_freed_prefix_stays_cached_until_the_free_list_runs_out_then_lru_tail_first():
    kv = KVCacheManager(num_pages=7, page_size=2)  # 6 usable pages
    a = Request("a", [1, 2, 3, 4, 5, 6, 7])
    assert kv.admit(a, [], 7)  # 4 pages, 3 full after compute
    _computed(kv, a, 7)
    pa = list(a.page_table)
    kv.free(a)
    assert kv.num_cached_free_pages == 3 and kv.num_pages_in_use == 0
    kv.check_invariants()
    # Taking the two never-cached free pages plus the partial page evicts nothing...
    b = Request("b", [9] * 6)
    assert kv.admit(b, [], 6)
    assert set(b.page_table).isdisjoint(pa[:3])
    assert kv.lookup_prefix(Request("a2", a.prompt_token_ids)) == pa[:3]
    # ...the next page evicts the LRU cached page: the tail of a's prefix, not its head.
    c = Request("c", [8, 8])
    assert kv.admit(c, [], 2)
    assert c.page_table == [pa[2]]
    assert kv.lookup_prefix(Request("a3", a.prompt_token_ids)) == pa[:2]
    kv.check_invariants()


def test_taking_a_cached_free_page_counts_against_room():
    kv = KVCacheManager(num_pages=4, page_size=2)  # 3 usable
    a = Request("a", [1, 2, 3])
    assert kv.admit(a, [], 3)
    _computed(kv, a, 3)
    kv.free(a)  # 1 cached-free page, 2 free
    b = Request("b", [1, 2, 3, 4, 5, 6, 7])
    hits = kv.lookup_prefix(b)
    assert len(hits) == 1
    assert kv.num_allocatable_tokens(b, hits) == 4  # 3 pages hold 6 tokens, 2 already cached
    assert not kv.admit(b, hits, 5)
    assert kv.admit(b, hits, 4) and b.num_computed_tokens == 2
    kv.check_invariants()


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_pages=8, page_size=2, enable_prefix_caching=False)
    a = Request("a", [1, 2, 3, 4, 5])
    assert kv.admit(a, kv.lookup_prefix(a), 5)
    _computed(kv, a, 5)
    kv.free(a)
    assert kv.lookup_prefix(Request("b", [1, 2, 3, 4, 5])) == []
    assert kv.num_cached_free_pages == 0 and kv.num_free_pages == 7
    kv.check_invariants()


@settings(max_examples=150, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(2, 12), prefix=st.booleans(),
       data=st.data())
def test_random_operations_keep_invariants_and_hits_hold_the_right_tokens(page_size, num_pages,
                                                                          prefix, data):
    """Random admit / compute / sample / free sequences. A model of the KV content (which token
    each slot holds, written when computed) checks that every prefix hit hands back pages whose
    content is exactly the request's tokens, i.e. that eviction and reuse never leave a stale
    index entry."""
    kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=prefix)
    content: dict[int, dict[int, int]] = {}  # page -> offset -> token id
    live: list[Request] = []
    # A small alphabet and few prefixes so that prompts share pages.
    stems = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9, 9], [5, 5, 5, 5, 5]]

    def compute(r: Request, n: int) -> None:
        tokens = r.all_token_ids
        for pos in range(r.num_computed_tokens, r.num_computed_tokens + n):
            page = r.page_table[pos // page_size]
            content.setdefault(page, {})[pos % page_size] = tokens[pos]
        _computed(kv, r, n)

    for step in range(data.draw(st.integers(1, 40), label="num_ops")):
        op = data.draw(st.sampled_from(["admit", "compute", "sample", "free"]) if live
                       else st.just("admit"))
        if op == "admit":
            stem = data.draw(st.sampled_from(stems))
            tail = data.draw(st.lists(st.integers(0, 9), max_size=6))
            r = Request(f"r{step}", stem[:data.draw(st.integers(1, len(stem)))] + tail)
            hits = kv.lookup_prefix(r)
            assert len(hits) * page_size < r.num_tokens
            for i, page in enumerate(hits):
                want = r.all_token_ids[i * page_size:(i + 1) * page_size]
                assert [content[page][o] for o in range(page_size)] == want
            n = data.draw(st.integers(1, r.num_tokens - len(hits) * page_size))
            room = kv.num_allocatable_tokens(r, hits)
            ok = kv.admit(r, hits, n)
            assert ok == (n <= room)
            if ok:
                live.append(r)
            else:
                assert r.page_table == [] and r.num_computed_tokens == 0
        else:
            r = data.draw(st.sampled_from(live))
            covered = len(r.page_table) * page_size - r.num_computed_tokens
            todo = r.num_tokens - r.num_computed_tokens
            if op == "compute" and min(covered, todo) > 0:
                compute(r, data.draw(st.integers(1, min(covered, todo))))
            elif op == "sample" and todo == 0:
                r.output_token_ids.append(data.draw(st.integers(0, 9)))
                before = list(r.page_table)
                if not kv.allocate(r, 1):
                    assert r.page_table == before
            elif op == "free":
                kv.free(r)
                live.remove(r)
        kv.check_invariants()
        assert kv.num_pages_in_use == len({p for r in live for p in r.page_table})
    for r in live:
        kv.free(r)
    kv.check_invariants()
    assert kv.num_pages_in_use == 0 and kv.num_free_pages == num_pages - 1
