"""Prefill/decode disaggregation (issue 40, jaxserve.disagg): the KV frame's checks, then real
`serve --role prefill` and `--role decode` processes on 127.0.0.1 with a tiny random model: the
decode server's tokens equal a colocated engine's, and each side is killed mid-request (a dead
prefill fails the request with a 502 at once; a client abort and a dead decode server free the
prefill server's request; no page is left held on either side)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from jaxserve.core.cache import extend_page_hashes
from jaxserve.core.kv_transfer import KVLayout
from jaxserve.disagg import transport
from jaxserve.disagg.config import DisaggConfig
from jaxserve.disagg.prefill_client import PrefillClient
from jaxserve.entrypoints.process import ServerProcess
from jaxserve.errors import ConfigError, PrefillFailed
from tests.serve_slowed import STEP_DELAY_ENV
from tests.test_cli import ROOT, tiny_gguf
from tests.test_server import scrape, wait_for, wait_idle

LAYOUT = KVLayout(2, 16, (16, 4, 8), "float32")
SECRET = "s3cret-shared-by-both-sides"


def _pages(n: int) -> np.ndarray:
    return np.arange(2 * n * 16 * 4 * 8, dtype=np.float32).reshape(2, n, 16, 4, 8)


def test_a_frame_round_trips_and_a_bad_one_is_named():
    frame = transport.encode("r1", LAYOUT, _pages(3))
    np.testing.assert_array_equal(transport.decode(frame, "r1", LAYOUT, 3), _pages(3))
    flipped = bytearray(frame)
    flipped[100] ^= 1
    cases = [(bytes(flipped), "r1", LAYOUT, 3, "checksum"),
             (frame, "r2", LAYOUT, 3, "for request 'r1'"),
             (frame, "r1", KVLayout(2, 16, (16, 4, 8), "bfloat16"), 3, "layout"),
             (frame, "r1", LAYOUT, 2, "3 pages where the prompt has 2"),
             (frame[:60], "r1", LAYOUT, 3, "a header of"),
             (b"GET / HTTP/1.1" * 4, "r1", LAYOUT, 3, "not a KV frame")]
    for data, rid, layout, max_pages, why in cases:
        with pytest.raises(PrefillFailed, match=why):
            transport.decode(data, rid, layout, max_pages)


def test_the_roles_flags_are_checked():
    for kwargs, why in [(dict(role="decode", secret=SECRET), "--prefill-url"),
                        (dict(role="decode", prefill_urls=("ftp://x",), secret=SECRET), "http"),
                        (dict(role="prefill", secret="short"), "secret"),
                        (dict(role="both", prefill_urls=("http://x",)), "--role decode"),
                        (dict(role="prefill", secret=SECRET, prefill_timeout_s=0), "timeout")]:
        with pytest.raises(ConfigError, match=why):
            DisaggConfig(**kwargs)
    client = PrefillClient(["http://a:1", "http://b:1", "http://c:1"], SECRET, 1.0)
    firsts = [bytes([i]) * 16 for i in range(32)]
    chosen = {client.order(h)[0] for h in firsts}
    assert chosen == set(client.urls)  # spread over all, and stable for one prefix:
    assert all(client.order(h) == client.order(h) for h in firsts)


# ---------------------------------------------------------------- real servers

STEP_DELAY_S = 0.2  # the prefill server's steps: LONG's prefill takes over 3 s
DECODE_A_STEP_DELAY_S = 0.02  # decode server a's: its busy work outlasts the router test
# One sequence a step and a short context: few programs to compile (three servers start).
ENGINE = ["--num-pages", "40", "--max-num-seqs", "1", "--max-num-batched-tokens", "16",
          "--min-token-bucket", "16", "--max-model-len", "256", "--kv-offloading-size", "0.0003",
          "--no-rag"]
PREFILL_TIMEOUT_S = 3  # decode server b's
LOCAL_PREFILL_TOKENS = 32  # decode server b's --max-local-prefill-length
LONG = [1000 + 7 * i for i in range(240)]  # 14 full pages to send: 15 prefill steps


@pytest.fixture(scope="module")
def servers(tmp_path_factory, smollm2_tokenizer_fields):
    """(prefill, decode a, decode b): both decode servers use the one prefill server; a's steps
    are slowed a little; b waits PREFILL_TIMEOUT_S for it and prefills prompts up to
    LOCAL_PREFILL_TOKENS itself."""
    tmp = tmp_path_factory.mktemp("disagg")
    model = tiny_gguf(tmp / "tiny.gguf", smollm2_tokenizer_fields, max_position_embeddings=256)
    secret = tmp / "secret"
    secret.write_text(SECRET)
    with socket.socket() as s:  # the decode servers need the prefill server's port up front
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--model", str(model), "--served-model-name", "tiny", *ENGINE, "--kv-transfer-secret-file", str(secret)]
    env = dict(os.environ, **{STEP_DELAY_ENV: str(STEP_DELAY_S)})
    starts = [dict(args=[*common, "--role", "prefill", "--port", str(port)],
                   module="tests.serve_slowed", env=env)]
    starts += [dict(args=[*common, "--role", "decode", "--port", "0", "--prefill-url",
                          f"http://127.0.0.1:{port}", "--prefill-timeout", str(timeout),
                          "--max-local-prefill-length", str(local)], **slowed)
               for timeout, local, slowed in (
                   (60, 0, dict(module="tests.serve_slowed", env=dict(
                       os.environ, **{STEP_DELAY_ENV: str(DECODE_A_STEP_DELAY_S)}))),
                   (PREFILL_TIMEOUT_S, LOCAL_PREFILL_TOKENS, {}))]
    logs = [(tmp / f"{i}.log").open("w") for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(ServerProcess, cwd=ROOT, stderr=log, ready_timeout_s=600, **kw)
                   for kw, log in zip(starts, logs)]
        procs = [f.result() for f in futures]
    yield procs
    for p in procs:
        p.kill()
    for log in logs:
        log.close()


@pytest.fixture(scope="module")
def router(servers, tmp_path_factory):
    """`jaxserve router` in front of decode servers a and b, reading their load every 0.2 s."""
    with (tmp_path_factory.mktemp("router") / "router.log").open("w") as log:
        proc = ServerProcess(["--decode-url", _base(servers[1]), "--decode-url",
                              _base(servers[2]), "--port", "0", "--load-interval", "0.2",
                              "--max-body-bytes", str(1 << 20)],
                             log, cwd=ROOT, ready_timeout_s=60, command="router")
        yield proc
        proc.kill()


def _base(proc) -> str:
    return proc.url.removesuffix("/v1")


def _labeled(proc, name: str) -> dict[tuple, float]:
    """One metric's samples, {sorted label items: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.test_server import http_get

    return {tuple(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(http_get(f"{_base(proc)}/metrics").text)
            for s in f.samples if s.name == name}


def _complete(proc, prompt):
    import openai

    client = openai.OpenAI(base_url=proc.url, api_key="none", max_retries=0)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                     logprobs=1, extra_body={"ignore_eos": True}).choices[0]


def _send(proc, prompt, max_tokens: int = 8, headers: str = "", **fields) -> socket.socket:
    """A completion request on a raw connection (to close mid-request, or read to its end)."""
    port = int(_base(proc).rsplit(":", 1)[1])
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                       **fields}).encode()
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                 f"Connection: close\r\n{headers}\r\n".encode() + body)
    return conn


def _reply(conn: socket.socket) -> tuple[int, bytes]:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    conn.close()
    return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[1]


def test_decode_server_continues_from_the_prefill_servers_pages(servers):
    prefill, decode, _ = servers
    prompt = LONG[:100]  # 6 full pages travel; the last 4 tokens are computed on the decode side
    colocated = _complete(prefill, prompt)  # the prefill server serves /v1 itself too
    before = scrape(_base(decode))
    sent_before = scrape(_base(prefill))
    ours = _complete(decode, prompt)
    assert ours.text == colocated.text
    for a, b in zip(ours.logprobs.token_logprobs, colocated.logprobs.token_logprobs):
        assert abs(a - b) < 1e-4
    after = wait_idle(_base(decode))
    assert after["jaxserve:kv_offload_hits_total"] - before["jaxserve:kv_offload_hits_total"] \
        == 6 * 16  # the 6 pages were restored from what the prefill server sent, not computed
    sent = wait_idle(_base(prefill))
    # The transfer metrics on both sides: one 6-page frame, the same bytes sent and received.
    for side, a, b in (("prefill", sent_before, sent), ("decode", before, after)):
        assert b["jaxserve:kv_transfer_pages_total"] - a["jaxserve:kv_transfer_pages_total"] == 6
        assert b["jaxserve:kv_transfer_seconds_count"] - a["jaxserve:kv_transfer_seconds_count"] \
            == 1, side
    moved = [b["jaxserve:kv_transfer_bytes_total"] - a["jaxserve:kv_transfer_bytes_total"]
             for a, b in ((sent_before, sent), (before, after))]
    assert moved[0] == moved[1] > 0, moved


def test_a_short_prompt_is_prefilled_on_the_decode_server(servers):
    prefill, _, decode = servers  # b: --max-local-prefill-length 32
    short, longer = [7000 + i for i in range(30)], [7100 + i for i in range(40)]
    colocated = _complete(prefill, short)
    wait_idle(_base(prefill))
    done = _prompts_done(prefill)
    skipped = _labeled(decode, "jaxserve:kv_transfer_skipped_total")
    ours = _complete(decode, short)  # a full page, but 30 tokens <= 32: no transfer
    assert ours.text == colocated.text
    assert _prompts_done(prefill) == done  # the prefill server never saw it
    after = _labeled(decode, "jaxserve:kv_transfer_skipped_total")
    key = (("reason", "short_prompt"),)
    assert after[key] - skipped.get(key, 0) == 1
    pages = scrape(_base(decode))["jaxserve:kv_transfer_pages_total"]
    _complete(decode, longer)  # 40 uncached tokens > 32: its 2 full pages come from prefill
    assert scrape(_base(decode))["jaxserve:kv_transfer_pages_total"] - pages == 2
    wait_idle(_base(decode))
    wait_idle(_base(prefill))


def _generated(proc) -> float:
    return scrape(_base(proc))["jaxserve:generation_tokens_total"]


def test_the_router_sends_new_requests_to_the_less_loaded_decode_server(servers, router):
    import openai

    _, a, b = servers
    # a made busy directly (short prompts: no prefill server involved): 1 running, 2 waiting,
    # each to its full 240 tokens at >= DECODE_A_STEP_DELAY_S a step: busy for 14 s at least,
    # however fast the host (unslowed, a quiet host drained them before the router's requests).
    busy = [_send(a, [8000 + k, 8001, 8002], max_tokens=240, ignore_eos=True, temperature=0)
            for k in range(3)]
    try:
        wait_for(lambda: scrape(_base(a))["jaxserve:num_requests_waiting"] >= 2,
                 "decode server a to queue", 30)
        time.sleep(1.5)  # the router reads the load every 0.2 s (slower on a loaded host)
        before_b = _generated(b)
        client = openai.OpenAI(base_url=router.url, api_key="none", max_retries=0)
        for k in range(4):
            text = client.completions.create(model="tiny", prompt=[9000 + k, 9001], max_tokens=4,
                                             temperature=0, extra_body={"ignore_eos": True})
            assert len(text.choices[0].text) > 0
        assert _generated(b) - before_b == 16  # all four went to b (a, idle, would win a tie)
        assert scrape(_base(a))["jaxserve:num_requests_running"] == 1  # a was busy throughout
        # Streaming passes through as it comes: the same text, chunk by chunk.
        whole = client.completions.create(model="tiny", prompt=[9100, 9101], max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
        chunks = [c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=[9100, 9101], max_tokens=8, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices]
        assert len(chunks) >= 2 and "".join(chunks) == whole.choices[0].text
    finally:
        for conn in busy:
            conn.close()  # the client goes away: a aborts them
    wait_idle(_base(a))
    # A body over --max-body-bytes is refused by the router itself.
    status, _ = _reply(_send(router, "x" * (1 << 20)))
    assert status == 413
    # A client leaving the router aborts the request on the decode server and its prefill server.
    prefill = servers[0]
    done = _prompts_done(prefill)
    conn = _send(router, LONG)
    _until_prefilling(prefill)
    conn.close()
    wait_idle(_base(prefill))
    assert _prompts_done(prefill) == done  # aborted there, not run to its end
    wait_idle(_base(a))
    wait_idle(_base(b))


def test_an_unreachable_prefill_server_is_passed_over(servers):
    prefill = servers[0]
    with socket.socket() as s:  # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = PrefillClient([dead, _base(prefill)], SECRET, 30.0)
    # A prompt whose first page puts the dead server first in its order.
    ids = next(ids for k in range(64) if client.order(extend_page_hashes(
        [], ids := [6000 + k + i for i in range(40)], 16, 1, None)[0])[0] == dead)
    pages = asyncio.run(client.prefill("r-pass", ids, None, LAYOUT))
    assert pages.shape == (2, 2, 16, 4, 8) and np.abs(pages).sum() > 0
    wait_idle(_base(prefill))


def _until_prefilling(prefill) -> None:
    wait_for(lambda: scrape(_base(prefill))["jaxserve:num_requests_running"] >= 1,
             "the prefill server to run the request", 30)


def _prompts_done(proc) -> float:
    """Prompt tokens of requests that produced their first token (an aborted prefill: none)."""
    return scrape(_base(proc))["jaxserve:prompt_tokens_total"]


def _failures(proc, role: str, reason: str) -> float:
    return _labeled(proc, "jaxserve:kv_transfer_failures_total").get(
        (("reason", reason), ("role", role)), 0.0)


def _until_failures(proc, role: str, reason: str, count: float) -> None:
    wait_for(lambda: _failures(proc, role, reason) == count,
             f"{role} failures {reason} to reach {count}", 30)


def test_a_client_abort_reaches_both_sides(servers):
    prefill, decode, _ = servers
    done = _prompts_done(prefill)
    failures = [_failures(prefill, "prefill", "cancelled"), _failures(decode, "decode",
                                                                      "cancelled")]
    conn = _send(decode, LONG)
    _until_prefilling(prefill)
    conn.close()  # the client goes away mid-prefill
    wait_idle(_base(prefill))
    assert _prompts_done(prefill) == done  # aborted there, not run to its end
    wait_idle(_base(decode))
    _until_failures(prefill, "prefill", "cancelled", failures[0] + 1)
    _until_failures(decode, "decode", "cancelled", failures[1] + 1)


def test_a_hung_prefill_server_fails_the_request_after_the_timeout(servers):
    prefill, _, decode = servers
    timeouts = _failures(decode, "decode", "timeout")
    prefill.proc.send_signal(signal.SIGSTOP)  # it accepts connections (the kernel does) but
    try:                                      # answers nothing
        started = time.monotonic()
        status, body = _reply(_send(decode, [4000 + i for i in range(40)]))
        waited = time.monotonic() - started
        # A request's own deadline, shorter than the timeout, ends its wait first: a 504.
        started = time.monotonic()
        deadline_status, deadline_body = _reply(_send(decode, [5000 + i for i in range(40)],
                                                      headers="X-Request-Timeout: 1\r\n"))
        deadline_waited = time.monotonic() - started
    finally:
        prefill.proc.send_signal(signal.SIGCONT)
    assert status == 502 and f"within {PREFILL_TIMEOUT_S} s".encode() in body, body
    assert PREFILL_TIMEOUT_S <= waited < PREFILL_TIMEOUT_S + 10
    assert deadline_status == 504 and b"waiting for its prefill" in deadline_body, deadline_body
    assert 1 <= deadline_waited < PREFILL_TIMEOUT_S
    assert _failures(decode, "decode", "timeout") == timeouts + 1
    wait_idle(_base(decode))
    wait_idle(_base(prefill))  # awake, it finds its caller gone: nothing is left running


def test_a_dead_decode_server_frees_the_prefill_servers_pages(servers):
    prefill, _, decode = servers
    done = _prompts_done(prefill)
    conn = _send(decode, LONG)
    _until_prefilling(prefill)
    decode.proc.send_signal(signal.SIGKILL)
    wait_idle(_base(prefill))
    assert _prompts_done(prefill) == done
    conn.close()


def test_the_router_passes_over_a_dead_decode_server(servers, router):
    import openai

    a, b = servers[1], servers[2]
    assert b.proc.poll() is not None  # killed by the test before
    before = _generated(a)
    client = openai.OpenAI(base_url=router.url, api_key="none", max_retries=0)
    for k in range(3):
        client.completions.create(model="tiny", prompt=[9300 + k], max_tokens=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert _generated(a) - before == 6
    wait_idle(_base(a))


def test_a_dead_prefill_server_fails_the_request_at_once(servers):
    prefill, decode, _ = servers
    lost, unreachable = (_failures(decode, "decode", "connection"),
                         _failures(decode, "decode", "unreachable"))
    conn = _send(decode, LONG)
    _until_prefilling(prefill)
    prefill.proc.send_signal(signal.SIGKILL)
    started = time.monotonic()
    status, body = _reply(conn)
    assert time.monotonic() - started < 10.0  # the connection's end, not --prefill-timeout
    assert status == 502 and b"prefill_failed" in body and b"failed during the prefill" in body
    wait_idle(_base(decode))
    # With no prefill server left, a new request fails the same way, at once.
    status, body = _reply(_send(decode, [3000 + i for i in range(40)]))
    assert status == 502 and b"no prefill server could be reached" in body, body
    wait_idle(_base(decode))
    assert (_failures(decode, "decode", "connection"), _failures(decode, "decode", "unreachable")
            ) == (lost + 1, unreachable + 1)
