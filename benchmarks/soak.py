"""Soak test: N requests at concurrency C against a real `jaxserve serve`, mixing what a public
endpoint sees: normal chats (plain and streamed), streams the client cuts after a few chunks,
clients that give up while waiting, and malformed or hostile bodies (`"n": 1000000`, JSON nested
5,000 deep, a lone UTF-16 surrogate, a body over the size limit, ...), and a flood of wrong keys
(`wrong_key`: the admin API's, from a second loopback address, 127.0.0.2, as an attacker's would
be, so the server's per-address throttle refuses it and not the other kinds).

Passes when every request ended exactly once, as its kind allows (an answer, a 4xx, or the
client's own cancel), nothing answered 5xx or hung, and afterwards the server is idle (running,
waiting and KV usage all 0 on /metrics) and still answers a chat. With --server-log (the server's
stderr) it also checks the server's side: one access-log line per generation that started, none
twice, none failed. When it starts the server (with --audit-log and an admin key), it also
checks the audit log: it verifies, and the wrong keys left no record each, only `refusals`
summaries that count every one of them (review a70e490, H6); and its usage records agree with
the token counters on /metrics to the token, per tenant and version, prompt and completion tokens
apart, and per version with what the engine computed (issue 39: cancels, cut streams and
refusals included).

    python benchmarks/soak.py --num-requests 2000 --concurrency 32     # starts jaxserve itself
    python benchmarks/soak.py --base-url http://127.0.0.1:8000/v1 --max-body-bytes 16777216

With a gRPC target (--grpc-target; the server it starts has one) it also sends hostile Embed
calls that must be refused without the server running out of memory (review a70e490, H2): 1.5M
empty strings in one message (INVALID_ARGUMENT), and a message over the 4 MiB receive limit
(RESOURCE_EXHAUSTED); a server without retrieval answers the first UNIMPLEMENTED (start it with
--rag to reach the encoder's checks).

Clients that leave while their grammar compiles (`compile_leave`, --compile-leaves; review
a70e490, H3) must leave nothing held. When it starts the server (write timeout 3 s), one client
streams 8 choices with top-20 logprobs and reads nothing (`unread_stream`; review a70e490, H1):
the server must drop it within its write timeout, the request aborted (no [DONE] when
read afterwards), and its memory grow less than 512 MiB.

Exit status 0 when it passes; the last stdout line is the JSON report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import contextlib
import re
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp

import provenance  # benchmarks/ is the script's directory

SMOLLM2 = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[1]
_TIMEOUT_S = 300.0  # a request still open after this long has hung: a failure
# (kind, weight): what a request is, and how often
KINDS = (("chat", 24), ("stream", 12), ("stream_cut", 14), ("give_up", 10), ("n_huge", 5),
         ("deep_json", 5), ("surrogate", 5), ("malformed", 4), ("unknown_field", 3),
         ("bad_type", 3), ("many_stops", 3), ("too_large", 2), ("top_logprobs", 3),
         ("unknown_model", 3), ("many_messages", 4), ("wrong_key", 6))
# What each kind may end as: "answer" (2xx), "4xx", "cancel" (the client hung up first).
ALLOWED = {"chat": {"answer"}, "stream": {"answer"}, "stream_cut": {"cancel", "answer"},
           "give_up": {"cancel", "answer"}, "unread_stream": {"cancel"},
           "compile_leave": {"cancel"}}
_WORDS = "the a river stone light quiet engine paper seven under over blue".split()


@dataclass
class Outcome:
    kind: str
    end: str  # answer | 4xx | cancel | 5xx | other | hung
    status: int | None = None
    detail: str = ""


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _chat(model: str, rng: random.Random, **extra) -> dict:
    content = _text(rng, rng.randint(3, 30))
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.7]), **extra}


def hostile_body(kind: str, model: str, rng: random.Random, max_body_bytes: int) -> bytes:
    """The raw body of a request that must be refused with a 4xx."""
    chat = _chat(model, rng)
    bodies = {
        "n_huge": lambda: {**chat, "n": 1_000_000},
        "surrogate": lambda: {"model": model, "prompt": "\ud800 " + _text(rng, 5)},
        "unknown_field": lambda: {**chat, "frobnicate": True},
        "bad_type": lambda: {**chat, "temperature": "hot"},
        "many_stops": lambda: {**chat, "stop": [str(i) for i in range(40)]},
        "top_logprobs": lambda: {**chat, "logprobs": True, "top_logprobs": 50},
        "unknown_model": lambda: {**chat, "model": "no-such-model"},
        "many_messages": lambda: {**chat, "messages": chat["messages"] * 5000},
    }
    if kind == "deep_json":
        return b"[" * 5000 + b"]" * 5000
    if kind == "malformed":
        return b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", '
    if kind == "too_large":
        return json.dumps({**chat, "messages": [{"role": "user",
                                                 "content": "x" * (max_body_bytes + 1)}]}).encode()
    return json.dumps(bodies[kind]()).encode()


async def hostile_embeds(target: str, calls: int) -> list[Outcome]:
    """gRPC Embed calls that must be refused, half `embed_many` (1.5M empty strings, ~3 MB: within
    the receive limit, past the 2,048 inputs allowed), half `embed_oversize` (a 5 MiB string)."""
    import grpc

    from jaxserve.protos import generation_pb2 as pb
    from jaxserve.protos import generation_pb2_grpc as pb_grpc
    from jaxserve.rag.config import EMBEDDING_MODEL

    refused = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
               grpc.StatusCode.UNIMPLEMENTED}
    inputs = {"embed_many": [""] * 1_500_000, "embed_oversize": ["x" * (5 << 20)]}

    async def one_embed(stub, kind: str) -> Outcome:
        try:
            await stub.Embed(pb.EmbedRequest(model=EMBEDDING_MODEL, input=inputs[kind]),
                             timeout=_TIMEOUT_S)
            return Outcome(kind, "answer", 200, "a hostile Embed was answered")
        except grpc.aio.AioRpcError as e:
            end = ("4xx" if e.code() in refused else
                   "hung" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "5xx")
            return Outcome(kind, end, None, f"{e.code().name}: {e.details()}"[:200])

    async with grpc.aio.insecure_channel(target, options=[
            ("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = pb_grpc.GenerationStub(channel)
        return list(await asyncio.gather(*(one_embed(stub, kind) for kind in
                                           ("embed_many", "embed_oversize") * (calls // 2))))


# The write timeout of the server this starts: a client that stops reading is dropped after it.
_WRITE_TIMEOUT_S = 3


def raw_post(base: str, path: str, body: dict, rcvbuf: int | None = None,
             key: str | None = None) -> socket.socket:
    """Send one request on a raw socket and read nothing yet (`rcvbuf`: a tiny receive buffer,
    so the server's writes stall as soon as the kernel buffers fill; `key`: its API key)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"{auth}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def unread_stream(base: str, model: str, long: int, pid: int) -> Outcome:
    """`unread_stream` (review a70e490, H1): 8 choices with top-20 logprobs streamed to a client
    that reads nothing (megabytes, past every buffer). The server must keep its memory (it
    queued one cumulative snapshot per step: O(n T^2)) and drop the client once a write has
    waited its write timeout, aborting the request: reading afterwards finds no [DONE]."""
    rss = _rss_bytes(pid)
    body = {"model": model, "stream": True, "n": 8, "max_tokens": long, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 20, "messages": [{"role": "user", "content": "Hi"}]}
    sock = raw_post(base, "/v1/chat/completions", body, rcvbuf=4096)
    try:
        time.sleep(1)
        settle(base, _TIMEOUT_S)  # aborted by the write timeout (or, unfixed, run to its end)
        time.sleep(_WRITE_TIMEOUT_S + 2)
        grown = _rss_bytes(pid) - rss
        sock.settimeout(10)
        received = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(1 << 20):
                received += chunk
    finally:
        sock.close()
    if b"data: [DONE]" in received:
        return Outcome("unread_stream", "other", None, "a client that read nothing was not dropped")
    if grown > 512 << 20:
        return Outcome("unread_stream", "other", None, f"the server grew {grown >> 20} MiB")
    return Outcome("unread_stream", "cancel", None, f"dropped; the server grew {grown >> 20} MiB")


def leave_during_compile(base: str, model: str, calls: int, seed: int) -> list[Outcome]:
    """`compile_leave` (review a70e490, H3): constrained chats, each with a schema of its own
    (so its grammar compiles), whose clients leave 50 ms after sending. The server must end
    each once and hold nothing for them afterwards (idle; the lockout of a tenant's slots
    itself is tests/test_hostile_clients.py's, with a concurrency limit)."""
    outcomes = []
    for i in range(calls):
        schema = {"type": "object", "properties": {f"f{seed}_{i}_{j}": {"type": "integer"}
                                                   for j in range(20)}}
        body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "x", "schema": schema}}}
        sock = raw_post(base, "/v1/chat/completions", body)
        time.sleep(0.05)
        sock.close()
        outcomes.append(Outcome("compile_leave", "cancel"))
    return outcomes


def _error_event(raw: bytes) -> str | None:
    """A stream's first error event (a `data:` payload with a top-level "error"), else None. The
    event, not the bytes: a token "error" streams as `"content":"error"`."""
    for line in raw.splitlines():
        if line.startswith(b"data: {"):
            payload = json.loads(line.removeprefix(b"data: "))
            if "error" in payload:
                return json.dumps(payload)[:300]
    return None


def _classify(status: int) -> str:
    return ("answer" if 200 <= status < 300 else "4xx" if 400 <= status < 500
            else "5xx" if status >= 500 else "other")


async def one(session: aiohttp.ClientSession, url: str, model: str, kind: str, seed: int,
              max_body_bytes: int, long: int, flood: aiohttp.ClientSession) -> Outcome:
    """One request of `kind`; `long` is a max_tokens that fits the server's context; `flood`
    sends the wrong keys (from its own address)."""
    rng = random.Random(seed)
    try:
        if kind == "wrong_key":  # 401 until the address is throttled, then 429
            key = f"guess-{rng.getrandbits(64):016x}"
            async with flood.get(f"{url.removesuffix('/v1')}/admin/v1/versions",
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
                return Outcome(kind, _classify(resp.status), resp.status,
                               (await resp.text())[:200])
        if kind in ("chat", "stream"):
            body = _chat(model, rng, stream=kind == "stream")
            async with session.post(f"{url}/chat/completions", json=body) as resp:
                raw = await resp.read()
                if resp.status == 200 and kind == "stream" and not raw.rstrip().endswith(
                        b"data: [DONE]"):
                    return Outcome(kind, "other", resp.status, "stream without [DONE]")
                error = _error_event(raw) if resp.status == 200 and kind == "stream" else None
                if error is not None:
                    return Outcome(kind, "5xx", resp.status, f"error event in the stream: {error}")
                return Outcome(kind, _classify(resp.status), resp.status, raw[:200].decode())
        if kind == "stream_cut":
            body = {"model": model, "prompt": _text(rng, 12), "max_tokens": long,
                    "ignore_eos": True, "stream": True}
            async with session.post(f"{url}/completions", json=body) as resp:
                if resp.status != 200:
                    return Outcome(kind, _classify(resp.status), resp.status)
                events, cut_after = 0, rng.randint(1, 4)
                async for line in resp.content:
                    if line.startswith(b"data: [DONE]"):
                        return Outcome(kind, "answer", 200)
                    events += line.startswith(b"data: ")
                    if events >= cut_after:
                        resp.close()
                        return Outcome(kind, "cancel", 200)
                return Outcome(kind, "other", 200, "stream ended without [DONE]")
        if kind == "give_up":
            body = {"model": model, "prompt": _text(rng, 20), "max_tokens": long,
                    "ignore_eos": True}
            try:
                async with asyncio.timeout(rng.uniform(0.2, 2.0)):
                    async with session.post(f"{url}/completions", json=body) as resp:
                        await resp.read()
                        return Outcome(kind, _classify(resp.status), resp.status)
            except TimeoutError:
                return Outcome(kind, "cancel")
        data = hostile_body(kind, model, rng, max_body_bytes)
        path = "/completions" if kind == "surrogate" else "/chat/completions"
        async with session.post(f"{url}{path}", data=data,
                                headers={"Content-Type": "application/json"}) as resp:
            text = await resp.text()
            end = _classify(resp.status)
            if end == "4xx" and '"error"' not in text:
                end, text = "other", f"a 4xx without an OpenAI error body: {text[:200]}"
            return Outcome(kind, end, resp.status, text[:200])
    except (aiohttp.ClientError, ConnectionError) as e:
        if kind == "too_large":  # the server may answer and close before the upload ends
            return Outcome(kind, "4xx", None, f"connection closed on the oversized body: {e}")
        return Outcome(kind, "other", None, f"{type(e).__name__}: {e}")


async def run(url: str, model: str, num_requests: int, concurrency: int, seed: int,
              max_body_bytes: int) -> tuple[list[Outcome], float]:
    rng = random.Random(seed)
    long = min(200, _max_model_len(url) // 2)
    names, weights = zip(*KINDS)
    kinds = rng.choices(names, weights, k=num_requests)
    slots = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=concurrency)
    # The flood's own loopback address (all of 127/8 is this machine), when the server is here.
    local = ("127.0.0.2", 0) if "//127.0.0.1:" in url else None

    async def bounded(i: int, kind: str, session) -> Outcome:
        async with slots:
            try:
                return await one(session, url, model, kind, seed * 1_000_003 + i,
                                 max_body_bytes, long, flood)
            except TimeoutError:
                return Outcome(kind, "hung", None, f"no end within {_TIMEOUT_S:.0f} s")

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session, \
            aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(
                limit=concurrency, local_addr=local)) as flood:
        outcomes = await asyncio.gather(*(bounded(i, k, session) for i, k in enumerate(kinds)))
    return list(outcomes), time.perf_counter() - start


def _max_model_len(url: str) -> int:
    with urllib.request.urlopen(f"{url}/models", timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["max_model_len"]


def _metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(jaxserve:\w+)(?:\{[^}]*\})? (\S+)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


def settle(base: str, deadline_s: float = 120.0) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds a KV page (or the last reading at the
    deadline)."""
    end = time.monotonic() + deadline_s
    while True:
        m = _metrics(base)
        idle = (m["jaxserve:num_requests_running"] == 0 and m["jaxserve:num_requests_waiting"] == 0
                and m["jaxserve:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > end:
            return m
        time.sleep(0.2)


def still_answers(url: str, model: str) -> int:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 4}).encode()
    req = urllib.request.Request(f"{url}/chat/completions", body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def server_side(log_text: str) -> dict:
    """The access log's lines: one per generation that started, each with its own id."""
    records = [json.loads(line.split("jaxserve.access: ", 1)[1])
               for line in log_text.splitlines() if "jaxserve.access: " in line]
    ids = Counter(r["request_id"] for r in records)
    return {"lines": len(records), "ids_twice": sum(1 for c in ids.values() if c > 1),
            "statuses": dict(Counter(r["status"] for r in records)),
            "server_errors": log_text.count("Traceback")}


def audit_side(directory: Path, wrong_keys: int) -> dict:
    """The audit log after the server stopped (which writes the last summaries): whether it
    verifies, and what the wrong keys left in it."""
    from jaxserve.audit import verify

    report = verify(directory)
    lines = [json.loads(line) for p in sorted(directory.glob("audit-*.jsonl"))
             for line in p.read_text().splitlines()]
    summaries = [r for r in lines if r["type"] == "refusals"]
    return {"verify": report.error or "ok", "records": len(lines),
            "admin_route_records": sum(r["type"] != "refusals" and
                                       str(r.get("route", "")).startswith("/admin/")
                                       for r in lines),
            "summaries": len(summaries), "refusals_counted": sum(r["count"] for r in summaries),
            "wrong_keys_sent": wrong_keys}


_TOKEN_COUNTERS = {"jaxserve:tenant_prompt_tokens_total": "prompt",
                   "jaxserve:tenant_generation_tokens_total": "completion",
                   "jaxserve:prompt_tokens_total": "engine_prompt",
                   "jaxserve:generation_tokens_total": "engine_completion"}


def token_counters(base: str) -> dict[tuple[str, str, str], float]:
    """The token counters on /metrics: {(what, version, tenant): tokens}, summed over the
    other labels (tenant "" for the engine's own)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in _TOKEN_COUNTERS:
                out[(_TOKEN_COUNTERS[s.name], s.labels["model_name"],
                     s.labels.get("tenant", ""))] += s.value
    return out


def usage_side(directory: Path, counters: dict) -> dict:
    """The audit log's usage records against the token counters read once every request had
    ended: per (tenant, version), prompt and completion tokens; per version, their sums against
    the engine's counters (what it computed). `mismatches` names every disagreement."""
    records: Counter = Counter()
    for p in sorted(directory.glob("audit-*.jsonl")):
        for r in map(json.loads, p.read_text().splitlines()):
            if r["type"] == "request":
                version = r["version"] or ""
                records[("prompt", version, r["tenant"])] += r["prompt_tokens"]
                records[("completion", version, r["tenant"])] += r["completion_tokens"]
    mismatches = [f"{what} tokens of tenant {tenant} on {version or '(no version)'}: "
                  f"{records[(what, version, tenant)]} in the audit log, "
                  f"{counters.get((what, version, tenant), 0):g} counted"
                  for what, version, tenant in sorted(set(records) | {
                      k for k in counters if not k[0].startswith("engine_")})
                  if records[(what, version, tenant)] != counters.get((what, version, tenant), 0)]
    for version in sorted({v for what, v, _ in counters if what.startswith("engine_")}):
        for what in ("prompt", "completion"):
            billed = sum(n for (w, v, _), n in records.items() if (w, v) == (what, version))
            computed = counters[(f"engine_{what}", version, "")]
            if billed != computed:
                mismatches.append(f"{what} tokens on {version}: {billed} in the audit log, "
                                  f"{computed:g} computed by the engine")
    return {"prompt_tokens": sum(n for (w, _, _), n in records.items() if w == "prompt"),
            "completion_tokens": sum(n for (w, _, _), n in records.items()
                                     if w == "completion"),
            "mismatches": mismatches}


def problems(outcomes: list[Outcome], idle: dict, final_status: int, server: dict | None,
             e2e_count: float | None, audit: dict | None = None,
             usage: dict | None = None) -> list[str]:
    found = []
    if usage is not None:
        found += [f"usage: {m}" for m in usage["mismatches"]]
    if audit is not None:
        if audit["verify"] != "ok":
            found.append(f"the audit log does not verify: {audit['verify']}")
        if audit["admin_route_records"] or audit["refusals_counted"] != audit["wrong_keys_sent"]:
            found.append(f"wrong keys are not summarised one for one: {audit}")
    for o in outcomes:
        allowed = ALLOWED.get(o.kind, {"4xx"})
        if o.end not in allowed:
            found.append(f"{o.kind}: ended {o.end} (HTTP {o.status}) {o.detail}")
    if not (idle["jaxserve:num_requests_running"] == idle["jaxserve:num_requests_waiting"]
            == idle["jaxserve:kv_cache_usage_perc"] == 0):
        found.append(f"not idle afterwards: {idle}")
    if final_status != 200:
        found.append(f"a chat after the soak answered {final_status}")
    if server is not None:
        if server["ids_twice"]:
            found.append(f"{server['ids_twice']} requests ended twice in the access log")
        if server["statuses"].get("error"):
            found.append(f"{server['statuses']['error']} generations failed on the server")
        if server["server_errors"]:
            found.append(f"{server['server_errors']} tracebacks in the server log")
        if e2e_count is not None and e2e_count != server["lines"]:
            found.append(f"{server['lines']} access-log lines for {e2e_count:.0f} generations")
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", help="a jaxserve /v1 URL (default: start jaxserve serve)")
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="the server's --max-body-bytes (passed to the server this starts)")
    p.add_argument("--server-log", type=Path,
                   help="the server's stderr, to check its access log (set when this starts it)")
    p.add_argument("--serve-flags", default="--max-model-len 512 --num-pages 512 "
                   "--max-num-seqs 16 --max-num-batched-tokens 128",
                   help="engine flags for the server this starts")
    p.add_argument("--grpc-target", help="the server's gRPC HOST:PORT, for the hostile Embed "
                   "calls (set when this starts the server)")
    p.add_argument("--embed-calls", type=int, default=4, help="hostile gRPC Embed calls")
    p.add_argument("--compile-leaves", type=int, default=8,
                   help="constrained chats whose clients leave while their grammar compiles")
    p.add_argument("--rag", action="store_true",
                   help="the server this starts serves retrieval (fetches all-minilm-l6-v2)")
    p.add_argument("--result-json", type=Path)
    args = p.parse_args(argv)

    commit = provenance.commit()
    server, url, log_path, audit_dir = None, args.base_url, args.server_log, None
    if url is None:
        from jaxserve.entrypoints.process import ServerProcess

        log = tempfile.NamedTemporaryFile("w", prefix="jaxserve-soak-", suffix=".log",
                                          delete=False)
        log_path = Path(log.name)
        audit_dir = Path(tempfile.mkdtemp(prefix="jaxserve-soak-audit-"))
        key_file = audit_dir.with_suffix(".admin-key")
        key_file.write_text(f"soak-{random.getrandbits(128):032x}")
        print(f"starting jaxserve serve (log: {log.name}, audit log: {audit_dir})",
              file=sys.stderr, flush=True)
        server = ServerProcess(["--model", args.model, "--port", "0", "--grpc-port", "0",
                                *([] if args.rag else ["--no-rag"]),
                                "--max-body-bytes", str(args.max_body_bytes),
                                "--stream-write-timeout", str(_WRITE_TIMEOUT_S),
                                "--audit-log", str(audit_dir), "--admin-key-file", str(key_file),
                                *args.serve_flags.split()], log, cwd=ROOT)
        url = server.url
        args.grpc_target = next(line.split(" on ", 1)[1].strip() for line in server.startup_lines
                                if line.startswith("jaxserve: gRPC on "))
    base = url.removesuffix("/v1")
    try:
        before = _metrics(base).get("jaxserve:e2e_request_latency_seconds_count", 0.0)
        outcomes, seconds = asyncio.run(run(url, args.model, args.num_requests, args.concurrency,
                                            args.seed, args.max_body_bytes))
        if args.grpc_target and args.embed_calls:
            outcomes += asyncio.run(hostile_embeds(args.grpc_target, args.embed_calls))
        outcomes += leave_during_compile(base, args.model, args.compile_leaves, args.seed)
        if server is not None:  # its write timeout and its memory are known
            outcomes.append(unread_stream(base, args.model,
                                          _max_model_len(url) - 64, server.proc.pid))
        idle = settle(base)
        final_status = still_answers(url, args.model)
        # (counted after that last chat, which the server's log holds too)
        e2e = _metrics(base).get("jaxserve:e2e_request_latency_seconds_count", 0.0) - before
        counters = token_counters(base) if audit_dir is not None else None
    finally:
        exit_code = server.stop() if server is not None else None
    server_report = server_side(log_path.read_text()) if log_path is not None else None
    if server_report is not None and args.base_url is not None:
        e2e = None  # a server we did not start may have served others before and during the run
    audit_report = (audit_side(audit_dir, sum(o.kind == "wrong_key" for o in outcomes))
                    if audit_dir is not None else None)
    usage_report = usage_side(audit_dir, counters) if audit_dir is not None else None
    found = problems(outcomes, idle, final_status, server_report, e2e, audit_report,
                     usage_report)
    if exit_code not in (None, 0):
        found.append(f"the server exited with {exit_code} on SIGTERM")
    by_kind: dict[str, Counter] = {}
    statuses: dict[str, Counter] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.end] += 1
        statuses.setdefault(o.kind, Counter())[str(o.status)] += 1  # "None": no HTTP answer
    report = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "command": " ".join(
        sys.argv if argv is None else ["benchmarks/soak.py", *argv]),
        "machine": provenance.cpu(), "requests": len(outcomes), "concurrency": args.concurrency,
        "seconds": round(seconds, 1), "requests_per_s": round(len(outcomes) / seconds, 2),
        "ends": dict(Counter(o.end for o in outcomes)),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "http_statuses": {k: dict(v) for k, v in sorted(statuses.items())},
        "generations_on_server": e2e, "server_log": server_report, "audit_log": audit_report,
        "usage": usage_report,
        "idle_after": {k.split(":")[1]: idle[k] for k in (
            "jaxserve:num_requests_running", "jaxserve:num_requests_waiting",
            "jaxserve:kv_cache_usage_perc")},
        "chat_after": final_status, "problems": found[:20], "passed": not found}
    print(f"soak: {len(outcomes)} requests at concurrency {args.concurrency} in {seconds:.1f} s: "
          f"{report['ends']}; {'PASSED' if not found else f'{len(found)} PROBLEMS'}",
          file=sys.stderr)
    for problem in found[:20]:
        print(f"  {problem}", file=sys.stderr)
    print(json.dumps(report))
    if args.result_json:
        args.result_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if not found else 1


if __name__ == "__main__":
    sys.exit(main())
