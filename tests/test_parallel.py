"""Tensor, data and multi-host parallelism: the routing rule, the step channel's frames, invalid
sizes, then `jaxserve serve` on 8 virtual CPU devices (TP=2, TP=2 x DP=2) and a two-process group
(2 x 2 devices, gloo) against SmolLM2's golden outputs, and a group whose follower dies.

XLA fixes the device count when JAX starts, so every multi-device test runs `jaxserve serve` in a
child process with XLA_FLAGS set; this process keeps its one device.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.executor import multihost
from jaxserve.executor import sharding
from jaxserve.executor.batch_plan import SeqChunk, make_plan
from jaxserve.core.cache import KVCacheManager
from jaxserve.config import DistributedConfig, ModelConfig, ParallelConfig
from jaxserve.core.engine import EngineStats
from jaxserve.errors import ConfigError, EngineOverloaded
from jaxserve.core.replica_routing import pick_replica
from jaxserve.core.replicas import ReplicaSet
from jaxserve.core.request import Request
from jaxserve.executor.runner import SampleInputs
from jaxserve.executor.sampler import SamplingRow, make_sampling_metadata
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.entrypoints.process import ServerProcess
from tests.test_cli import ROOT, assert_one_line_error, run_cli, tiny_gguf
from tests.test_server import http_get, http_post, wait_for

SMOLLM2 = "smollm2-135m-instruct"
# Few buckets: every server here compiles 2 forwards and one row count's samplers per replica.
ENGINE_FLAGS = ["--max-model-len", "256", "--num-pages", "96", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "32", "--min-token-bucket", "16", "--no-rag", "--port",
                "0"]


def devices_env(n: int) -> dict[str, str]:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
                JAX_PLATFORMS="cpu")


# ---------------------------------------------------------------- routing rule


def test_pick_replica_prefers_the_cached_prefix_unless_much_busier():
    # Nobody has the prefix: the least loaded, the lower index among equals.
    assert pick_replica([0, 0, 0], [3, 1, 1], max_imbalance=2) == 1
    # The replica with the longest cached prefix wins while it is less than 2 sequences busier.
    assert pick_replica([0, 4, 2], [0, 1, 0], max_imbalance=2) == 1
    # 2 or more busier than the least loaded: passed over, the next best prefix wins.
    assert pick_replica([0, 4, 2], [0, 2, 0], max_imbalance=2) == 2
    assert pick_replica([0, 4, 0], [0, 5, 0], max_imbalance=2) == 0
    # Equal prefixes: the lower load.
    assert pick_replica([3, 3], [2, 1], max_imbalance=4) == 1
    with pytest.raises(ValueError):
        pick_replica([1], [0, 0], max_imbalance=1)


def _fake_replica(page_size: int, load: int, cached: list[int] | None):
    """What ReplicaSet.route reads of a replica: its live prefix index and its load."""
    cache = KVCacheManager(num_pages=16, page_size=page_size)
    if cached is not None:  # compute and index the pages of a request with these tokens
        request = Request("r", list(cached), SamplingParams())
        assert cache.admit(request, cache.lookup_prefix(request), len(cached))
        request.num_computed_tokens = len(cached)
        cache.register_full_pages(request)
    config = SimpleNamespace(cache=SimpleNamespace(page_size=page_size),
                             scheduler=SimpleNamespace(max_num_seqs=4))
    stats = EngineStats(0, 0, 0, 0, 15, 0, 0, 0, 0, 0, 0, {1: load})
    return SimpleNamespace(engine=SimpleNamespace(config=config,
                                                  scheduler=SimpleNamespace(cache=cache)),
                           num_queued=load, stats=lambda: stats)


def test_replica_set_routes_by_the_replicas_live_prefix_index():
    system = list(range(100, 148))  # three full pages of 16 tokens
    replicas = [_fake_replica(16, load=0, cached=None),
                _fake_replica(16, load=1, cached=system + [7]),
                _fake_replica(16, load=0, cached=system[:16] + [9] * 32)]
    rs = ReplicaSet(replicas)  # max_imbalance 4 // 2 = 2
    assert rs.route(system + [1, 2, 3]) == 1  # the whole shared prefix is on replica 1
    assert rs.route(system[:16] + [5] * 40) == 2  # one page on both 1 and 2: the less loaded
    replicas[1].num_queued = 2  # now 2 busier than replica 0: much busier
    assert rs.route(system + [1, 2, 3]) == 2  # replica 2 holds the first page
    assert rs.route([1, 2, 3]) == 0  # nobody has it: least loaded, lowest index
    assert rs.stats().num_usable_pages == 45 and rs.stats().num_new_by_priority == {1: 1}


def test_replica_set_queue_limit_sheds_where_the_queue_is_longest():
    asked = []

    def replica(queued: int, sheddable: int):
        def admit(num_seqs, max_queued, priority):
            asked.append((queued, num_seqs, max_queued, priority))
            if num_seqs > sheddable:
                raise EngineOverloaded("full")
        return SimpleNamespace(num_queued=queued, admit=admit, engine=SimpleNamespace(
            config=SimpleNamespace(cache=SimpleNamespace(page_size=16),
                                   scheduler=SimpleNamespace(max_num_seqs=4))))

    rs = ReplicaSet([replica(3, sheddable=0), replica(5, sheddable=1), replica(4, sheddable=9)])
    rs.admit(2, max_queued=14, priority=0)  # 12 + 2 fit: nobody is asked
    rs.admit(1, max_queued=None)
    assert asked == []
    rs.admit(3, max_queued=14, priority=-1)  # one too many: the longest queue sheds one
    assert asked == [(5, 1, 5, -1)]
    asked.clear()
    rs.admit(4, max_queued=14, priority=0)  # two too many: replica 1 cannot, replica 2 can
    assert asked == [(5, 2, 5, 0), (4, 2, 4, 0)]
    with pytest.raises(EngineOverloaded, match="12 sequences wait"):
        rs.admit(20, max_queued=14)


# ---------------------------------------------------------------- step channel frames


def _round_trip(inputs):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(multihost.encode_step(inputs))
        return multihost.decode_step(*multihost._recv(b))


def _assert_same_arrays(got, want) -> None:
    assert len(got) == len(want)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)
        assert x.dtype == y.dtype


def test_step_frames_round_trip():
    plan = make_plan([SeqChunk([5, 6, 7], 0, [1]), SeqChunk([9], 20, [2, 3])],
                     num_tokens_padded=16, num_seqs_padded=4, pages_per_seq=4, page_size=16)
    got = _round_trip(plan)
    assert type(got) is type(plan)
    _assert_same_arrays(got, plan)
    rows = [SamplingRow(SamplingParams(temperature=0.7, top_k=5, presence_penalty=0.5), 3,
                        [5, 6, 7], []), None]
    md = make_sampling_metadata(rows, 4, eos_token_ids=[2], history_buckets=(64,))
    bitmask = np.arange(4 * 3, dtype=np.int32).reshape(4, 3)
    for inputs in (SampleInputs(md, 20, None), SampleInputs(md, 0, bitmask)):
        got = _round_trip(inputs)
        assert got.top_width == inputs.top_width
        _assert_same_arrays(got.metadata, inputs.metadata)
        if inputs.token_bitmask is None:
            assert got.token_bitmask is None
        else:
            _assert_same_arrays([got.token_bitmask], [inputs.token_bitmask])


def test_frames_refuse_what_a_step_never_holds():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(multihost._frame({"type": "step"}, [np.zeros(2, np.float64)]))
        with pytest.raises(ConnectionError, match="dtype"):
            multihost._recv(b)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(multihost._frame({"type": "hello"}, [np.zeros(2, np.int32)]))
        with pytest.raises(ConnectionError, match="oversized"):
            multihost._recv(b, max_body=0)


def test_the_leader_waits_briefly_on_a_silent_connection(monkeypatch):
    """Review a70e490, L11: while the group forms, a connection that says nothing holds the
    channel for the short hello time only, not the whole join timeout; a wrong token is
    refused."""
    import json
    import threading
    import time

    store = {}
    monkeypatch.setattr(multihost, "_kv_store", lambda: type("KV", (), {
        "key_value_set": staticmethod(store.__setitem__)})())
    monkeypatch.setattr(multihost, "_coordinator_host", lambda: "127.0.0.1")
    monkeypatch.setattr(multihost.jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost, "_HELLO_TIMEOUT_S", 0.2)
    leader = []
    thread = threading.Thread(target=lambda: leader.append(multihost.Leader(timeout_s=30)))
    started = time.monotonic()
    thread.start()
    while not store:
        time.sleep(0.01)
    channel = json.loads(store[multihost._CHANNEL_KEY])
    host, _, port = channel["address"].rpartition(":")
    silent = socket.create_connection((host, int(port)))
    wrong = socket.create_connection((host, int(port)))
    wrong.sendall(multihost._frame({"type": "hello", "process_id": 1, "token": "0" * 32}))
    follower = socket.create_connection((host, int(port)))
    follower.sendall(multihost._frame({"type": "hello", "process_id": 1,
                                       "token": channel["token"]}))
    thread.join(20)
    with silent, wrong, follower:
        assert leader and set(leader[0].followers) == {1}
        assert time.monotonic() - started < 10  # not the 30 s join timeout
        assert wrong.recv(1) == b""  # refused: closed
        leader[0].followers[1].close()


# ---------------------------------------------------------------- invalid sizes: one clear error


def test_invalid_parallel_sizes():
    heads9 = ModelConfig(name="m", vocab_size=64, hidden_size=64, intermediate_size=96,
                         num_layers=1, num_heads=9, num_kv_heads=3, head_dim=8)
    sharding.check_parallel(heads9, ParallelConfig(tensor_parallel_size=3), 8)  # heads split
    sharding.check_parallel(heads9, ParallelConfig(tensor_parallel_size=2), 8)  # the MLP splits
    with pytest.raises(ConfigError, match=r"divides neither the 9 attention heads nor the MLP "
                                          r"width 96 of m.*\[2, 3, 4, 6, 8\]"):
        sharding.check_parallel(heads9, ParallelConfig(tensor_parallel_size=5), 8)
    with pytest.raises(ConfigError, match=r"2 x 4 = 8 exceeds the 4 available devices"):
        sharding.check_parallel(heads9, ParallelConfig(4, 2), 4)
    with pytest.raises(ConfigError, match="must be >= 1"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        DistributedConfig(coordinator_address="nohost")
    with pytest.raises(ConfigError, match="process_id"):
        DistributedConfig("127.0.0.1:1234", num_processes=2, process_id=2)


def test_cli_refuses_more_devices_than_there_are(tmp_path, smollm2_tokenizer_fields):
    path = tiny_gguf(tmp_path / "tiny.gguf", smollm2_tokenizer_fields)
    proc = run_cli("generate", "--model", str(path), "--prompt-token-ids", "1,2,3",
                   "--tensor-parallel-size", "2")
    assert_one_line_error(proc.returncode, proc.stderr,
                          "data_parallel_size x tensor_parallel_size = 1 x 2 = 2 exceeds the 1 "
                          "available devices")
    proc = run_cli("generate", "--model", str(path), "--prompt-token-ids", "1,2,3",
                   "--tensor-parallel-size", "0")
    assert_one_line_error(proc.returncode, proc.stderr, "parallel sizes must be >= 1")
    # A model's TOML sets it too (it used to be accepted there and ignored).
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.toml").write_text(
        'name = "tiny-tp"\nformat = "gguf"\n[source]\npypi = "none==0"\nfile = "x/tiny.gguf"\n'
        'sha256 = "0"\n[engine]\ntensor_parallel_size = 2\n')
    (tmp_path / "cache" / "models" / "tiny-tp").mkdir(parents=True)
    path.rename(tmp_path / "cache" / "models" / "tiny-tp" / "tiny.gguf")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.entrypoints.cli", "generate", "--model", "tiny-tp",
         "--prompt-token-ids", "1,2,3"], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, JAXSERVE_CONFIGS=str(tmp_path / "configs"),
                 JAXSERVE_CACHE=str(tmp_path / "cache")))
    assert_one_line_error(proc.returncode, proc.stderr, "1 x 2 = 2 exceeds the 1 available")


# ---------------------------------------------------------------- SmolLM2 over HTTP, 8 devices


def assert_golden_over_http(url: str, golden: dict) -> None:
    """Every golden case, sent at once (so data-parallel replicas share them), greedy."""
    def one(case):
        if "messages" in case["case"]:
            r = http_post(f"{url}/chat/completions", {
                "model": SMOLLM2, "messages": case["case"]["messages"], "temperature": 0,
                "max_tokens": 32})
            return r.json()["choices"][0]["message"]["content"]
        r = http_post(f"{url}/completions", {"model": SMOLLM2, "prompt": case["input_ids"],
                                             "temperature": 0, "max_tokens": 32})
        return r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(golden["cases"])) as pool:
        texts = list(pool.map(one, golden["cases"]))
    assert texts == [c["greedy_text"].replace("<|im_end|>", "") for c in golden["cases"]]


def per_replica(metrics_text_url: str, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(http_get(metrics_text_url).text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["replica"]] = s.value
    return out


def assert_clean_log(text: str) -> None:
    assert "Traceback" not in text and "Terminating process" not in text, text[-3000:]
    assert "warmup missed" not in text, "a program compiled while serving"


@pytest.fixture
def server_log(tmp_path):
    path = tmp_path / "stderr.log"
    with path.open("w") as f:
        yield f
    assert_clean_log(path.read_text())


@pytest.mark.slow
def test_serve_tensor_parallel_2_golden(smollm2_path, smollm2_golden, server_log):
    server = ServerProcess(["--model", SMOLLM2, "--tensor-parallel-size", "2", *ENGINE_FLAGS],
                           server_log, cwd=ROOT, env=devices_env(8), ready_timeout_s=600)
    try:
        assert_golden_over_http(server.url, smollm2_golden)
        assert set(per_replica(server.url.removesuffix("/v1") + "/metrics",
                               "jaxserve:generation_tokens_total")) == {"0"}
        assert server.stop() == 0
    finally:
        server.kill()


@pytest.mark.slow
def test_serve_tp2_dp2_golden_and_prefix_affinity(smollm2_path, smollm2_golden, server_log):
    server = ServerProcess(["--model", SMOLLM2, "-tp", "2", "-dp", "2", *ENGINE_FLAGS],
                           server_log, cwd=ROOT, env=devices_env(8), ready_timeout_s=900)
    base = server.url.removesuffix("/v1")
    try:
        assert_golden_over_http(server.url, smollm2_golden)
        generated = per_replica(f"{base}/metrics", "jaxserve:generation_tokens_total")
        assert set(generated) == {"0", "1"} and all(v > 0 for v in generated.values()), generated
        wait_for(lambda: sum(per_replica(f"{base}/metrics",
                                         "jaxserve:num_requests_running").values()) == 0, "idle")
        hits0 = per_replica(f"{base}/metrics", "jaxserve:prefix_cache_hits_total")

        # A long shared prefix (4 pages) is computed once, on the replica an idle set picks.
        prefix = [1000 + i for i in range(64)]
        body = {"model": SMOLLM2, "prompt": prefix + [7], "max_tokens": 1}
        assert http_post(f"{server.url}/completions", body).status_code == 200
        # Keep that replica busy with an unrelated stream: least-loaded routing would now pick
        # the other replica; affinity sends the prefix back to the one that has it cached.
        generated0 = per_replica(f"{base}/metrics", "jaxserve:generation_tokens_total")
        busy = http_post_stream(f"{server.url}/completions", {
            "model": SMOLLM2, "prompt": [2000 + i for i in range(20)], "max_tokens": 230,
            "ignore_eos": True, "stream": True})
        try:
            running = wait_for(lambda: {r for r, v in per_replica(
                f"{base}/metrics", "jaxserve:num_requests_running").items() if v}, "the stream")
            assert http_post(f"{server.url}/completions",
                             dict(body, prompt=prefix + [8, 9])).status_code == 200
        finally:
            busy.close()  # the client goes: its replica aborts the request
        hits = per_replica(f"{base}/metrics", "jaxserve:prefix_cache_hits_total")
        gained = {r: hits[r] - hits0[r] for r in hits}
        (holder,) = running
        assert gained[holder] == 64 and sum(gained.values()) == 64, (gained, running)
        wait_for(lambda: not any(per_replica(f"{base}/metrics",
                                             "jaxserve:kv_cache_usage_perc").values()), "idle")
        generated = per_replica(f"{base}/metrics", "jaxserve:generation_tokens_total")
        assert generated[holder] - generated0[holder] < 230 + 1  # the stream stopped early
        assert server.stop() == 0
    finally:
        server.kill()


def http_post_stream(url: str, body: dict):
    """Open a streaming POST and read its first event; the caller closes it (an abort)."""
    import urllib.request

    resp = urllib.request.urlopen(urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}),
        timeout=120)
    assert resp.readline().startswith(b"data: ")
    return resp


# ---------------------------------------------------------------- two processes x 2 devices


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """`jaxserve serve` as process 0 and 1 of a jax.distributed group on loopback."""

    def __init__(self, model: str, flags: list[str], log_dir: Path):
        group = ["--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
        self.follower_log = (log_dir / "follower.log").open("w")
        self.follower = subprocess.Popen(
            [sys.executable, "-m", "jaxserve", "serve", "--model", model, *flags, *group,
             "--process-id", "1"], cwd=ROOT, env=devices_env(2), stdout=self.follower_log,
            stderr=subprocess.STDOUT)
        self.leader_log = (log_dir / "leader.log").open("w")
        try:
            self.leader = ServerProcess(["--model", model, *flags, *group, "--process-id", "0"],
                                        self.leader_log, cwd=ROOT, env=devices_env(2),
                                        ready_timeout_s=900)
        except BaseException:
            self.kill()
            raise
        self.url = self.leader.url

    def kill(self) -> None:
        for proc in (self.follower, getattr(getattr(self, "leader", None), "proc", None)):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        self.follower_log.close()
        self.leader_log.close()


@pytest.mark.slow
def test_two_process_group_tp4_golden_then_clean_shutdown(smollm2_path, smollm2_golden,
                                                          tmp_path):
    group = Group(SMOLLM2, ENGINE_FLAGS, tmp_path)
    try:
        assert_golden_over_http(group.url, smollm2_golden)
        assert group.leader.stop() == 0
        assert group.follower.wait(timeout=60) == 0
    finally:
        group.kill()
    for log in ("leader.log", "follower.log"):
        assert_clean_log((tmp_path / log).read_text())
    assert "jaxserve: process 1 following the leader's steps" in (
        tmp_path / "follower.log").read_text()


def test_dead_follower_makes_the_leader_unready(tmp_path, smollm2_tokenizer_fields):
    path = tiny_gguf(tmp_path / "tiny.gguf", smollm2_tokenizer_fields)
    flags = ["--max-model-len", "128", "--num-pages", "32", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "16", "--min-token-bucket", "16", "--no-rag", "--port",
             "0"]
    group = Group(str(path), flags, tmp_path)
    base = group.url.removesuffix("/v1")
    try:
        r = http_post(f"{group.url}/completions", {"model": str(path), "prompt": [3, 4, 5],
                                                   "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        group.follower.kill()
        wait_for(lambda: http_get(f"{base}/ready").status_code == 503, "/ready to say 503")
        r = http_post(f"{group.url}/completions", {"model": str(path), "prompt": [3, 4, 5],
                                                   "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert group.leader.stop() == 0  # SIGTERM still ends the leader, promptly
    finally:
        group.kill()
    assert "multi-host follower process 1 disconnected" in (tmp_path / "leader.log").read_text()
