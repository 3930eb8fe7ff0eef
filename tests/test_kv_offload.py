"""The prefix cache's host tier (--kv-offloading-size): evicted pages saved to a bounded host pool,
restored on a prefix hit instead of recomputed; the bookkeeping alone (milliseconds), then a tiny
model end to end: the same greedy tokens and logprobs, prefill skipped, no leaked page."""

from __future__ import annotations

import pytest

from jaxserve.config import CacheConfig
from jaxserve.core.cache import KVCacheManager
from jaxserve.core.engine_factory import build_engine
from jaxserve.core.kv_offload import HostTier
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.errors import ConfigError
from jaxserve.executor.page_copies import PageCopies
from jaxserve.telemetry.metrics import ServerMetrics
from tests.test_cli import tiny_gguf
from tests.test_engine import assert_no_leaks


def _run(kv: KVCacheManager, req: Request) -> None:
    """Admit a request (restoring what the host holds), compute its prompt, free it."""
    kv.restore_prefix(req)
    cached = kv.lookup_prefix(req)
    assert kv.admit(req, cached, req.num_tokens - len(cached) * kv.page_size)
    req.num_computed_tokens = req.num_tokens
    kv.register_full_pages(req)
    kv.free(req)


def _flood(kv: KVCacheManager, n: int, base: int = 1000) -> None:
    for i in range(n):
        _run(kv, Request(f"flood{base + i}", list(range(base + 100 * i, base + 100 * i + 16))))


def test_evicted_pages_are_saved_and_a_hit_restores_them():
    kv = KVCacheManager(num_pages=9, page_size=4, host_tier=HostTier(16))  # 8 device pages
    prompt = list(range(13))  # 3 full pages + 1 token
    _run(kv, Request("a", prompt))
    assert kv.take_page_copies() == ()  # nothing evicted yet
    _flood(kv, 2)  # 8 pages of other prompts: a's 3 indexed pages are evicted...
    saved = kv.take_page_copies()
    assert [c.to_host for c in saved] == [True] and len(saved[0].pages) == 3  # ...and saved
    assert kv.host_tier.num_pages == 3 and kv.lookup_prefix(Request("a?", prompt)) == []
    again = Request("a2", prompt)
    assert kv.restore_prefix(again) == 3
    copies = kv.take_page_copies()
    loads = [c for c in copies if not c.to_host]
    assert len(loads) == 1 and sorted(loads[0].slots) == sorted(saved[0].slots)
    cached = kv.lookup_prefix(again)
    assert cached == list(loads[0].pages)  # the restored pages, in prefix order
    queries, hits = kv.host_tier_queries, kv.host_tier_hits
    assert hits == 0
    assert kv.admit(again, cached, 1)
    assert again.num_computed_tokens == 12
    assert (kv.host_tier_queries - queries, kv.host_tier_hits) == (12, 12)
    kv.free(again)
    kv.check_invariants()
    # A page held already is not copied again when the device evicts it a second time: of the 7
    # indexed pages on the device (a's 3, 4 of the flood's), only the flood's are copied.
    saved_before = kv.host_tier.pages_saved
    _flood(kv, 2, base=2000)
    assert kv.host_tier.pages_saved - saved_before == 4
    kv.check_invariants()


def test_pool_bound_least_recently_used_goes_and_salts_stay_apart():
    kv = KVCacheManager(num_pages=5, page_size=4, host_tier=HostTier(4))  # 4 device, 4 host
    first = list(range(9))  # 2 full pages
    _run(kv, Request("a", first, cache_salt="tenant:a"))
    _flood(kv, 3)  # 12 pages through a 4-page device pool: 10 saved into 4 slots
    kv.check_invariants()
    assert kv.host_tier.num_pages == kv.host_tier.num_slots == 4
    assert kv.host_tier.pages_saved == 2 + 12 - 4  # the last 4 floods' pages stay on device
    assert kv.restore_prefix(Request("a2", first, cache_salt="tenant:a")) == 0  # LRU dropped
    # The same tokens under another salt are another prefix, in every tier.
    kv2 = KVCacheManager(num_pages=5, page_size=4, host_tier=HostTier(4))
    _run(kv2, Request("a", first, cache_salt="tenant:a"))
    _flood(kv2, 1)
    assert kv2.restore_prefix(Request("b", first, cache_salt="tenant:b")) == 0
    assert kv2.restore_prefix(Request("a2", first, cache_salt="tenant:a")) == 2
    kv2.check_invariants()


def test_restoring_never_evicts_the_prefix_it_restores_and_copies_keep_their_order():
    kv = KVCacheManager(num_pages=5, page_size=4, host_tier=HostTier(8))  # 4 device pages
    prompt = list(range(13))  # 3 full pages + 1 token
    _run(kv, Request("a", prompt))
    _run(kv, Request("b", list(range(500, 508))))  # 2 pages: evicts a's tail (its end goes first)
    assert kv.host_tier.num_pages == 1 and len(kv.lookup_prefix(Request("x", prompt))) == 2
    kv.take_page_copies()
    assert kv.restore_prefix(Request("a2", prompt)) == 1
    # The one free page came from the flood's cached page (saved first), not from a's head.
    copies = kv.take_page_copies()
    assert [c.to_host for c in copies] == [True, False]
    assert copies[0].pages == copies[1].pages  # that page is saved before the restore fills it
    assert len(kv.lookup_prefix(Request("a3", prompt))) == 3
    kv.check_invariants()


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="kv_offloading_size"):
        CacheConfig(kv_offloading_size=-1)
    with pytest.raises(ConfigError, match="prefix cache"):
        CacheConfig(kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="at least one page"):
        HostTier(0)
    assert PageCopies(True, (1,), (0,)).to_host


# ---------------------------------------------------------------- a tiny model end to end

PAGE_BYTES = 2 * 16 * 4 * 8 * 4  # the tiny model: 2 layers, page 16, 2 KV heads x (K, V), 8, f32
HOST_PAGES = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_tokenizer_fields):
    path = tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", smollm2_tokenizer_fields)
    return build_engine(str(path), num_pages=9, max_num_seqs=1, max_num_batched_tokens=16,
                        min_token_bucket=16,
                        max_model_len=128, kv_offloading_size=HOST_PAGES * PAGE_BYTES / 2 ** 30,
                        strict_compile=True, progress=False)


def _generate(engine, request_id: str, prompt: list[int]):
    engine.add_request(request_id, {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def test_a_prefix_evicted_then_resent_is_restored_not_recomputed(engine):
    assert engine.runner.num_host_pages == HOST_PAGES
    prompt = [1000 + 7 * i for i in range(65)]  # 4 full pages + 1 token
    first = _generate(engine, "a", prompt)  # its 4 full pages (72 tokens computed) indexed
    # 8 usable pages: two other 5-page requests evict a's 4 pages (tail first) and one of the
    # first flood's; 5 saved into 4 slots, so the LRU dropped the first saved, a's tail.
    for i in range(2):
        _generate(engine, f"flood{i}", [3000 + 500 * i + j for j in range(65)])
    before = engine.stats()
    assert before.kv_offload_pages == HOST_PAGES
    assert before.kv_offload_bytes_to_host == 5 * PAGE_BYTES
    assert engine.scheduler.cache.lookup_prefix(Request("probe", prompt)) == []
    again = _generate(engine, "a2", prompt)
    after = engine.stats()
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    for x, y in zip(again.outputs[0].logprobs, first.outputs[0].logprobs):
        assert abs(x.logprob - y.logprob) < 1e-5
    assert after.kv_offload_hits - before.kv_offload_hits == 48  # 3 pages' prefill skipped
    assert again.num_cached_tokens == 48 and first.num_cached_tokens == 0
    assert after.kv_offload_bytes_to_device - before.kv_offload_bytes_to_device == 3 * PAGE_BYTES
    assert after.kv_offload_pages <= HOST_PAGES
    assert engine.runner.num_serving_compiles == 0
    assert_no_leaks(engine)
    text = ServerMetrics(lambda: {"tiny": [after]}).render().decode()
    samples = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("jaxserve:kv_offload")}
    assert samples["jaxserve:kv_offload_hits_total"] == 48
    assert samples["jaxserve:kv_offload_capacity_pages"] == HOST_PAGES
