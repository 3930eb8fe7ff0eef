"""Every call ends once, and its one outcome reaches each of its sinks exactly once (DESIGN.md,
"a request is checked once and recorded once"): for every terminal state (finished,
content_filter, aborted, deadline, shed, error, idempotent replay, refusals before and after the
serving layer, the calls beside generation) on HTTP, gRPC and the batch runner.

One module-scoped server over a tiny random model (HTTP + gRPC sharing one serving layer; a
tenants file, a policy whose pack for bob blocks any output, the audit log, a queue of one).
Each case sends its requests and then counts what the sinks saw, through the sinks themselves:
a recorder installed through the hook the server installs its own with (`Sinks.add`), the
request counter (jaxserve:requests_total by tenant and outcome), the access log (one line per
request that ran), the audit log (one record per audited call), and the per-request holds: each
hold on a tenant's limits settled once, each version lease ended once (their entry points
observed as they run). The engine's step can be held (`gate`), so queued, shed and abandoned
requests are made deterministically, however fast the tiny model is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections import Counter

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.core.async_engine import AsyncEngine, resolve_final
from jaxserve.core.engine_factory import build_engine
from jaxserve.entrypoints.batch import answer_items, batch_gateway, read_input
from jaxserve.entrypoints.grpc import start_grpc_server
from jaxserve.entrypoints.http.app import attach_engine, close_app, serving_of
from jaxserve.entrypoints.http.app_state import STATE_KEY
from jaxserve.fleet import versions
from jaxserve.fleet.fleet import Fleet
from jaxserve.gateway import limits
from jaxserve.protos import generation_pb2 as pb
from jaxserve.protos import generation_pb2_grpc as pb_grpc
from tests.test_audit_server import all_records
from tests.test_cli import tiny_gguf
from tests.test_engine import assert_no_leaks
from tests.test_server import ServerThread, _request, parse_sse, wait_for
from tests.test_tenancy_server import in_thread

TENANTS = """
[tenant.alice]
api_keys = ["sk-alice"]

[tenant.bob]
api_keys = ["sk-bob"]
policy = "blocked"

[tenant.carol]
api_keys = ["sk-carol"]
requests_per_minute = 1

[tenant.dave]
api_keys = ["sk-dave"]
priority = "batch"
"""
POLICY = """
[[pack.blocked.rule]]
name = "anything"
stage = "output"
match = "regex"
pattern = "(?s)."
action = "block"
"""
SMALL = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "ignore_eos": True}
FAIL_SEED = 666  # a request with this seed fails in the engine (see `server`)


class Ledger:
    """What the sinks saw: the outcomes (through `Sinks.add`), the access-log lines, and each
    tenant hold's settlements and each version lease's ends, keyed by the hold or lease."""

    def __init__(self):
        self.outcomes: list = []
        self.access: list[dict] = []
        self.holds: dict[limits.Lease, int] = {}
        self.leases: dict[versions.Lease, list[str]] = {}


class _AccessLog(logging.Handler):
    def __init__(self, ledger: Ledger):
        super().__init__(logging.INFO)
        self.ledger = ledger

    def emit(self, record: logging.LogRecord) -> None:
        self.ledger.access.append(json.loads(record.getMessage()))


def _spy(mp: pytest.MonkeyPatch, ledger: Ledger) -> None:
    """Observe the per-request holds' entry points as they run (each still does its work)."""
    acquire, settle = limits.TenantLimiter.acquire, limits.Lease.settle
    select, finish, release = Fleet.select, versions.Lease.finish, versions.Lease.release

    def spy_acquire(self, tokens, num_seqs):
        hold = acquire(self, tokens, num_seqs)
        ledger.holds[hold] = 0
        return hold

    def spy_settle(self, used_tokens):
        ledger.holds[self] = ledger.holds.get(self, 0) + 1
        settle(self, used_tokens)

    def spy_select(self, model, **kwargs):
        lease = select(self, model, **kwargs)
        for each in (lease, *lease.shadows):
            ledger.leases[each] = []
        return lease

    def spy_finish(self, **kwargs):
        ledger.leases.setdefault(self, []).append("finish")
        finish(self, **kwargs)

    def spy_release(self):
        ledger.leases.setdefault(self, []).append("release")
        release(self)

    mp.setattr(limits.TenantLimiter, "acquire", spy_acquire)
    mp.setattr(limits.Lease, "settle", spy_settle)
    mp.setattr(Fleet, "select", spy_select)
    mp.setattr(versions.Lease, "finish", spy_finish)
    mp.setattr(versions.Lease, "release", spy_release)


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer_fields):
    d = tmp_path_factory.mktemp("outcomes")
    (d / "tenants.toml").write_text(TENANTS)
    (d / "policy.toml").write_text(POLICY)
    path = tiny_gguf(d / "tiny.gguf", smollm2_tokenizer_fields, max_position_embeddings=256)
    llm = build_engine(str(path), num_pages=48, max_num_seqs=1, max_num_batched_tokens=64,
                       max_model_len=256, min_token_bucket=16, strict_compile=True,
                       progress=False)
    # The gate: cleared, a running request makes no progress (its steps do nothing) while the
    # engine loop still takes new requests, aborts and sheds, so what follows it stays queued.
    gate, step = threading.Event(), llm.step
    gate.set()

    def gated_step():
        if not gate.is_set() and llm.stats().num_running:
            time.sleep(0.005)
            return []
        return step()

    llm.step = gated_step
    engine = AsyncEngine(llm)
    generate = engine.generate

    async def failing_generate(*args, prepared=None, **kwargs):
        if prepared is not None and prepared.params.seed == FAIL_SEED:
            # It never reached the engine: say so to a caller waiting for its final output, as
            # the engine's own wrappers do (else the call ends only after FINAL_OUTPUT_WAIT_S).
            resolve_final(kwargs.get("final"), None)
            raise RuntimeError("injected engine failure")
        async for out in generate(*args, prepared=prepared, **kwargs):
            yield out

    engine.generate = failing_generate
    ledger = Ledger()
    access = _AccessLog(ledger)
    access_logger = logging.getLogger("jaxserve.access")
    level = access_logger.level
    access_logger.setLevel(logging.INFO)
    access_logger.addHandler(access)
    http = ServerThread("tiny", tenants_file=str(d / "tenants.toml"),
                        policy_file=str(d / "policy.toml"), audit_log_dir=str(d / "audit"),
                        max_queued_requests=1)
    mp = pytest.MonkeyPatch()
    try:
        http.app[STATE_KEY].sinks.add(ledger.outcomes.append)  # the hook the server uses
        _spy(mp, ledger)
        http.attach(engine)
        grpc_server, port = http._call(start_grpc_server(None, "127.0.0.1", 0, "unused",
                                                         serving=serving_of(http.app)))
        http.dir, http.engine, http.llm, http.gate, http.ledger = d, engine, llm, gate, ledger
        http.grpc_target = f"127.0.0.1:{port}"
        yield http
        http._call(grpc_server.stop(grace=None))
    finally:
        gate.set()
        http.stop()
        close_app(http.app)
        engine.shutdown()
        mp.undo()
        access_logger.removeHandler(access)
        access_logger.setLevel(level)
    assert llm.runner.num_serving_compiles == 0
    assert_no_leaks(llm)


def post(server, path: str, body=None, key: str | None = "sk-alice", content: bytes | None = None,
         **headers):
    hdrs = {k.replace("_", "-"): v for k, v in headers.items()}
    if key is not None:
        hdrs["Authorization"] = f"Bearer {key}"
    return _request("POST", f"{server.url}{path}", body, content, headers=hdrs)


def get(server, path: str, key: str | None = "sk-alice"):
    return _request("GET", f"{server.url}{path}",
                    headers={"Authorization": f"Bearer {key}"} if key else None)


def requests_counted(server) -> Counter:
    """jaxserve:requests_total by (tenant, outcome), summed over versions and routes."""
    counts: Counter = Counter()
    for family in text_string_to_metric_families(get(server, "/metrics", None).text):
        for s in family.samples:
            if s.name == "jaxserve:requests_total":
                counts[(s.labels["tenant"], s.labels["outcome"])] += s.value
    return counts


def version_in_flight(server) -> int:
    return serving_of(server.app).fleet.version_info("tiny")["in_flight"]


class Sent:
    """A snapshot of every sink before a case's calls."""

    def __init__(self, server):
        ledger = server.ledger
        self.server = server
        self.outcomes = len(ledger.outcomes)
        self.access = len(ledger.access)
        self.audit = len(all_records(server))
        self.counted = requests_counted(server)
        self.holds = set(ledger.holds)
        self.leases = set(ledger.leases)

    def idle(self) -> None:
        server = self.server
        wait_for(lambda: not server.llm.has_unfinished() and server.engine.num_queued == 0
                 and server.engine.stats().pages_in_use == 0 and version_in_flight(server) == 0,
                 "the engine and the version to go idle")

    def ended(self, expected: Counter, *, audited: int | None = None, holds: int,
              leases: int) -> list:
        """The case's calls ended as `expected` ((status, served) -> how many), each outcome
        having reached each sink once: counted once under its tenant and outcome, one access-log
        line per request that ran, `audited` audit records (default: one per call), `holds`
        holds on tenants' limits each settled once, `leases` version leases each ended once
        (`finish` for a request that ran)."""
        server, ledger = self.server, self.server.ledger
        calls = sum(expected.values())
        wait_for(lambda: len(ledger.outcomes) >= self.outcomes + calls, "the calls to end")
        self.idle()
        outcomes = ledger.outcomes[self.outcomes:]
        assert Counter((o.status, o.served) for o in outcomes) == expected, outcomes
        assert len({o.request_id for o in outcomes}) == calls
        counted = requests_counted(server)
        counted.subtract(self.counted)
        assert +counted == Counter((o.tenant or "none", o.status) for o in outcomes)
        access = ledger.access[self.access:]
        assert sorted(r["request_id"] for r in access) == sorted(
            o.request_id for o in outcomes if o.served)
        assert all(r["status"] == o.status for r in access for o in outcomes
                   if o.request_id == r["request_id"])
        records = all_records(server)[self.audit:]
        assert len(records) == (calls if audited is None else audited)
        assert {r["request_id"] for r in records} <= {o.request_id for o in outcomes}
        assert len({r["request_id"] for r in records}) == len(records)
        self.held(holds, leases, sum(o.served for o in outcomes))
        return outcomes

    def held(self, holds: int, leases: int, finished: int) -> None:
        ledger = self.server.ledger
        new_holds = [h for h in ledger.holds if h not in self.holds]
        assert len(new_holds) == holds
        assert all(ledger.holds[h] == 1 for h in ledger.holds), "a hold settled twice"
        new_leases = [lease for lease in ledger.leases if lease not in self.leases]
        assert len(new_leases) == leases
        assert all(len(ends) == 1 for ends in ledger.leases.values()), "a lease ended twice"
        assert sum(ledger.leases[lease] == ["finish"] for lease in new_leases) == finished


# ---------------------------------------------------------------- HTTP


def test_http_finished_streamed_content_filter_and_error(server):
    sent = Sent(server)
    assert post(server, "/v1/chat/completions", CHAT).status_code == 200
    r = post(server, "/v1/completions", {**SMALL, "stream": True})
    assert r.status_code == 200 and parse_sse(r.text.encode())[-1]["choices"][0]["finish_reason"]
    r = post(server, "/v1/chat/completions", CHAT, "sk-bob")  # bob's pack blocks any output
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "content_filter"
    r = post(server, "/v1/completions", {**SMALL, "seed": FAIL_SEED})
    assert r.status_code == 500
    outcomes = sent.ended(Counter({("ok", True): 3, ("500_server_error", True): 1}),
                          holds=4, leases=4)
    assert [o.finish_reasons for o in outcomes if o.tenant == "bob"] == [("content_filter",)]


def test_http_refusals_before_and_in_the_serving_layer(server):
    sent = Sent(server)
    statuses = [
        post(server, "/v1/completions", SMALL, key=None).status_code,  # 401, no principal
        post(server, "/v1/completions", content=b"{not json").status_code,  # front door
        post(server, "/v1/completions", {**SMALL, "temperature": "hot"}).status_code,
        post(server, "/v1/completions", {**SMALL, "model": "nope"}).status_code,  # 404
        # 400 once the version is chosen: its lease is released, its tenant never charged
        post(server, "/v1/completions", {**SMALL, "max_tokens": 1000}).status_code,
    ]
    assert statuses == [401, 400, 400, 404, 400]
    outcomes = sent.ended(Counter({("401_invalid_api_key", False): 1,
                                   ("400_invalid_request_error", False): 2,
                                   ("404_model_not_found", False): 1,
                                   ("400_context_length_exceeded", False): 1}),
                          audited=4, holds=0, leases=1)  # the 401: in a summary (H6)
    assert [o.tenant for o in outcomes] == [None, "alice", "alice", "alice", "alice"]
    assert [o.version for o in outcomes] == [None, None, None, None, "tiny"]


def test_http_rate_limit_and_idempotent_replay(server):
    sent = Sent(server)
    assert post(server, "/v1/completions", SMALL, "sk-carol").status_code == 200
    assert post(server, "/v1/completions", SMALL, "sk-carol").status_code == 429
    first = post(server, "/v1/completions", SMALL, Idempotency_Key="outcome-1")
    again = post(server, "/v1/completions", SMALL, Idempotency_Key="outcome-1")
    assert again.headers["idempotent-replayed"] == "true" and again.text == first.text
    outcomes = sent.ended(Counter({("ok", True): 2, ("429_rate_limit_exceeded", False): 1,
                                   ("ok", False): 1}), holds=2, leases=2)
    assert [o.idempotent_replay for o in outcomes] == [False, False, False, True]


def test_http_calls_beside_generation(server):
    sent = Sent(server)
    assert post(server, "/tokenize", {"model": "tiny", "prompt": "Hi"}).status_code == 200
    assert get(server, "/v1/models").status_code == 200  # counted, not audited
    assert get(server, "/v1/nothing").status_code == 404  # a known tenant's: audited
    assert get(server, "/v1/nothing", key=None).status_code == 401  # a keyless scan: not
    sent.ended(Counter({("ok", False): 2, ("404_not_found", False): 1,
                        ("401_invalid_api_key", False): 1}),
               audited=2, holds=1, leases=1)  # tokenize's hold; the lease naming its tokenizer


def test_http_shed_while_queued_and_at_admission(server):
    """While alice's request runs (the gate holds the engine), dave's (batch) waits; alice's
    next one sheds it (503 from its Generation), and dave's next finds nothing to shed (503 at
    admission, its hold given back there)."""
    sent = Sent(server)
    server.gate.clear()
    try:
        running = in_thread(lambda: post(server, "/v1/completions", {**SMALL, "stream": True}))
        wait_for(lambda: server.engine.stats().num_running == 1, "alice's request to run")
        waiting = in_thread(lambda: post(server, "/v1/completions", SMALL, "sk-dave"))
        wait_for(lambda: server.engine.stats().num_waiting == 1, "dave's request to queue")
        displacing = in_thread(lambda: post(server, "/v1/completions", SMALL))
        # its version chosen and the request admitted with no await in between; dave's is
        # shed, and its end comes with the next step that runs
        wait_for(lambda: version_in_flight(server) == 3, "alice's second request to be admitted")
        assert post(server, "/v1/completions", SMALL, "sk-dave").status_code == 503
    finally:
        server.gate.set()
    for t, out in (running, waiting, displacing):
        t.join(60)
    assert [out[0].status_code for _, out in (running, waiting, displacing)] == [200, 503, 200]
    sent.ended(Counter({("ok", True): 2, ("shed", True): 1, ("shed", False): 1}),
               holds=4, leases=4)


def test_http_deadline_while_queued(server):
    sent = Sent(server)
    server.gate.clear()
    try:
        running = in_thread(lambda: post(server, "/v1/completions", {**SMALL, "stream": True}))
        wait_for(lambda: server.engine.stats().num_running == 1, "the first request to run")
        late = in_thread(lambda: post(server, "/v1/completions", SMALL, X_Request_Timeout="0.2"))
        wait_for(lambda: server.engine.stats().num_waiting == 1, "the second request to queue")
        time.sleep(0.4)  # its deadline passes while it waits
    finally:
        server.gate.set()
    for t, _ in (running, late):
        t.join(60)
    assert [out[0].status_code for _, out in (running, late)] == [200, 504]
    sent.ended(Counter({("ok", True): 1, ("deadline", True): 1}), holds=2, leases=2)


def test_http_client_gone_mid_stream(server):
    sent = Sent(server)
    body = json.dumps({**SMALL, "max_tokens": 32, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sk-alice"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    server.gate.clear()
    try:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(head + body)
            wait_for(lambda: server.engine.stats().num_running == 1, "the request to run")
        # closed: the server cancels the handler, and the request ends aborted
        wait_for(lambda: len(server.ledger.outcomes) > sent.outcomes, "the request to end")
    finally:
        server.gate.set()
    sent.ended(Counter({("client_disconnected", True): 1}), holds=1, leases=1)


# ---------------------------------------------------------------- gRPC


def _stub(server):
    return pb_grpc.GenerationStub(grpc.insecure_channel(server.grpc_target))


ALICE = (("authorization", "Bearer sk-alice"),)


def test_grpc_finished_refused_listed_and_past_its_deadline(server):
    sent = Sent(server)
    stub = _stub(server)
    deltas = list(stub.Generate(pb.GenerateRequest(model="tiny", prompt="Hi", max_tokens=2),
                                metadata=ALICE))
    assert deltas[-1].finish_reason
    codes = []
    for request, metadata in (
            (pb.GenerateRequest(model="tiny", prompt="Hi"), ()),  # no key
            (pb.GenerateRequest(model="tiny", prompt="Hi", prompt_token_ids=[1]), ALICE),
            (pb.GenerateRequest(model="nope", prompt="Hi"), ALICE)):  # the serving layer's
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, metadata=metadata))
        codes.append(info.value.code())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT,
                     grpc.StatusCode.NOT_FOUND]
    assert stub.ListModels(pb.ListModelsRequest(), metadata=ALICE).models  # not audited
    server.gate.clear()
    try:  # queued behind a held request until the call's own deadline passes
        running = in_thread(lambda: post(server, "/v1/completions", {**SMALL, "stream": True}))
        wait_for(lambda: server.engine.stats().num_running == 1, "the first request to run")
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(model="tiny", prompt="Hi", max_tokens=2),
                               metadata=ALICE, timeout=0.5))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        # The held engine takes the abort at its next step: the call ends with its last output.
        server.gate.set()
    wait_for(lambda: len(server.ledger.outcomes) >= sent.outcomes + 6, "the call to end")
    running[0].join(60)
    outcomes = sent.ended(Counter({("ok", True): 2, ("401_invalid_api_key", False): 1,
                                   ("400_invalid_request_error", False): 1,
                                   ("404_model_not_found", False): 1, ("ok", False): 1,
                                   # the gRPC deadline cancels the call: it ends aborted
                                   ("client_disconnected", True): 1}),
                          audited=5, holds=3, leases=3)  # the 401: in a summary (H6)
    assert {o.ctx.transport for o in outcomes} == {"grpc", "http"}


# ---------------------------------------------------------------- the batch runner


def test_batch_lines_each_end_once(server, tmp_path):
    """The batch runner's own serving layer (no request counter): its lines' outcomes reach the
    access log, the audit log and their holds once each."""
    lines = [{"custom_id": "ok", "url": "/v1/completions", "body": SMALL},
             {"custom_id": "bad", "url": "/v1/completions", "body": 1},  # refused before
             {"custom_id": "nope", "url": "/v1/completions", "body": {**SMALL, "model": "no"}},
             {"custom_id": "long", "url": "/v1/completions",
              "body": {**SMALL, "max_tokens": 1000}}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    sent = Sent(server)
    gateway, principal = batch_gateway(server.dir / "tenants.toml", "alice")
    asyncio.run_coroutine_threadsafe(
        answer_items(server.engine, "tiny", read_input(inp), out, gateway, principal,
                     serving_of(server.app).policy), server.loop).result(120)
    results = {r["custom_id"]: r["response"]["status_code"]
               for r in map(json.loads, out.read_text().splitlines())}
    assert results == {"ok": 200, "bad": 400, "nope": 404, "long": 400}
    sent.idle()
    records = all_records(server)[sent.audit:]
    assert sorted((r["route"], r["status_code"]) for r in records) == [
        ("batch:/v1/completions", 200), ("batch:/v1/completions", 400),
        ("batch:/v1/completions", 400), ("batch:/v1/completions", 404)]
    assert len({r["request_id"] for r in records}) == 4
    access = server.ledger.access[sent.access:]
    assert [(r["transport"], r["status"]) for r in access] == [("batch", "ok")]
    assert len(server.ledger.outcomes) == sent.outcomes  # not the server's sinks
    sent.held(holds=1, leases=2, finished=1)
