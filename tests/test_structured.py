"""Structured outputs: the constraint's validation, compile errors naming the field, the bitmask
path against llguidance's own matcher (hypothesis), and grammar-constrained generation through
the engine with n > 1, seeds, logprobs, stop strings, preemption, prefix caching and no compiles
after warmup (a tiny random model, then SmolLM2)."""

from __future__ import annotations

import json
import re
import time

import jax
import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.errors import InvalidRequest
from jaxserve.entrypoints.llm import LLM
from jaxserve.executor.sampler import apply_token_bitmask, bitmask_width
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.structured import StructuredOutputsParams as SO
from jaxserve.tokenizer import Tokenizer
from tests.test_cli import tiny_gguf
from tests.test_engine import assert_no_leaks, count_compiles

VOCAB = 49152

# Every value bounded, so even a random model finishes: nested object, array of enums, required.
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "status": {"enum": ["new", "paid", "sent"]},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6},
            "vip": {"type": "boolean"}}, "required": ["name", "vip"],
            "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["gift", "fragile"]}, "maxItems": 2},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]},
    },
    "required": ["id", "status", "customer", "tags"],
    "additionalProperties": False,
}


# ---------------------------------------------------------------- the constraint itself


@pytest.mark.parametrize("kwargs,match", [
    ({}, "exactly one"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1]}, "must be an object"),
    ({"regex": ""}, "non-empty"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 1]}, "non-empty list"),
    ({"choice": ["x"] * 300}, "at most 256"),
    ({"grammar": "x" * 70_000}, "at most 65536"),
    ({"json_object": "yes"}, "boolean"),
])
def test_bad_constraint_names_its_field(kwargs, match):
    with pytest.raises(InvalidRequest, match=match) as err:
        SO(**kwargs, param="response_format")
    assert err.value.param == "response_format"


def test_constraint_is_keyed_by_what_it_constrains():
    a = SO(json={"type": "object", "properties": {"a": {}}}, param="guided_json")
    b = SO(json='{"type": "object",  "properties": {"a": {}}}')  # same schema, other spelling
    assert a == b and hash(a) == hash(b) and a.kind == "json"
    assert a != SO(json={"properties": {"a": {}}, "type": "object"})  # key order is output order
    assert SO(choice=["x", "y"]).choice == ("x", "y")
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(structured_outputs={"json": {}})
    assert err.value.param == "structured_outputs"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    from jaxserve.structured.grammar import GrammarCompiler

    return GrammarCompiler(tokenizer, vocab_size=VOCAB, eos_token_ids=tokenizer.eos_token_ids)


@pytest.mark.parametrize("constraint,match", [
    (SO(regex="((", param="guided_regex"), "regex cannot be enforced.*unclosed group"),
    (SO(json={"type": "foo"}, param="response_format"), "JSON schema cannot be enforced"),
    (SO(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (SO(grammar="start: foo", param="guided_grammar"), "grammar cannot be enforced"),
    (SO(grammar="root ::= [", param="guided_grammar"), "grammar cannot be enforced"),
])
def test_what_llguidance_cannot_enforce_is_an_invalid_request(grammars, constraint, match):
    with pytest.raises(InvalidRequest, match=match) as err:
        grammars.compile(constraint)
    assert err.value.param == constraint.param and "\n" not in str(err.value)


def test_compiled_grammars_are_cached(grammars):
    before = grammars.cache_info()
    first = grammars.compile(SO(json=ORDER))
    assert grammars.compile(SO(json=json.dumps(ORDER), param="other")) is first
    assert grammars.cache_info().hits == before.hits + 1
    grammars.compile(SO(choice=["a", "b"], param="guided_choice"))  # GBNF and Lark both accepted
    grammars.compile(SO(grammar='root ::= "a" [0-9]+'))
    grammars.compile(SO(grammar='start: "a" /[0-9]+/'))


# ---------------------------------------------------------------- the bitmask path


def test_apply_token_bitmask_matches_unpacked_bits():
    rng = np.random.default_rng(0)
    V = 100  # not a multiple of 32: the last word's high bits are past the vocabulary
    bitmask = rng.integers(-2**31, 2**31, size=(3, bitmask_width(V)), dtype=np.int64)
    bitmask = bitmask.astype(np.int32)
    bitmask[2] = -1  # an unconstrained row
    logits = rng.normal(size=(3, V)).astype(np.float32)
    out = np.asarray(jax.jit(apply_token_bitmask)(logits, bitmask))
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :V] == 1
    np.testing.assert_array_equal(out, np.where(allowed, logits, -np.inf))


def _leaf():
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 200)),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.lists(st.sampled_from(["red", "green", "blue", "a b", "é"]), min_size=1, max_size=3,
                 unique=True).map(lambda e: {"enum": e}),
    )


def _object(children):
    def build(props, required):
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [k for k, r in zip(sorted(props), required) if r]}

    return st.builds(build, st.dictionaries(st.sampled_from(["a", "b", "id", "name", "x_y"]),
                                            children, min_size=1, max_size=3),
                     st.lists(st.booleans(), min_size=3, max_size=3))


def _array(children):
    return st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                     children, st.integers(0, 3))


SCHEMAS = st.recursive(_leaf(), lambda c: st.one_of(_object(c), _array(c)), max_leaves=6) \
    .filter(lambda s: s.get("type") in ("object", "array"))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_bitmask_path_matches_llguidance_on_random_schemas(grammars, tokenizer, schema, seed):
    """Random schema, random logits: at every step the tokens our path leaves finite (engine's
    bitmask fill -> device apply_token_bitmask) are exactly those llguidance's own matcher
    allows; the argmax among them is accepted by that matcher; a finished output validates."""
    import llguidance

    from jaxserve.structured.grammar import grammar_text

    constraint = SO(json=schema)
    ours = grammars.compile(constraint).matcher(constraint.param)
    reference = llguidance.LLMatcher(grammars._tokenizer(), grammar_text(constraint),
                                     log_level=0)
    apply = jax.jit(apply_token_bitmask)
    rng = np.random.default_rng(seed)
    tokens = []
    for _ in range(64):
        bitmask = np.full((2, bitmask_width(VOCAB)), -1, np.int32)  # row 1: unconstrained
        grammars.fill_bitmask([(ours, 0)], bitmask)
        logits = rng.normal(size=(2, VOCAB)).astype(np.float32)
        masked = np.asarray(apply(logits, bitmask))
        expected = np.unpackbits(np.frombuffer(reference.compute_bitmask(), np.uint8),
                                 bitorder="little")[:VOCAB] == 1
        np.testing.assert_array_equal(np.isfinite(masked[0]), expected)
        np.testing.assert_array_equal(masked[1], logits[1])
        token = int(np.argmax(masked[0]))
        assert reference.consume_token(token)
        ours.accept(token)
        tokens.append(token)
        if ours.is_finished:
            break
    assert ours.is_finished == reference.is_stopped()
    if ours.is_finished:
        text = tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])
        jsonschema.validate(json.loads(text), schema)


def test_a_grammar_slower_than_the_mask_budget_ends_its_row(tokenizer):
    """Review M11: an ambiguous grammar whose mask grows slower every token (its Earley sets
    grow; llguidance's fuel limits do not stop it: 250 ms a step after 200 tokens) would slow
    every tenant's steps. Once a step's masks pass the budget, the rows over it are ended:
    their next token is refused with a 400 naming the field; the row beside it goes on."""
    from jaxserve.structured.grammar import GrammarCompiler, GrammarViolation

    budget = 0.01
    grammars = GrammarCompiler(tokenizer, vocab_size=VOCAB, eos_token_ids=tokenizer.eos_token_ids,
                               mask_budget_s=budget)
    slow = grammars.compile(SO(grammar='start: x\nx: " a" | x x | x x x',
                               param="guided_grammar")).matcher("guided_grammar")
    fast = grammars.compile(SO(regex="( a)+", param="guided_regex")).matcher("guided_regex")
    a = tokenizer.encode(" a")[-1]
    bitmask = np.full((2, bitmask_width(VOCAB)), -1, np.int32)
    accepted = 0
    with pytest.raises(GrammarViolation, match="budget") as err:
        for _ in range(400):
            grammars.fill_bitmask([(slow, 0), (fast, 1)], bitmask)
            fast.accept(a)
            slow.accept(a)
            accepted += 1
    assert err.value.param == "guided_grammar"
    # Ended at about 10 ms a step, long before llguidance's own row limit (~400 tokens, 250 ms).
    assert accepted < 250
    fast.accept(a)  # its neighbour is unaffected


# ---------------------------------------------------------------- through the engine (tiny model)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_tokenizer_fields):
    return tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", smollm2_tokenizer_fields)


@pytest.fixture(scope="module")
def tiny_llm(tiny_path):
    # 23 usable pages of 16 tokens: room for the largest request (n=3 x 7 pages), while 8
    # sequences at once already preempt.
    return LLM(str(tiny_path), num_pages=24, max_num_seqs=8, max_num_batched_tokens=32,
               max_model_len=128, page_size=16, strict_compile=True, progress=False)


def _check(comp, constraint: SO):
    assert comp.finish_reason == "stop", comp
    if constraint.kind == "json":
        jsonschema.validate(json.loads(comp.text), constraint.schema())
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.regex, comp.text), comp.text
    elif constraint.kind == "choice":
        assert comp.text in constraint.choice


def test_constrained_outputs_match_with_n_seeds_logprobs_and_no_compiles(tiny_llm):
    """A random model still writes only valid outputs; unconstrained requests in the same steps
    are untouched; sampling stays seeded; logprobs are of the masked distribution."""
    order, regex = SO(json=ORDER), SO(regex=r"[a-z]{2,4}-\d{2}")
    choice = SO(choice=["red", "green", "blue"])
    requests = [
        ("Order:", SamplingParams(temperature=0, max_tokens=100, structured_outputs=order)),
        ("Order:", SamplingParams(n=3, seed=7, max_tokens=100, structured_outputs=order)),
        ("Code:", SamplingParams(seed=1, max_tokens=20, logprobs=3, structured_outputs=regex)),
        ("Color:", SamplingParams(n=2, seed=2, max_tokens=10, structured_outputs=choice)),
        ("Free:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    ]
    engine = tiny_llm.engine
    with count_compiles() as compiles:
        outs = tiny_llm.generate([p for p, _ in requests], [sp for _, sp in requests])
        again = tiny_llm.generate("Order:", requests[1][1])
    assert compiles() == 0 and engine.runner.num_serving_compiles == 0
    for out, (_, params) in zip(outs[:4], requests):
        for comp in out.outputs:
            _check(comp, params.structured_outputs)
    assert [c.text for c in again[0].outputs] == [c.text for c in outs[1].outputs]
    free = outs[4].outputs[0]
    assert (len(free.token_ids), free.finish_reason) == (12, "length")
    assert free.token_ids == tiny_llm.generate("Free:", requests[4][1])[0].outputs[0].token_ids
    code = outs[2].outputs[0]
    for token, lp in zip(code.token_ids, code.logprobs):
        assert np.isfinite(lp.logprob) and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.logprob - 1e-5
    # the masked distribution: its first token is a letter, and all its mass is on letters
    first = code.logprobs[0]
    letters = [t for t, v in first.top if np.isfinite(v)]
    assert all(re.fullmatch(r"[a-z]+", engine.tokenizer.decode([t])) for t in letters)
    assert_no_leaks(engine)


def test_stop_strings_and_json_object(tiny_llm):
    outs = tiny_llm.generate(["A:", "B:"], [
        SamplingParams(temperature=0, max_tokens=100, stop=['"status"'],
                       structured_outputs=SO(json=ORDER)),
        SamplingParams(seed=3, max_tokens=60, structured_outputs=SO(json_object=True))])
    stopped = outs[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"status"'
    assert stopped.text.startswith('{"id": ') and '"status"' not in stopped.text
    obj = outs[1].outputs[0]
    if obj.finish_reason == "stop":  # a random model may write a string until max_tokens
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")


def test_preemption_prefix_caching_and_abort_keep_the_constraint(tiny_llm):
    """Greedy constrained outputs are the same when the page pool is so small that sequences are
    preempted and recomputed mid-output (the matcher keeps its place: no generated token is ever
    dropped), and when the prompt comes from the prefix cache; an aborted constrained request
    frees its pages."""
    engine = tiny_llm.engine
    prompt = {"prompt_token_ids": list(range(100, 140))}
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=SO(json=ORDER))
    reference = tiny_llm.generate(prompt, params)[0].outputs[0]
    _check(reference, params.structured_outputs)
    cached = tiny_llm.generate(prompt, params)[0]
    assert cached.num_cached_tokens > 0 and cached.outputs[0].token_ids == reference.token_ids
    preemptions = engine.stats().num_preemptions
    outs = tiny_llm.generate([prompt] * 8, params)  # 2 shared pages + 8 x 3 or more > 23
    assert engine.stats().num_preemptions > preemptions
    assert all(o.outputs[0].token_ids == reference.token_ids for o in outs)
    engine.add_request("gone", prompt, params)
    for _ in range(5):
        engine.step()
    assert engine.abort("gone")
    engine.step()
    assert_no_leaks(engine)


def test_streaming_and_leaving_a_stream_early(tiny_llm):
    """Through AsyncEngine: a constrained request streams growing text to a valid end; a stream
    left early aborts its constrained request, and every page comes back."""
    import asyncio

    from jaxserve.core.async_engine import AsyncEngine

    async_engine = AsyncEngine(tiny_llm.engine)
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=SO(json=ORDER))

    async def main():
        texts = [out.outputs[0].text async for out in async_engine.generate("Stream:", params)]
        async for out in async_engine.generate("Left:", params.replace(n=2), "left"):
            if len(out.outputs[0].token_ids) >= 3:
                break
        return texts

    try:
        texts = asyncio.run(main())
        for _ in range(200):  # the abort lands on the engine thread
            if tiny_llm.engine.stats().num_running == 0:
                break
            time.sleep(0.02)
    finally:
        async_engine.shutdown()
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and len(texts) > 2
    jsonschema.validate(json.loads(texts[-1]), ORDER)
    assert_no_leaks(tiny_llm.engine)


def test_a_bad_constraint_fails_in_prepare(tiny_llm):
    with pytest.raises(InvalidRequest) as err:
        tiny_llm.engine.prepare("x", "hi", SamplingParams(
            structured_outputs=SO(regex="[", param="guided_regex")))
    assert err.value.param == "guided_regex"
    assert not tiny_llm.engine.has_unfinished()



def test_a_constraint_the_tokenizer_cannot_spell_fails_that_request_as_a_400(tiny_llm):
    """U+B149C's UTF-8 starts with byte 0xF2, which no SmolLM2 token spells: the regex compiles,
    llguidance's mask then allows a token its matcher refuses. That request alone ends with a
    typed 400 naming its field (the fuzzer found it as a 500); the request beside it finishes."""
    from jaxserve.structured.grammar import GrammarViolation

    outs = tiny_llm.generate(["a", "b"], [
        SamplingParams(max_tokens=4, structured_outputs=SO(regex="\U000B149C",
                                                           param="guided_regex")),
        SamplingParams(max_tokens=4, ignore_eos=True)])
    assert isinstance(outs[0].error, GrammarViolation) and isinstance(outs[0].error,
                                                                      InvalidRequest)
    assert outs[0].error.param == "guided_regex" and "token" in str(outs[0].error)
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
    assert_no_leaks(tiny_llm.engine)

# ---------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_path):
    # Steps of at least 16 tokens: the constraints on small steps are tiny_llm's subject above;
    # each bucket below 16 is one more forward, and one more row count of samplers, to compile.
    return LLM("smollm2-135m-instruct", num_pages=256, max_num_seqs=8,
               max_num_batched_tokens=64, max_model_len=1024, min_token_bucket=16,
               strict_compile=True, progress=False)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "object", "properties": {
            "name": {"type": "string"}, "country": {"enum": ["France", "Germany", "Italy"]}},
            "required": ["name", "country"], "additionalProperties": False},
        "languages": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                      "maxItems": 3},
    },
    "required": ["name", "age", "city", "languages"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_smollm2_structured_outputs(smollm2_llm):
    llm = smollm2_llm
    tok = llm.get_tokenizer()

    def chat(text):
        return {"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": text}])}

    person, date = SO(json=PERSON), SO(regex=r"\d{4}-\d{2}-\d{2}")
    mood = SO(choice=["positive", "negative", "neutral"])
    with count_compiles() as compiles:
        outs = llm.generate([
            chat("Describe a person from Paris as JSON."),
            chat("Describe a person from Paris as JSON."),
            chat("When did World War II end? Answer with a date."),
            chat("Is 'I love this film' positive, negative or neutral?"),
        ], [SamplingParams(temperature=0, max_tokens=200, structured_outputs=person),
            SamplingParams(n=2, seed=0, temperature=0.7, max_tokens=200,
                           structured_outputs=person),
            SamplingParams(temperature=0, max_tokens=20, structured_outputs=date),
            SamplingParams(temperature=0, max_tokens=10, structured_outputs=mood)])
    assert compiles() == 0
    for out, constraint in zip(outs, (person, person, date, mood)):
        for comp in out.outputs:
            _check(comp, constraint)
    assert outs[3].outputs[0].text == "positive"
    assert_no_leaks(llm.engine)


@pytest.mark.slow
def test_smollm2_forced_tool_calls_are_valid_calls(smollm2_llm):
    """tool_choice required / named on a 135M model through the Hermes fallback prompt: the
    output is a call the hermes parser reads, to an allowed function, with valid arguments."""
    from jaxserve.tool_calling.choice import forced_tool_call
    from jaxserve.tool_calling.functions import parse_tool_choice, parse_tools
    from jaxserve.tool_calling.parsers import get_tool_parser

    tools = parse_tools([
        {"type": "function", "function": {
            "name": "get_weather", "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False}}},
        {"type": "function", "function": {
            "name": "add", "description": "Add two integers",
            "parameters": {"type": "object", "properties": {
                "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}])
    parser = get_tool_parser("hermes")
    tok = smollm2_llm.get_tokenizer()
    prompt = {"prompt_token_ids": tok.apply_chat_template(
        [{"role": "user", "content": "What is the weather in Paris?"}], tools=tools)}
    choices = [parse_tool_choice("required", tools),
               parse_tool_choice({"type": "function", "function": {"name": "add"}}, tools)]
    outs = smollm2_llm.generate([prompt] * 2, [
        SamplingParams(temperature=0, max_tokens=120,
                       structured_outputs=forced_tool_call(tools, c, parser))
        for c in choices])
    by_name = {t.name: t for t in tools}
    for out, choice in zip(outs, choices):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", comp.text
        calls = parser.parse(comp.text).tool_calls
        assert calls and all(c.name in by_name for c in calls), comp.text
        if choice.mode == "named":
            assert [c.name for c in calls] == ["add"]
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), by_name[c.name].parameters_schema())
    assert parser.parse(outs[0].outputs[0].text).tool_calls[0].name == "get_weather"
