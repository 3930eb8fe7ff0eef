"""xgrammar vs llguidance on what jaxserve needs from a grammar library (the measurement behind
choosing llguidance for `jaxserve/structured/`; see benchmarks/RESULTS.md).

    pip install xgrammar llguidance jsonschema   # xgrammar pulls torch, transformers and triton:
    python benchmarks/grammar_backends.py        # best in a throwaway venv

Both run on the same host, in the same process, with the same tokenizer: SmolLM2's byte-level
BPE built from its GGUF metadata by `jaxserve.tokenizer` (vocabulary 49152). Reported:
- how each library takes that tokenizer, and whether its bytes of every token agree with ours;
- grammar compile time for four realistic JSON schemas (and the first mask after it: llguidance
  builds its lexer lazily, so its compile is cheap and part of the work moves to the first mask);
- per-token mask time along a real token trace of a valid instance (one row, one thread);
- JSON-schema features agents send (pydantic models, $ref, anyOf/nullable, enum/const, formats,
  patterns, bounds, additionalProperties false): compiles, accepts valid instances token by
  token, rejects invalid ones;
- regex, choice, and an EBNF/GBNF grammar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from jaxserve.model_registry import resolve
from jaxserve.tokenizer import Tokenizer

VOCAB = 49152

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]}},
            "required": ["street", "city", "country"], "additionalProperties": False},
        "phones": {"type": "array", "items": {"type": "object", "properties": {
            "kind": {"enum": ["home", "work", "mobile"]}, "number": {"type": "string"}},
            "required": ["kind", "number"]}, "maxItems": 4},
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
PERSON_OK = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
             "address": {"street": "12 St James's Square", "city": "London", "country": "US"},
             "phones": [{"kind": "home", "number": "+44 20 7946 0000"}]}

# What pydantic writes for nested models: $defs/$ref, titles, Optional as anyOf with null.
ORDER = {
    "$defs": {
        "Item": {"properties": {
            "sku": {"pattern": "^[A-Z]{3}-[0-9]{4}$", "title": "Sku", "type": "string"},
            "quantity": {"minimum": 1, "title": "Quantity", "type": "integer"},
            "unit_price": {"title": "Unit Price", "type": "number"}},
            "required": ["sku", "quantity", "unit_price"], "title": "Item", "type": "object"},
        "Status": {"enum": ["pending", "paid", "shipped", "cancelled"], "title": "Status",
                   "type": "string"}},
    "properties": {
        "order_id": {"title": "Order Id", "type": "string"},
        "status": {"$ref": "#/$defs/Status"},
        "items": {"items": {"$ref": "#/$defs/Item"}, "minItems": 1, "title": "Items",
                  "type": "array"},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None,
                  "title": "Notes"},
        "created_at": {"format": "date-time", "title": "Created At", "type": "string"}},
    "required": ["order_id", "status", "items", "created_at"],
    "title": "Order", "type": "object",
}
ORDER_OK = {"order_id": "A-1001", "status": "paid",
            "items": [{"sku": "ABC-1234", "quantity": 2, "unit_price": 9.5},
                      {"sku": "XYZ-0001", "quantity": 1, "unit_price": 120.0}],
            "notes": None, "created_at": "2024-05-01T12:30:00Z"}

WEATHER_ARGS = {
    "type": "object",
    "properties": {"location": {"type": "string", "description": "City and country"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["location", "unit"], "additionalProperties": False,
}
WEATHER_OK = {"location": "Paris, France", "unit": "celsius", "days": 3}

ISSUE = {
    "type": "object",
    "properties": {
        **{f"field_{i}": {"type": "string", "maxLength": 40} for i in range(12)},
        "title": {"type": "string", "minLength": 1},
        "labels": {"type": "array", "items": {"type": "string",
                                              "enum": ["bug", "feature", "docs", "perf"]}},
        "assignees": {"type": "array", "items": {"type": "object", "properties": {
            "login": {"type": "string"}, "id": {"type": "integer"}},
            "required": ["login", "id"]}},
        "milestone": {"type": ["object", "null"], "properties": {
            "number": {"type": "integer"}, "due_on": {"type": "string", "format": "date"}}},
        "state": {"const": "open"},
        "score": {"type": "number", "exclusiveMinimum": 0},
    },
    "required": ["title", "labels", "state"],
}
# Both libraries emit properties in the schema's order, so instances are written in it too.
ISSUE_OK = {**{f"field_{i}": f"value {i}" for i in range(12)}, "title": "Crash on empty prompt",
            "labels": ["bug", "perf"], "assignees": [{"login": "octocat", "id": 1}],
            "milestone": None, "state": "open", "score": 0.75}

TIMED = [("person", PERSON, PERSON_OK), ("order (pydantic)", ORDER, ORDER_OK),
         ("tool args", WEATHER_ARGS, WEATHER_OK), ("issue (18 fields)", ISSUE, ISSUE_OK)]

# (feature, schema, valid instances, invalid instances)
FEATURES = [
    ("required", PERSON, [PERSON_OK], [{"name": "x", "age": 3}]),
    ("additionalProperties false", WEATHER_ARGS, [WEATHER_OK],
     [{**WEATHER_OK, "extra": 1}]),
    ("enum", WEATHER_ARGS, [{"location": "x", "unit": "fahrenheit"}],
     [{"location": "x", "unit": "kelvin"}]),
    ("integer bounds", WEATHER_ARGS, [{"location": "x", "unit": "celsius", "days": 14}],
     [{"location": "x", "unit": "celsius", "days": 15}]),
    ("$ref/$defs + pattern", ORDER, [ORDER_OK],
     [{**ORDER_OK, "items": [{"sku": "abc-1234", "quantity": 1, "unit_price": 1}]}]),
    ("minItems", ORDER, [ORDER_OK], [{**ORDER_OK, "items": []}]),
    ("anyOf nullable", ORDER, [{**ORDER_OK, "notes": "leave at door"}],
     [{**ORDER_OK, "notes": 5}]),
    ("format date-time", ORDER, [ORDER_OK], [{**ORDER_OK, "created_at": "yesterday"}]),
    ("const", ISSUE, [ISSUE_OK], [{**ISSUE_OK, "state": "closed"}]),
    ("type list [object, null]", ISSUE, [{**ISSUE_OK, "milestone": {"number": 3}}],
     [{**ISSUE_OK, "milestone": 3}]),
    ("maxLength", ISSUE, [ISSUE_OK], [{**ISSUE_OK, "field_0": "x" * 41}]),
    ("nested array of objects", PERSON,
     [{**PERSON_OK, "phones": [{"kind": "work", "number": "1"}, {"kind": "mobile",
                                                                  "number": "2"}]}],
     [{**PERSON_OK, "phones": [{"kind": "work"}]}]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     [[1, 2]], [[1, 1]]),
    ("oneOf", {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                          "required": ["a"], "additionalProperties": False},
                         {"type": "object", "properties": {"b": {"type": "string"}},
                          "required": ["b"], "additionalProperties": False}]},
     [{"a": 1}, {"b": "x"}], [{"a": "x"}]),
    ("recursive $ref", {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array",
                                                   "items": {"$ref": "#/$defs/node"}}},
        "required": ["value"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
     [{"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]}],
     [{"value": 1, "children": [{"children": []}]}]),
]

REGEX = (r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567", "555-123-4567")
CHOICE = (["positive", "negative", "neutral"], "neutral", "mixed")
GBNF = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
GBNF_CASE = ("(1+2)*34-5", "(1+2")


# ------------------------------------------------------------------ the two libraries


class Llguidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer):
        import llguidance
        import llguidance.numpy

        self.lib, self.np = llguidance, llguidance.numpy
        t = time.perf_counter()
        self.tok = llguidance.LLTokenizer(tok._backend.to_str(), n_vocab=VOCAB,
                                          eos_token=list(tok.eos_token_ids))
        self.setup_s = time.perf_counter() - t
        self.eos = tok.eos_token_ids[0]

    def token_bytes(self, i: int) -> bytes:
        return self.tok.decode_bytes([i])

    def compile(self, kind: str, spec):
        grammar = self.lib.grammar_from({"json": "json_schema", "ebnf": "grammar"}.get(kind, kind),
                                        json.dumps(spec) if kind in ("json", "choice") else spec)
        matcher = self.lib.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def new_mask(self):
        return self.np.allocate_token_bitmask(1, VOCAB)

    def fill(self, m, mask) -> None:
        self.np.fill_next_token_bitmask(m, mask)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def accepts_end(self, m) -> bool:
        return m.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer):
        import xgrammar

        self.xgr = xgrammar
        t = time.perf_counter()
        # The raw byte-level token strings, as xgrammar's own HF path would pass them.
        vocab = [tok._backend.id_to_token(i) or "" for i in range(tok.vocab_size)]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=VOCAB,
                                      stop_token_ids=list(tok.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - t
        self.info = info
        self.stop = info.stop_token_ids[0]
        self.decoded = info.decoded_vocab  # a property that rebuilds the list on every read

    def token_bytes(self, i: int) -> bytes:
        v = self.decoded[i]
        return v if isinstance(v, bytes) else v.encode()

    def compile(self, kind: str, spec):
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec))
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        return c.compile_grammar(spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def new_mask(self):
        return self.xgr.allocate_token_bitmask(1, VOCAB)

    def fill(self, m, mask) -> None:
        m.fill_next_token_bitmask(mask)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def accepts_end(self, m) -> bool:
        return m.accept_token(self.stop) and m.is_terminated()


# ------------------------------------------------------------------ measurements


def reference_token_bytes(tok: Tokenizer) -> list[bytes]:
    """Each token's bytes by GPT-2's byte-to-unicode table (the byte-level BPE's own mapping);
    added tokens are their text."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    unmap = {chr(c): b for b, c in zip(bs, cs)}
    added = {i: t.content for i, t in tok._backend.get_added_tokens_decoder().items()}
    out = []
    for i in range(tok.vocab_size):
        s = tok._backend.id_to_token(i)
        out.append(added[i].encode() if i in added else bytes(unmap[ch] for ch in s))
    return out


def run_trace(lib, compiled, tokens: list[int]) -> tuple[bool, list[float]]:
    """Mask then accept each token; (all accepted and the end accepted, mask times in us)."""
    m, mask, times = lib.matcher(compiled), lib.new_mask(), []
    for t in tokens:
        t0 = time.perf_counter_ns()
        lib.fill(m, mask)
        times.append((time.perf_counter_ns() - t0) / 1e3)
        allowed = bool((int(np.asarray(mask)[0, t // 32]) >> (t % 32)) & 1)
        if not allowed or not lib.accept(m, t):
            return False, times
    return lib.accepts_end(m), times


def accepts(lib, compiled, text: str, tok: Tokenizer) -> bool:
    return run_trace(lib, compiled, tok.encode(text, add_special_tokens=False))[0]


def _stats(times: list[float]) -> str:
    times = sorted(times)
    return (f"{statistics.mean(times):6.1f} / {times[len(times) // 2]:5.1f} / "
            f"{times[int(len(times) * 0.99)]:6.1f} / {times[-1]:6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tok = Tokenizer.from_gguf(Path(resolve(args.model).path))
    ref = reference_token_bytes(tok)
    libs = []
    for cls in (Llguidance, Xgrammar):
        t = time.perf_counter()
        libs.append(cls(tok))
        print(f"{cls.name}: import + tokenizer setup {time.perf_counter() - t:.2f} s "
              f"(tokenizer {libs[-1].setup_s:.2f} s)")
    for lib in libs:
        bad = [i for i in range(tok.vocab_size) if lib.token_bytes(i) != ref[i]]
        print(f"{lib.name}: token bytes differing from the BPE's: {len(bad)} of {tok.vocab_size}"
              + (f" (e.g. {bad[:5]})" if bad else ""))

    print("\ncompile (ms, best of repeats) | per-token mask (us): mean / p50 / p99 / max, "
          "first request after a compile | the same, a later request on the cached grammar")
    for name, schema, ok in TIMED:
        tokens = tok.encode(json.dumps(ok), add_special_tokens=False)
        for lib in libs:
            compile_s, cold, warm, valid = [], [], [], True
            for _ in range(args.repeats):
                t = time.perf_counter()
                compiled = lib.compile("json", schema)
                compile_s.append(time.perf_counter() - t)
                for times in (cold, warm):
                    good, ts = run_trace(lib, compiled, tokens)
                    valid &= good
                    times += ts
            print(f"  {name:18s} {lib.name:10s} {min(compile_s) * 1e3:6.1f} | {_stats(cold)} | "
                  f"{_stats(warm)}  ({len(tokens)} tokens)"
                  + ("" if valid else "  REJECTED the valid instance"))

    print("\nJSON-schema features (compiles / accepts valid / rejects invalid)")
    score = {lib.name: 0 for lib in libs}
    for feature, schema, valid, invalid in FEATURES:
        row = []
        for lib in libs:
            try:
                compiled = lib.compile("json", schema)
            except Exception as e:  # noqa: BLE001 - a library's refusal is the result
                row.append(f"{lib.name}: does not compile ({str(e).splitlines()[0][:60]})")
                continue
            acc = all(accepts(lib, compiled, json.dumps(v), tok) for v in valid)
            rej = not any(accepts(lib, compiled, json.dumps(v), tok) for v in invalid)
            score[lib.name] += acc and rej
            row.append(f"{lib.name}: {'ok' if acc else 'REJECTS VALID'}/"
                       f"{'ok' if rej else 'ACCEPTS INVALID'}")
        print(f"  {feature:28s} " + " | ".join(row))
    print("  fully right: " + ", ".join(f"{k} {v}/{len(FEATURES)}" for k, v in score.items()))

    print("\nregex / choice / GBNF grammar (valid accepted, invalid rejected)")
    for kind, spec, good, bad in (("regex", *REGEX), ("choice", *CHOICE),
                                  ("ebnf", GBNF, *GBNF_CASE)):
        for lib in libs:
            try:
                compiled = lib.compile(kind, spec)
                print(f"  {kind:6s} {lib.name:10s} {accepts(lib, compiled, good, tok)} / "
                      f"{not accepts(lib, compiled, bad, tok)}")
            except Exception as e:  # noqa: BLE001
                print(f"  {kind:6s} {lib.name:10s} does not compile: {str(e)[:80]}")


if __name__ == "__main__":
    main()
