"""Usage a biller can trust (issue 39): after a mixed load on a real server (two versions of a
tiny random model, two tenants, an audit log, a small queue) with every way a request ends --
answered (streamed and not, n > 1), cut by its client mid-stream, given up while queued, its
deadline mid-generation, shed from the queue, refused at admission, a bad body, an unknown model,
an idempotent replay -- the audit log's usage records, the per-tenant token counters and the
engine's own token counters agree to the token, per tenant and version, prompt and completion
tokens apart. The engine's counters are what was computed: a request billed a prompt it never
ran, or missing the tokens drawn after its client left, breaks the equality."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.entrypoints.http.app_state import STATE_KEY
from jaxserve.fleet.deployment import VersionSpec
from jaxserve.fleet.fleet import Fleet
from jaxserve.gateway.pricing import Pricing
from tests.test_server import ServerThread, _request, queueing_engine, slowable, wait_for

PRICES = Pricing(prompt_per_1m=1.0, completion_per_1m=2.0)
ALICE, BOB = "sk-alice-0123456789abcdefghij", "sk-bob-0123456789abcdefghijkl"
TENANTS = (f'[tenant.alice]\napi_keys = ["{ALICE}"]\npriority = "interactive"\n'
           f'[tenant.bob]\napi_keys = ["{BOB}"]\npriority = "batch"\n')
MAX_QUEUED = 3  # sequences; bob's two queued requests are shed for alice's three
VERSIONS = ("va", "vb")


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer_fields):
    from jaxserve.entrypoints.http.app import attach_engine
    from tests.test_cli import tiny_gguf

    d = tmp_path_factory.mktemp("usage")
    (d / "tenants.toml").write_text(TENANTS)
    model = str(tiny_gguf(d / "tiny.gguf", smollm2_tokenizer_fields))

    engines = {name: queueing_engine(model) for name in VERSIONS}
    fleet = Fleet.of_engine(VERSIONS[0], engines[VERSIONS[0]], pricing=PRICES,
                            max_queued_requests=MAX_QUEUED)
    fleet.adopt(VersionSpec(VERSIONS[1], model), engines[VERSIONS[1]], pricing=PRICES)
    http = ServerThread(VERSIONS[0], tenants_file=str(d / "tenants.toml"),
                        max_queued_requests=MAX_QUEUED, audit_log_dir=str(d / "audit"))
    http.loop.call_soon_threadsafe(lambda: attach_engine(http.app, None, fleet=fleet))
    wait_for(lambda: _request("GET", f"{http.url}/ready").status_code == 200, "ready")
    http.dir, http.engines = d, engines
    # Each step 40 ms longer while set: the load's requests overlap the same way on any host.
    http.slow = [slowable(e.engine, 0.04) for e in engines.values()]
    yield http
    http.stop()
    fleet.shutdown()


def _body(version: str, **fields) -> dict:
    return {"model": version, "messages": [{"role": "user", "content": "Say something."}],
            "temperature": 0, **fields}


async def _post(session, server, key: str, body, *, path="/v1/chat/completions", headers=None,
                timeout=None) -> str:
    """POST and read the whole answer: "ok", "<status>", or "cancel" (gave up at `timeout`)."""
    try:
        async with session.post(f"{server.url}{path}", json=body, timeout=timeout,
                                headers={"Authorization": f"Bearer {key}", **(headers or {})}
                                ) as r:
            await r.read()
            return "ok" if r.status == 200 else str(r.status)
    except asyncio.TimeoutError:
        return "cancel"


async def _cut_stream(session, server, key: str, body, chunks: int) -> str:
    """Read `chunks` content chunks of a stream, then hang up."""
    async with session.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                            headers={"Authorization": f"Bearer {key}"}) as r:
        seen = 0
        async for line in r.content:
            if line.startswith(b"data: {") and b'"content":"' in line \
                    and b'"content":""' not in line:
                seen += 1
                if seen == chunks:
                    r.close()
                    return "cancel"
    return "ok"


async def _until(predicate, what: str) -> None:
    for _ in range(1200):
        if predicate():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"gave up waiting for {what}")


async def _version_load(session, server, version: str) -> list[str]:
    """One version's share of the load, in an order that makes each ending happen."""
    engine = server.engines[version]
    long = _body(version, max_tokens=80, ignore_eos=True)
    short = {"model": version, "prompt": "Once upon a time", "max_tokens": 3}
    # alice's long request runs until its deadline, tokens drawn by then
    running = asyncio.ensure_future(_post(session, server, ALICE, long,
                                          headers={"X-Request-Timeout": "1.5"}))
    await _until(lambda: engine.stats().num_running == 1, f"{version}: the long request to run")
    # alice gives up waiting behind it
    gave_up = await _post(session, server, ALICE, long, timeout=0.3)
    await _until(lambda: engine.stats().num_waiting == 0,
                 f"{version}: the abandoned request to leave")
    queued = []
    for i in range(2):  # bob's two wait in the queue ...
        queued.append(asyncio.ensure_future(_post(session, server, BOB, short,
                                                  path="/v1/completions")))
        await _until(lambda: engine.stats().num_waiting == i + 1,
                     f"{version}: bob's request to queue")
    # ... and are shed, one for alice's n=2 stream, one for her stream she cuts mid-way
    streamed = asyncio.ensure_future(_post(session, server, ALICE, _body(
        version, max_tokens=6, n=2, stream=True, stream_options={"include_usage": True})))
    await _until(lambda: queued[1].done(), f"{version}: bob's second request to be shed")
    cut = asyncio.ensure_future(_cut_stream(session, server, ALICE, long, chunks=3))
    await _until(lambda: queued[0].done(), f"{version}: bob's first request to be shed")
    await _until(lambda: engine.stats().num_waiting == 3, f"{version}: alice's to queue")
    # the queue is full of alice's: bob is refused at admission
    refused = await _post(session, server, BOB, short, path="/v1/completions")
    ends = [gave_up, refused] + list(await asyncio.gather(running, *queued, streamed, cut))
    # then, on a quiet engine: an answer, a bad body, an unknown model, a replay
    key = {"Idempotency-Key": f"usage-{version}"}
    ends += [await _post(session, server, BOB, _body(version, max_tokens=5), headers=key),
             await _post(session, server, BOB, _body(version, max_tokens=5), headers=key),
             await _post(session, server, BOB, _body(version, max_tokens=-1)),
             await _post(session, server, ALICE, _body(f"{version}-nope", max_tokens=2))]
    return ends


def _records(server) -> list[dict]:
    audit = server.app[STATE_KEY].policy.audit
    wait_for(lambda: audit.pending == 0, "the audit writer")
    raw = b"".join(p.read_bytes() for p in sorted((server.dir / "audit").glob("audit-*.jsonl")))
    return [r for r in map(json.loads, raw.splitlines()) if r["type"] == "request"]


def _counters(server) -> dict[tuple[str, ...], float]:
    """{(sample, model_name, tenant): value} of the token counters, summed over the rest."""
    text = _request("GET", f"{server.url}/metrics").text
    out: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("jaxserve:tenant_prompt_tokens_total",
                          "jaxserve:tenant_generation_tokens_total",
                          "jaxserve:prompt_tokens_total", "jaxserve:generation_tokens_total"):
                out[(s.name, s.labels["model_name"], s.labels.get("tenant", ""))] += s.value
    return out


def test_usage_records_match_the_token_counters_after_a_mixed_load_with_cancels(server):
    async def load():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(_version_load(session, server, v) for v in VERSIONS))

    for slow in server.slow:
        slow.set()
    try:
        ends = asyncio.run(load())
    finally:
        for slow in server.slow:
            slow.clear()
    for version, e in zip(VERSIONS, ends):
        # gave up, refused, deadline, shed x2, streamed, cut, answer, replay, 400, 404
        assert e == ["cancel", "503", "504", "503", "503", "ok", "cancel", "ok", "ok", "400",
                     "404"], (version, e)
    for e in server.engines.values():
        wait_for(lambda e=e: not e.engine.has_unfinished(), "the engines to go idle")
    records = _records(server)
    counters = _counters(server)
    statuses = Counter(r["status"] for r in records)
    assert (statuses["deadline"], statuses["client_disconnected"]) == (2, 4), statuses
    assert statuses["shed"] == 6, statuses  # 4 from the queue, 2 refused at admission
    assert sum(r["idempotent_replay"] for r in records) == 2
    # Tokens drawn by requests that did not end well are billed: the deadline's, the cut one's.
    assert all(r["completion_tokens"] > 0 for r in records if r["status"] == "deadline")
    assert sum(r["completion_tokens"] for r in records
               if r["status"] == "client_disconnected") > 0
    assert all(r["prompt_tokens"] == r["completion_tokens"] == 0 for r in records
               if r["status"] == "shed")
    for version in VERSIONS:
        computed = {"prompt": 0, "completion": 0}
        for tenant in ("alice", "bob"):
            mine = [r for r in records if r["version"] == version and r["tenant"] == tenant]
            prompt = sum(r["prompt_tokens"] for r in mine)
            completion = sum(r["completion_tokens"] for r in mine)
            assert (prompt, completion) == (
                counters[("jaxserve:tenant_prompt_tokens_total", version, tenant)],
                counters[("jaxserve:tenant_generation_tokens_total", version, tenant)]), \
                (version, tenant)
            computed["prompt"] += prompt
            computed["completion"] += completion
        # and what the engine computed, to the token
        assert (computed["prompt"], computed["completion"]) == (
            counters[("jaxserve:prompt_tokens_total", version, "")],
            counters[("jaxserve:generation_tokens_total", version, "")]), version
        assert computed["prompt"] > 0 and computed["completion"] > 0
