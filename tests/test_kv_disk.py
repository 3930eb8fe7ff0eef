"""The prefix cache's disk tier (--kv-offloading-disk-path/-size): pages the host tier overwrites
go to checked files and come back on a hit. The bookkeeping with the copies run on numpy pools
(each page holds its own token ids, so a page restored wrong shows), the directory's rules, then
a tiny model end to end: a host tier of one page, the prefix read back from disk, the same greedy
tokens and logprobs as its first computation; corrupt files are misses."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.cache import KVCacheManager, extend_page_hashes
from jaxserve.core.engine_factory import build_engine
from jaxserve.core.kv_disk import DiskTier, num_disk_files, open_directory
from jaxserve.core.kv_offload import HostTier
from jaxserve.core.kv_transfer import export_prefix, import_prefix
from jaxserve.core.request import QoS, Request
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.errors import ConfigError
from jaxserve.executor.kv_files import SUFFIX, file_bytes, write_page
from jaxserve.executor.page_copies import DiskLoads, DiskWrites
from jaxserve.telemetry.metrics import ServerMetrics
from tests.test_cli import tiny_gguf
from tests.test_engine import assert_no_leaks
from tests.test_kv_offload import _generate

PS = 4  # tokens per page in the bookkeeping tests


class Pools:
    """A device pool and host slots of token ids, and the copies run as the executor runs them."""

    def __init__(self, kv: KVCacheManager, num_slots: int):
        self.kv = kv
        self.device = np.full((kv.num_usable_pages + 1, PS), -1, np.int64)
        self.host = np.full((num_slots, PS), -1, np.int64)

    def run(self, req: Request) -> int:
        """Admit (restoring what the tiers hold), check the cached pages hold the prompt, compute
        the rest, free; the tokens restored."""
        restored = self.kv.restore_prefix(req)
        self.copies()
        cached = self.kv.lookup_prefix(req)
        for i, page in enumerate(cached):
            assert list(self.device[page]) == req.prompt_token_ids[i * PS:(i + 1) * PS]
        assert self.kv.admit(req, cached, req.num_tokens - len(cached) * PS)
        self.copies()  # before the "forward" writes the pages admit took (evicted: saved first)
        for i, page in enumerate(req.page_table):
            self.device[page, :] = -1
            chunk = req.prompt_token_ids[i * PS:(i + 1) * PS]
            self.device[page, :len(chunk)] = chunk
        req.num_computed_tokens = req.num_tokens
        self.kv.register_full_pages(req)
        self.kv.free(req)
        return restored * PS

    def copies(self, runs=None) -> None:
        """Run these copies (default: those the cache holds for the next step)."""
        for run in self.kv.take_page_copies() if runs is None else runs:
            if isinstance(run, DiskWrites):  # queued for the worker, as the executor does
                for slot, path, h, tokens in run.pages():
                    run.io.write(path, h, tokens, self.host[slot].copy())
            elif isinstance(run, DiskLoads):
                for page, data in zip(*run):
                    self.device[page] = np.frombuffer(data, np.int64)
            elif run.to_host:
                self.host[list(run.slots)] = self.device[list(run.pages)]
            else:
                self.device[list(run.pages)] = self.host[list(run.slots)]


def _manager(tmp_path, device_pages=4, host=2, files=24):
    disk = DiskTier(str(tmp_path), files, PS * 8, lock=open_directory(str(tmp_path)))
    kv = KVCacheManager(num_pages=device_pages + 1, page_size=PS,
                        host_tier=HostTier(host, disk))
    return Pools(kv, host), disk


def _flood(pools: Pools, n: int, base: int = 1000) -> None:
    for i in range(n):
        pools.run(Request(f"f{base + i}", list(range(base + 100 * i, base + 100 * i + 2 * PS))))


def test_pages_spill_to_disk_and_come_back_intact_salts_apart(tmp_path):
    pools, disk = _manager(tmp_path)
    prompt = list(range(13))  # 3 full pages + 1 token
    assert pools.run(Request("a", prompt, cache_salt="t:a")) == 0
    _flood(pools, 4)  # 8 pages through 4 device pages and 2 host slots: a's pages reach disk
    disk.io.flush()
    assert disk.num_pages >= 3 and disk.pages_written == disk.num_pages
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(SUFFIX))
    assert len(files) == disk.num_pages
    assert all(stat.S_IMODE(os.stat(tmp_path / f).st_mode) == 0o600 for f in files)
    # Another tenant's same tokens are another prefix on disk too.
    assert pools.run(Request("b", prompt, cache_salt="t:b")) == 0
    pools.kv.check_invariants()
    _flood(pools, 4, base=5000)
    assert pools.run(Request("a2", prompt, cache_salt="t:a")) == 12  # Pools.run checked them
    assert pools.kv.disk_tier_hits >= 8
    pools.kv.check_invariants()


def test_corrupt_partial_and_missing_files_are_misses_and_the_bound_holds(tmp_path):
    pools, disk = _manager(tmp_path, files=3)
    prompts = [list(range(s, s + 9)) for s in (0, 100, 200)]  # 2 full pages each
    for i, p in enumerate(prompts):
        pools.run(Request(f"p{i}", p))
    _flood(pools, 2)  # 10 pages: 4 on the device, 2 in host slots, 4 spilled into 3 files
    disk.io.flush()
    assert disk.pages_written == 4
    assert disk.num_pages == 3 and len(os.listdir(tmp_path)) == 3 + 1  # the marker
    names = sorted(f for f in os.listdir(tmp_path) if f.endswith(SUFFIX))
    for i, name in enumerate(names):  # every file damaged, one way or another
        path = tmp_path / name
        data = path.read_bytes()
        if i % 3 == 0:
            path.write_bytes(data[:-5])  # partial
        elif i % 3 == 1:
            path.write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])  # a flipped bit
        else:
            path.unlink()
    for i, p in enumerate(prompts):
        pools.run(Request(f"again{i}", p))  # Pools.run checks any page it gets
    assert disk.bad_files >= 2  # read, refused, dropped
    disk.io.flush()
    assert not set(names) & set(os.listdir(tmp_path)) - {names[2]}  # (names[2] was unlinked)
    assert disk.num_pages <= 3
    pools.kv.check_invariants()


def test_pages_put_overwrites_go_to_disk_and_come_back_intact(tmp_path):
    """A transfer's pages (HostTier.put, jaxserve.core.kv_transfer) past the host tier's slots
    are spilled: the caller runs the copies (the file written from the slot's page) before it
    fills the slot, as import_prefix does."""
    pools, disk = _manager(tmp_path, device_pages=8)
    prompt = list(range(500, 521))  # 5 full pages + 1 token
    hashes = extend_page_hashes([], prompt, PS, 5, "t:x")
    for i in reversed(range(5)):  # tail first, as import_prefix puts them
        slot = pools.kv.host_tier.put(hashes[i], tuple(prompt[i * PS:(i + 1) * PS]))
        pools.copies()
        pools.host[slot] = prompt[i * PS:(i + 1) * PS]
    disk.io.flush()
    assert disk.pages_written == 3 and pools.kv.host_tier.num_pages == 2
    assert pools.run(Request("x", prompt, cache_salt="t:x")) == 20  # Pools.run checked them
    assert pools.kv.disk_tier_hits == 12
    pools.kv.check_invariants()


def test_a_waiting_requests_disk_pages_are_read_ahead_and_checked(tmp_path):
    pools, disk = _manager(tmp_path)
    prompt = list(range(13))  # 3 full pages + 1 token
    pools.run(Request("a", prompt))
    _flood(pools, 4)
    disk.io.flush()
    waiting = Request("a2", prompt)
    pools.kv.read_ahead([waiting])
    disk.io.flush()  # the reads ran on the worker: the files are no longer needed
    names = [f for f in os.listdir(tmp_path) if f.endswith(SUFFIX)]
    on_disk = {bytes.fromhex(f[:-len(SUFFIX)]) for f in names}
    wanted = set(extend_page_hashes([], prompt, PS, 3, None)) & on_disk
    assert wanted
    for f in names:
        os.unlink(tmp_path / f)
    assert pools.run(waiting) == 12  # Pools.run checked them
    assert pools.kv.disk_tier_hits == len(wanted) * PS
    # A read ahead of a damaged file is refused when the page is restored, as a direct read is.
    pools.run(Request("b", list(range(700, 713))))
    _flood(pools, 4, base=9000)
    disk.io.flush()
    for f in os.listdir(tmp_path):
        if f.endswith(SUFFIX):
            write_page(str(tmp_path / f), b"\0" * 16, (1, 2, 3, 4), np.zeros(4, np.int64))
    bad = disk.bad_files
    waiting = Request("b2", list(range(700, 713)))
    pools.kv.read_ahead([waiting])
    assert pools.run(waiting) < 12 and disk.bad_files > bad
    pools.kv.check_invariants()


def test_the_scheduler_reads_the_next_waiting_requests_disk_pages_ahead(tmp_path):
    disk = DiskTier(str(tmp_path), 24, PS * 8, lock=open_directory(str(tmp_path)))
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=32,
                                      max_model_len=64), CacheConfig(page_size=PS), 5,
                      num_host_pages=2, disk_tier=disk)
    pools = Pools(sched.cache, 2)
    prompt = list(range(13))  # 3 full pages + 1 token
    pools.run(Request("a", prompt))
    _flood(pools, 4)  # a's pages reach disk
    sched.add_request(Request("busy", [400, 401, 402], max_tokens=4))
    waiting = Request("a2", prompt)
    sched.add_request(waiting)
    out = sched.schedule()  # one sequence at a time: a2 waits, and its pages are read meanwhile
    assert [s.request.request_id for s in out.scheduled] == ["busy"]
    pools.copies(out.page_copies)
    disk.io.flush()
    for name in os.listdir(tmp_path):  # read already: the files are no longer needed
        if name.endswith(SUFFIX):
            os.unlink(tmp_path / name)
    sched.abort("busy")
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a2"]
    pools.copies(out.page_copies)
    assert waiting.num_computed_tokens == 12
    for i, page in enumerate(waiting.page_table[:3]):
        assert list(pools.device[page]) == prompt[i * PS:(i + 1) * PS]
    assert sched.cache.disk_tier_hits == 12
    sched.abort("a2")
    sched.cache.check_invariants()


def test_directory_is_private_locked_and_emptied_and_settings_are_checked(tmp_path):
    d = tmp_path / "tier"
    lock = open_directory(str(d))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    (d / ("ab" * 16 + SUFFIX)).write_bytes(b"old")
    with pytest.raises(ConfigError, match="in use"):
        open_directory(str(d))
    lock.close()
    os.chmod(d, 0o755)
    open_directory(str(d)).close()  # an earlier run's directory: emptied, private again
    assert os.listdir(d) == ["JAXSERVE_KV_TIER"] and stat.S_IMODE(os.stat(d).st_mode) == 0o700
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="neither empty"):
        open_directory(str(tmp_path / "home"))
    os.symlink(d, tmp_path / "link")
    with pytest.raises(ConfigError, match="symlink"):
        open_directory(str(tmp_path / "link"))
    with pytest.raises(ConfigError, match="kv-offloading-disk-size .* free space"):
        num_disk_files(1 << 20, 1000, str(d))  # a PiB
    with pytest.raises(ConfigError, match="holds no KV page"):
        num_disk_files(1e-9, 1000, str(d))
    assert num_disk_files(1, 1 << 20, str(d)) == 1024
    with pytest.raises(ConfigError, match="go together"):
        CacheConfig(kv_offloading_size=1, kv_offloading_disk_path=str(d))
    with pytest.raises(ConfigError, match="needs kv_offloading_size"):
        CacheConfig(kv_offloading_disk_path=str(d), kv_offloading_disk_size=1)


# ---------------------------------------------------------------- a tiny model end to end

PAGE_BYTES = 2 * 16 * 4 * 8 * 4  # the tiny model: 2 layers, page 16, 2 KV heads x (K, V), 8, f32
DISK_FILES = 12


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_tokenizer_fields):
    d = tmp_path_factory.mktemp("disk")
    path = tiny_gguf(d / "tiny.gguf", smollm2_tokenizer_fields)
    return build_engine(str(path), num_pages=9, max_num_seqs=1, max_num_batched_tokens=16,
                        min_token_bucket=16, max_model_len=128,
                        kv_offloading_size=PAGE_BYTES / 2 ** 30,  # one page
                        kv_offloading_disk_path=str(d / "tier"),
                        kv_offloading_disk_size=DISK_FILES * file_bytes(16, PAGE_BYTES) / 2 ** 30,
                        strict_compile=True, progress=False)


def _same(a, b) -> None:
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert abs(x.logprob - y.logprob) < 1e-5


def test_a_prefix_spilled_to_disk_is_read_back_with_the_same_tokens(engine):
    tier = engine.scheduler.cache.host_tier
    assert engine.runner.num_host_pages == 1 and tier.disk.num_files == DISK_FILES
    prompt = [1000 + 7 * i for i in range(65)]  # 4 full pages + 1 token
    first = _generate(engine, "a", prompt)
    for i in range(2):  # evict a's 4 pages from the device, and all but one from the host
        _generate(engine, f"flood{i}", [3000 + 500 * i + j for j in range(65)])
    tier.disk.io.flush()
    before = engine.stats()
    assert before.kv_disk_pages >= 4 and before.kv_disk_bytes_written > 0
    again = _generate(engine, "a2", prompt)
    after = engine.stats()
    _same(again, first)
    assert again.num_cached_tokens == 64 and first.num_cached_tokens == 0
    assert after.kv_disk_hits - before.kv_disk_hits >= 48  # at least 3 pages from disk
    assert after.kv_offload_hits - before.kv_offload_hits == 64
    assert after.kv_disk_bytes_read - before.kv_disk_bytes_read == \
        (after.kv_disk_hits - before.kv_disk_hits) // 16 * PAGE_BYTES
    text = ServerMetrics(lambda: {"tiny": [after]}).render().decode()
    assert 'jaxserve:kv_offload_hits_total{model_name="tiny",replica="0",route="",tier="disk"}' \
        in text
    # Damaged files are misses: the prompt is computed again, to the same tokens.
    for i in range(2):
        _generate(engine, f"flood-again{i}", [5000 + 500 * i + j for j in range(65)])
    tier.disk.io.flush()
    for name in os.listdir(tier.disk.directory):
        if name.endswith(SUFFIX):
            path = os.path.join(tier.disk.directory, name)
            with open(path, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0xFF]))
    hits = engine.stats().kv_disk_hits
    third = _generate(engine, "a3", prompt)
    _same(third, first)
    assert engine.stats().kv_disk_hits == hits and tier.disk.bad_files > 0
    assert engine.runner.num_serving_compiles == 0
    assert_no_leaks(engine)


def test_a_transfers_pages_past_the_host_tier_are_restored_from_disk(engine):
    """import_prefix (a decode server's side of P/D) into a one-page host tier: the pages it
    overwrites are spilled to disk, each from its own bytes, and come back to the same tokens."""
    prompt = [2000 + 3 * i for i in range(65)]  # 4 full pages + 1 token
    first = _generate(engine, "computed", prompt)
    pages = export_prefix(engine, prompt, None)
    assert pages.shape[1] == 4
    written = engine.stats().kv_disk_bytes_written
    assert import_prefix(engine, prompt, "t:other", pages) == 4  # another tenant's prefix
    tier = engine.scheduler.cache.host_tier
    tier.disk.io.flush()
    before = engine.stats()
    assert before.kv_disk_bytes_written - written >= 3 * PAGE_BYTES
    engine.add_request("imported", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0),
                       qos=QoS(cache_salt="t:other"))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                again = out
    _same(again, first)
    assert again.num_cached_tokens == 64
    assert engine.stats().kv_disk_hits - before.kv_disk_hits == 48
    assert engine.runner.num_serving_compiles == 0
    tier.check_invariants()
    assert_no_leaks(engine)


def test_a_transfer_arriving_while_copies_are_pending_runs_them_first(tmp_path):
    """A schedule that decided copies (a restore's reads here) but scheduled nothing leaves them
    pending between steps; a transfer's import_prefix then runs them before it fills slots
    (HostTier.put refuses to take a slot with copies pending)."""
    pools, _ = _manager(tmp_path, device_pages=8)
    prompt = list(range(13))  # 3 full pages + 1 token
    pools.run(Request("a", prompt))
    _flood(pools, 4)  # a's pages leave the device for the host tier and the disk
    assert pools.kv.restore_prefix(Request("a2", prompt)) > 0  # its copies left pending
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(cache=pools.kv),
        config=SimpleNamespace(cache=SimpleNamespace(page_size=PS)),
        runner=SimpleNamespace(copy_pages=pools.copies, host_pool=SimpleNamespace(
            write_slot=lambda slot, page: pools.host.__setitem__(slot, page[0]))))
    other = list(range(300, 309))  # 2 full pages + 1 token, computed "elsewhere"
    pages = np.array([[other[:PS], other[PS:2 * PS]]])
    assert import_prefix(engine, other, None, pages) == 2
    # a2's restore, run by the transfer, put a's pages on the device intact.
    cached = pools.kv.lookup_prefix(Request("a3", prompt))
    assert [list(pools.device[p]) for p in cached] == [prompt[i * PS:(i + 1) * PS]
                                                      for i in range(3)]
    assert pools.run(Request("b", other)) == 8  # Pools.run checked them
    pools.kv.check_invariants()
