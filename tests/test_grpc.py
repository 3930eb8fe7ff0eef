"""The gRPC front end (jaxserve.v1) end to end: a real grpc.aio server on a free localhost port over
the real engine, called through jaxserve.entrypoints.client (asyncio and blocking). Streamed deltas
joining to the engine's own output, token-id prompts, sampling fields and seeds, every error's
status code, deadline expiry and client cancellation aborting the engine request (pages back in the
pool), ListModels, health, reflection as a generic tool uses it, golden greedy output and 16
concurrent streams on SmolLM2, and `jaxserve serve --grpc-port` as a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.entrypoints.client import AsyncClient, Client
from jaxserve.core.engine import LLMEngine
from jaxserve.core.engine_factory import build_engine
from jaxserve.protos import generation_pb2 as pb
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.entrypoints.grpc import SERVICE_NAME, completion_body, start_grpc_server
from tests.test_cli import ROOT, tiny_gguf
from tests.test_engine import assert_no_leaks

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny"
TINY_ENGINE_ARGS = dict(num_pages=160, max_num_seqs=8, max_num_batched_tokens=32,
                        max_model_len=2048, min_token_bucket=16)
LONG = 2000  # max_tokens of a request that cannot finish before the tests end it


class GrpcServerThread:
    """start_grpc_server on its own event-loop thread (as `jaxserve serve` runs it beside HTTP),
    so blocking clients can call it from the test thread. Bound to 127.0.0.1 on a free port."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, port = self._call(start_grpc_server(engine, "127.0.0.1", 0, model_name))
        self.target = f"127.0.0.1:{port}"

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def stop(self) -> None:
        self._call(self.server.stop(grace=None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def wait_idle(engine: AsyncEngine, deadline_s: float = 60.0):
    """Poll the engine's stats until no request runs, waits or holds a page; then check the pool.
    (Aborts land on the engine thread a moment after the RPC ends.)"""
    end = time.monotonic() + deadline_s
    while True:
        stats = engine.stats()
        if stats.num_running == stats.num_waiting == stats.pages_in_use == 0:
            break
        assert time.monotonic() < end, f"the engine is still busy: {stats}"
        time.sleep(0.05)
    engine.engine.scheduler.cache.check_invariants()
    return stats


def engine_output(engine: AsyncEngine, prompt, params: SamplingParams):
    """The engine's own final output for one request, without gRPC in between."""
    async def run():
        async for out in engine.generate(prompt, params):
            last = out
        return last

    return asyncio.run(run())


def assert_stream(deltas: list[pb.GenerateResponse], expected, finish_reason: str) -> None:
    """Deltas join to the expected CompletionOutput; only the last carries finish and usage."""
    assert len(deltas) > 1
    assert all(not d.finish_reason and not d.HasField("usage") for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == expected.outputs[0].text
    assert [t for d in deltas for t in d.token_ids] == expected.outputs[0].token_ids
    assert deltas[-1].finish_reason == finish_reason
    assert deltas[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    assert deltas[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


# ---------------------------------------------------------------- tiny random model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_tokenizer_fields):
    # 2048 positions: a request can still be running when its deadline expires or it is cancelled.
    return tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", smollm2_tokenizer_fields,
                     max_position_embeddings=2048)


@pytest.fixture(scope="module")
def tiny_engine(tiny_path):
    return build_engine(str(tiny_path), strict_compile=True, progress=False,
                        **TINY_ENGINE_ARGS)


def served(llm_engine: LLMEngine, model_name: str):
    """A module fixture's body: a server over the engine; at teardown, nothing was compiled while
    serving and every page is back."""
    engine = AsyncEngine(llm_engine)
    server = GrpcServerThread(engine, model_name)
    yield server
    server.stop()
    engine.shutdown()
    assert llm_engine.runner.num_serving_compiles == 0
    assert_no_leaks(llm_engine)


@pytest.fixture(scope="module")
def tiny(tiny_engine):
    yield from served(tiny_engine, TINY)


def test_stream_joins_to_the_engine_output_text_and_token_prompts(tiny):
    prompt = "The quick brown fox"
    ids = tiny.engine.tokenizer.encode(prompt)
    greedy = dict(max_tokens=24, temperature=0, ignore_eos=True)
    expected = engine_output(tiny.engine, prompt, SamplingParams(**greedy))
    with Client(tiny.target) as client:
        assert_stream(list(client.generate(TINY, prompt, **greedy)), expected, "length")
        assert_stream(list(client.generate(TINY, ids, **greedy)), expected, "length")
        joined = client.complete(TINY, ids, **greedy)
    assert joined.text == expected.outputs[0].text and joined.finish_reason == "length"

    async def streamed():
        async with AsyncClient(tiny.target) as client:
            return [d async for d in client.generate(TINY, prompt, **greedy)]

    assert_stream(asyncio.run(streamed()), expected, "length")
    # A stop string taken from the middle of that output cuts it there, with reason "stop".
    text = expected.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    with Client(tiny.target) as client:
        cut = client.complete(TINY, prompt, stop=[stop], **greedy)
    assert (cut.text, cut.finish_reason) == (text[:text.index(stop)], "stop")
    wait_idle(tiny.engine)


def test_sampling_fields_and_seed_reach_the_engine(tiny):
    fields = dict(temperature=0.9, top_p=0.8, top_k=40, min_p=0.01, presence_penalty=0.5,
                  frequency_penalty=0.25, repetition_penalty=1.25, max_tokens=16,
                  ignore_eos=True)
    ids = [700 + i for i in range(12)]
    expected = engine_output(tiny.engine, ids, SamplingParams(seed=1234, **fields))
    with Client(tiny.target) as client:
        first = client.complete(TINY, ids, seed=1234, **fields)
        other_seed = client.complete(TINY, ids, seed=1235, **fields)

    async def again():
        async with AsyncClient(tiny.target) as client:
            return await client.complete(TINY, ids, seed=1234, **fields)

    # Every field arrives as the engine's own SamplingParams would have it: same seed, same
    # tokens as the engine run directly, over both clients; another seed, other tokens.
    assert list(first.token_ids) == expected.outputs[0].token_ids
    assert list(asyncio.run(again()).token_ids) == expected.outputs[0].token_ids
    assert list(other_seed.token_ids) != list(first.token_ids)


INVALID = [
    (dict(prompt="hi", prompt_token_ids=[1, 2]), "not both"),
    (dict(), "one of 'prompt' and 'prompt_token_ids' is required"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", repetition_penalty=0.0), "repetition_penalty"),
    (dict(prompt="hi", num_speculative_tokens=-1), "num_speculative_tokens"),
    (dict(prompt_token_ids=[5, 49152]), "token id 49152 is outside the vocabulary [0, 49152)"),
    # too long: the message gives the numbers
    (dict(prompt_token_ids=[5] * 2040, max_tokens=10),
     "maximum context length is 2048 tokens. However, you requested 2050 tokens "
     "(2040 in the prompt, 10 in the completion)"),
]


@pytest.mark.parametrize("fields, message", INVALID)
def test_invalid_requests_are_invalid_argument(tiny, fields, message):
    with Client(tiny.target) as client:
        err = rpc_error(lambda: list(client.stub.Generate(pb.GenerateRequest(model=TINY,
                                                                             **fields))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.details()


def test_structured_outputs_field_constrains_the_output(tiny):
    """GenerateRequest.structured_outputs is vLLM's: a choice (even on random weights) gives one
    of the strings; a regex the library cannot compile is INVALID_ARGUMENT naming the field."""
    with Client(tiny.target) as client:
        out = client.complete(TINY, "Pick one:", max_tokens=8, temperature=0.8, seed=3,
                              structured_outputs=pb.StructuredOutputs(choice=["alpha", "beta"]))
        assert (out.text, out.finish_reason) in {("alpha", "stop"), ("beta", "stop")}
        out = client.complete(TINY, "Digits:", max_tokens=8, temperature=0.8, seed=4,
                              structured_outputs=pb.StructuredOutputs(regex="[0-9]{3}"))
        assert len(out.text) == 3 and out.text.isdigit() and out.finish_reason == "stop"
        for bad in (pb.StructuredOutputs(regex="("), pb.StructuredOutputs()):
            err = rpc_error(lambda: list(client.generate(TINY, "hi", structured_outputs=bad)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "structured_outputs" in err.details()
    wait_idle(tiny.engine)


def test_prompt_logprobs_echo_and_logprobs_are_the_engines(tiny):
    """echo / logprobs / prompt_logprobs go through HTTP completions' parsing: the first message
    carries the engine's own prompt scores (the first token without one), every message its
    tokens' logprobs, bit for bit; max_tokens 0 with echo scores the prompt, generating nothing."""
    ids = [700 + i for i in range(12)]
    fields = dict(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    expected = engine_output(tiny.engine, ids, SamplingParams(prompt_logprobs=3, **fields))
    with Client(tiny.target) as client:
        deltas = list(client.generate(TINY, ids, prompt_logprobs=3, **fields))
        scored = client.complete(TINY, ids, max_tokens=0, echo=True, logprobs=1)
        errors = [rpc_error(lambda: list(client.generate(TINY, ids, **bad)))
                  for bad in (dict(prompt_logprobs=21), dict(max_tokens=0, prompt_logprobs=1),
                              dict(logprobs=-1))]
    assert deltas[0].prompt_logprobs and not any(d.prompt_logprobs for d in deltas[1:])
    got = deltas[0].prompt_logprobs
    assert [p.token_id for p in got] == ids and not got[0].HasField("logprob")
    assert [(p.logprob, p.rank, [(t.token_id, t.logprob) for t in p.top_logprobs])
            for p in got[1:]] == [(w.logprob, w.rank, w.top) for w in expected.prompt_logprobs[1:]]
    generated = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in generated] == expected.outputs[0].token_ids
    assert [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs])
            for lp in generated] == [(w.logprob, w.top) for w in expected.outputs[0].logprobs]
    assert scored.text == tiny.engine.tokenizer.decode(ids) and not scored.token_ids
    assert (scored.finish_reason, scored.usage.completion_tokens) == ("length", 0)
    assert [p.logprob for p in scored.prompt_logprobs[1:]] == [
        w.logprob for w in expected.prompt_logprobs[1:]]
    assert all(len(p.top_logprobs) == 1 for p in scored.prompt_logprobs[1:])
    for err, param in zip(errors, ("prompt_logprobs", "max_tokens", "logprobs")):
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and param in err.details()
    wait_idle(tiny.engine)


def test_unknown_model_is_not_found_on_both_clients(tiny):
    with Client(tiny.target) as client:
        err = rpc_error(lambda: client.complete("nope", "hi"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "'nope' does not exist" in err.details()

    async def main():
        async with AsyncClient(tiny.target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.complete("nope", "hi")
            return info.value

    assert asyncio.run(main()).code() == grpc.StatusCode.NOT_FOUND
    assert tiny.engine.stats().num_waiting == 0  # refused before reaching the engine


def test_engine_dead_is_unavailable(tiny_engine):
    # A second AsyncEngine over the (idle) engine, shut down before it runs a step: its
    # server must refuse generation as UNAVAILABLE rather than an opaque UNKNOWN.
    dead = AsyncEngine(tiny_engine)
    dead.shutdown()
    server = GrpcServerThread(dead, TINY)
    try:
        with Client(server.target) as client:
            err = rpc_error(lambda: client.complete(TINY, "hi"))
            health = health_pb2_grpc.HealthStub(client.channel)
            status = health.Check(health_pb2.HealthCheckRequest()).status
    finally:
        server.stop()
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "not running" in err.details()
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # probes see the engine died


def test_deadline_expiry_aborts_the_engine_request(tiny):
    before = tiny.engine.stats().generation_tokens
    with Client(tiny.target) as client:
        err = rpc_error(lambda: list(client.generate(TINY, "Once upon a time", timeout=0.5,
                                                     max_tokens=LONG, ignore_eos=True)))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The pages come back because the request was aborted, not because it ran to the end.
    assert wait_idle(tiny.engine).generation_tokens - before < LONG


def test_client_cancel_aborts_the_engine_request(tiny):
    before = tiny.engine.stats().generation_tokens
    with Client(tiny.target) as client:
        call = client.generate(TINY, "Once upon a time", max_tokens=LONG, ignore_eos=True)
        received = [next(call) for _ in range(3)]
        call.cancel()
    assert all(d.token_ids for d in received)
    after = wait_idle(tiny.engine).generation_tokens
    assert 3 <= after - before < LONG

    async def cancel_async():
        async with AsyncClient(tiny.target) as client:
            call = client.generate(TINY, [9, 8, 7], max_tokens=LONG, ignore_eos=True)
            n = 0
            async for _ in call:
                n += 1
                if n == 3:
                    break
            call.cancel()
            return await call.code()

    assert asyncio.run(cancel_async()) == grpc.StatusCode.CANCELLED
    assert 3 <= wait_idle(tiny.engine).generation_tokens - after < LONG


def test_list_models_and_health(tiny):
    with Client(tiny.target) as client:
        models = client.list_models()
        health = health_pb2_grpc.HealthStub(client.channel)
        statuses = [health.Check(health_pb2.HealthCheckRequest(service=s)).status
                    for s in ("", SERVICE_NAME)]
        err = rpc_error(lambda: health.Check(health_pb2.HealthCheckRequest(service="nope")))
    assert [(m.id, m.max_model_len) for m in models] == [(TINY, 2048)]
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2
    assert err.code() == grpc.StatusCode.NOT_FOUND

    async def alist():
        async with AsyncClient(tiny.target) as client:
            return await client.list_models()

    assert asyncio.run(alist()) == models


def test_reflection_lets_a_generic_client_call_generate(tiny):
    # What grpcurl does: discover the service and its messages from the server alone, then call
    # Generate with dynamically built messages (none of our generated modules involved).
    with grpc.insecure_channel(tiny.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert {SERVICE_NAME, "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= set(db.get_services())
        pool = descriptor_pool.DescriptorPool(db)
        service = pool.FindServiceByName(SERVICE_NAME)
        assert {m.name for m in service.methods} == {"Generate", "Embed", "ListModels"}
        method = service.methods_by_name["Generate"]
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        generate = channel.unary_stream(f"/{SERVICE_NAME}/Generate",
                                        request_serializer=request_cls.SerializeToString,
                                        response_deserializer=response_cls.FromString)
        deltas = list(generate(request_cls(model=TINY, prompt_token_ids=[3, 4, 5], max_tokens=5,
                                           temperature=0, ignore_eos=True)))
    assert sum(len(d.token_ids) for d in deltas) == 5 and deltas[-1].finish_reason == "length"


# ---------------------------------------------------------------- `jaxserve serve --grpc-port`


def _startup_lines(proc: subprocess.Popen, deadline_s: float) -> list[str]:
    """What `serve` prints on stdout up to its `serving` line. Read on a thread: select() on the
    pipe would wait for lines already taken into the reader's buffer with the previous one."""
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen, end = [], time.monotonic() + deadline_s
    while not (seen and seen[-1].startswith("jaxserve: serving ")):
        try:
            line = lines.get(timeout=max(end - time.monotonic(), 0))
        except queue.Empty:
            raise AssertionError(f"no 'serving' line before the deadline: {seen}") from None
        assert line is not None, f"the server closed stdout (exit {proc.wait()})"
        seen.append(line)
    return seen


def test_serve_grpc_port_shares_the_engine_with_http(tiny, tiny_path, tmp_path):
    # The same pool and context as the in-process engine, but one 8-token sequence per step:
    # fewer programs to compile, and a one-token prompt decoding alone runs the same 1-token
    # programs in both, so the greedy tokens must agree.
    serve_args = {**TINY_ENGINE_ARGS, "max_num_seqs": 1, "max_num_batched_tokens": 8}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in serve_args.items()]
    stderr = (tmp_path / "stderr.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--model", str(tiny_path),
         "--served-model-name", TINY, "--port", "0", "--grpc-port", "0", "--no-rag", *flags],
        cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        lines = _startup_lines(proc, deadline_s=300)
        target = next(line.split(" on ", 1)[1].strip() for line in lines
                      if line.startswith("jaxserve: gRPC on "))
        url = lines[-1].split(" at ", 1)[1].strip()
        assert target.startswith("127.0.0.1:") and url.startswith("http://127.0.0.1:")
        greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
        expected = engine_output(tiny.engine, [42], SamplingParams(**greedy))
        with Client(target) as client:
            health = health_pb2_grpc.HealthStub(client.channel)
            assert health.Check(health_pb2.HealthCheckRequest()).status == \
                health_pb2.HealthCheckResponse.SERVING
            joined = client.complete(TINY, [42], **greedy)
        assert list(joined.token_ids) == expected.outputs[0].token_ids
        # HTTP answers from the same process and engine, with the same tokens.
        body = json.dumps({"model": TINY, "prompt": [42], **greedy}).encode()
        req = urllib.request.Request(f"{url}/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.loads(resp.read())["choices"][0]["text"] == joined.text
        # The README's example client runs against it as shown.
        example = subprocess.run(
            [sys.executable, "tools/grpc_client.py", "--target", target, "--model", TINY,
             "--prompt", "The capital of France is", "--max-tokens", "4"],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert example.returncode == 0, example.stderr[-3000:]
        assert re.search(r"\[(stop|length): 5 prompt \+ [1-4] completion tokens\]",
                         example.stderr), example.stderr[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()
    log = (tmp_path / "stderr.log").read_text()
    assert "Traceback" not in log, log[-3000:]


# ---------------------------------------------------------------- real SmolLM2 vs HF golden


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    llm_engine = build_engine(SMOLLM2, num_pages=96, max_num_seqs=16,
                              max_num_batched_tokens=64, max_model_len=256,
                              min_token_bucket=16, strict_compile=True, progress=False)
    yield from served(llm_engine, SMOLLM2)


def prompt_cases(golden) -> list[dict]:
    cases = [c for c in golden["cases"] if "prompt" in c["case"]]
    assert cases
    return cases


@pytest.mark.slow
def test_golden_greedy_generate(smollm2, smollm2_golden):
    case = prompt_cases(smollm2_golden)[0]
    with Client(smollm2.target) as client:
        deltas = list(client.generate(SMOLLM2, case["case"]["prompt"], max_tokens=32,
                                      temperature=0))
    assert [t for d in deltas for t in d.token_ids] == case["greedy_ids"]
    assert "".join(d.text for d in deltas) == case["greedy_text"]
    assert deltas[-1].usage.prompt_tokens == len(case["input_ids"])


@pytest.mark.slow
def test_16_concurrent_streams_equal_golden(smollm2, smollm2_golden):
    cases = prompt_cases(smollm2_golden)
    tok = smollm2.engine.tokenizer

    async def main():
        async with AsyncClient(smollm2.target) as client:
            # Half the prompts as text, half as token ids.
            prompts = [cases[i % len(cases)]["case"]["prompt"] if i % 2 else
                       cases[i % len(cases)]["input_ids"] for i in range(16)]
            return await asyncio.gather(*(client.complete(SMOLLM2, p, max_tokens=16,
                                                          temperature=0) for p in prompts))

    for i, joined in enumerate(asyncio.run(main())):
        ids = cases[i % len(cases)]["greedy_ids"][:16]
        assert list(joined.token_ids) == ids and joined.text == tok.decode(ids)
        assert joined.finish_reason == "length" and joined.usage.completion_tokens == 16
    wait_idle(smollm2.engine)


def test_num_speculative_tokens_zero_is_sent_not_dropped():
    # proto3 `optional`: 0 (opt out of speculation) is present, unlike an unset field.
    body = completion_body(pb.GenerateRequest(model=TINY, prompt="hi", num_speculative_tokens=0))
    assert body["num_speculative_tokens"] == 0
    assert "num_speculative_tokens" not in completion_body(pb.GenerateRequest(model=TINY,
                                                                              prompt="hi"))


def test_typed_errors_map_to_grpc_and_http_statuses():
    """One table (jaxserve.errors) for both front ends: a full queue is RESOURCE_EXHAUSTED / 503,
    a dead engine UNAVAILABLE / 503, a bad request INVALID_ARGUMENT / 400, ..."""
    from jaxserve.errors import (DeadlineExceeded, EngineDead, EngineOverloaded, InvalidRequest,
                                 ModelNotFound, QueueTimeout, RequestFailed, Unauthenticated)
    from jaxserve.entrypoints.grpc import status_for
    from jaxserve.entrypoints.http.front_door import logged_error_reply

    cases = [(EngineOverloaded("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
             (EngineDead("gone"), grpc.StatusCode.UNAVAILABLE, 503),
             (InvalidRequest("bad", "top_p"), grpc.StatusCode.INVALID_ARGUMENT, 400),
             (ModelNotFound("nope"), grpc.StatusCode.NOT_FOUND, 404),
             (QueueTimeout("waited too long"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
             (DeadlineExceeded("late"), grpc.StatusCode.DEADLINE_EXCEEDED, 504),
             (Unauthenticated("who?"), grpc.StatusCode.UNAUTHENTICATED, 401),
             (RequestFailed("one request"), grpc.StatusCode.INTERNAL, 500)]
    for error, code, http_status in cases:
        assert status_for(error) == code
        assert logged_error_reply(error)[0] == http_status
