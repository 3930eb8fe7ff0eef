"""Grammar-constrained decoding with llguidance: compile a constraint for the model's tokenizer,
keep each sequence's matcher, and fill the token bitmask of a step's constrained rows.

llguidance was chosen over xgrammar by measurement (benchmarks/grammar_backends.py, numbers in
benchmarks/RESULTS.md): it compiles a schema in about a millisecond instead of tens to thousands,
refuses the JSON-schema keywords it cannot enforce instead of ignoring them, takes our
`tokenizers` JSON as it is, and needs no torch. Its per-token mask costs tens of microseconds per
row on one core, computed on the host while the device runs the forward.

Host side only: no JAX. A compiled grammar is an llguidance matcher in its initial state; every
sequence gets a copy of it (a copy costs about a microsecond). Compiled grammars are cached by the
constraint (kind and canonical text) in a bounded LRU, so agents that send the same schema on
every request compile it once.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from typing import Sequence

import numpy as np

from jaxserve.errors import InvalidRequest
from jaxserve.structured.params import StructuredOutputsParams

# JSON is generated the way json.dumps writes it by default (", " and ": ", no other
# whitespace): free whitespace lets a small model pad forever, and this layout is what models
# read most. Anything a schema can express is still reachable.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT = '{"type":"object"}'
# llguidance's resource limits, tighter than its defaults (review a70e490, M11): the lexer work
# of one row's mask about 3.5 ms instead of 14, Earley items per mask 20k instead of 50k, and
# lexer states 20k instead of 250k (1-2 kB each: up to 40 MB a grammar, not 0.5 GB, with 128
# grammars cached). A grammar that passes one ends its request with a 400.
PARSER_LIMITS = {"step_lexer_fuel": 50_000, "step_max_items": 20_000, "max_lexer_states": 20_000}
# Some grammars stay within those limits and still slow down with every token (an ambiguous
# grammar's Earley sets grow). When a step's masks take longer than this, the next step times
# each row's mask alone, and a row over it is ended: its next token is refused (a 400 naming
# the field).
MASK_BUDGET_S = 0.05


def lark_json(schema: dict) -> str:
    """`%json {...}`: a JSON schema inside a Lark grammar, laid out as every JSON output is."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


class GrammarViolation(InvalidRequest):
    """A sampled token the matcher refused, so the constraint cannot be followed on: it was
    allowed by the matcher's own mask, so the constraint itself is at fault, e.g. a character
    whose UTF-8 bytes no token of this vocabulary spells (llguidance then masks wrongly), or a
    grammar that hit one of llguidance's resource limits mid-generation. The request's 400."""


def grammar_text(constraint: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint (not yet checked: compiling does that)."""
    import llguidance  # here, not at the top: the engine's import path stays light (issue 41)

    kind = constraint.kind
    if constraint.reasoning is not None:
        return _after_reasoning(constraint)
    try:
        if kind in ("json", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(
                constraint.json if kind == "json" else _ANY_OBJECT, overrides=_JSON_OPTIONS)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(constraint.choice))
        # "grammar": Lark as llguidance reads it, or GBNF converted to it.
        return llguidance.grammar_from(kind, getattr(constraint, kind))
    except ValueError as e:
        raise _invalid(constraint, str(e)) from None


def _after_reasoning(constraint: StructuredOutputsParams) -> str:
    """Lark: the reasoning block's rules (the format's own), then the JSON as `body`."""
    schema = constraint.schema() if constraint.kind == "json" else {"type": "object"}
    return f"{constraint.reasoning}body: {lark_json(schema)}\n"


def _invalid(constraint: StructuredOutputsParams, error: str) -> InvalidRequest:
    # llguidance's messages span lines (a caret under the culprit): one line for a 400.
    message = re.sub(r"\s+", " ", error).strip()[:400]
    what = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
            "choice": "choice", "grammar": "grammar"}[constraint.kind]
    return InvalidRequest(f"'{constraint.param}': the {what} cannot be enforced: {message}",
                          param=constraint.param)


class GrammarMatcher:
    """One sequence's position in its grammar: advanced with each token it samples. Sequences
    are never rolled back in this engine (preemption recomputes the KV cache but keeps the
    generated tokens), so neither is a matcher; it is dropped when its sequence ends. Draft
    tokens (speculative decoding) advance copies only (`speculate`)."""

    def __init__(self, matcher: llguidance.LLMatcher, param: str):
        self._matcher = matcher
        self._param = param  # the request field the constraint came from, for the 400
        self._over_budget: str | None = None  # why its row is ended (GrammarCompiler's budget)

    def speculate(self, draft_token_ids: Sequence[int]) -> list[GrammarMatcher]:
        """The states a step verifying these drafts needs the masks of: this matcher, then a
        copy after each prefix of the drafts, as far as the grammar allows them. A row after a
        draft the grammar refuses needs no mask: its own row's mask already rejects that draft.
        This matcher itself does not move."""
        states = [self]
        allowed = self._matcher.validate_tokens(list(draft_token_ids)) if draft_token_ids else 0
        matcher = self._matcher
        for token in draft_token_ids[:allowed]:
            matcher = matcher.deep_copy()
            if not matcher.consume_token(int(token)):
                break
            states.append(GrammarMatcher(matcher, self._param))
        return states

    def accept(self, token_id: int) -> None:
        if self._over_budget is not None:
            raise GrammarViolation(f"'{self._param}': {self._over_budget}", param=self._param)
        if not self._matcher.consume_token(int(token_id)):
            # llguidance's error spans lines (its state and grammar): the first says why.
            why = self._matcher.get_error().strip().split("\n", 1)[0][:300]
            raise GrammarViolation(
                f"'{self._param}': generation reached a point this model's tokenizer cannot "
                f"continue the constraint from (token {token_id} refused: {why})",
                param=self._param)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and admits nothing more (EOS included, once it was taken)."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """What was generated so far is a complete match (it may still go on)."""
        return self._matcher.is_accepting()


class CompiledGrammar:
    """A constraint compiled for one tokenizer; `matcher()` starts a sequence on it."""

    def __init__(self, template: llguidance.LLMatcher):
        self._template = template

    def matcher(self, param: str) -> GrammarMatcher:
        """param: the request field the constraint came from (compiled grammars are shared by
        every request with the same constraint, whatever field it came in)."""
        return GrammarMatcher(self._template.deep_copy(), param)


class GrammarCompiler:
    """Compiles constraints for one model (its tokenizer, vocabulary size and EOS ids), caches
    them, and fills token bitmasks. `compile` may run on any thread (the engine calls it where
    requests are prepared); the tokenizer index llguidance needs is built on first use (~1 s for
    a 49k vocabulary), so engines that never see a constraint never pay for it."""

    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 128, mask_budget_s: float = MASK_BUDGET_S):
        self._tokenizer_source = tokenizer  # a jaxserve Tokenizer: read on first use
        self.vocab_size = vocab_size
        self.mask_budget_s = mask_budget_s
        self._time_rows = False  # the last step's masks passed the budget
        self._eos = sorted(set(eos_token_ids))
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._cached = functools.lru_cache(maxsize=cache_size)(self._compile)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_source.to_json(), n_vocab=self.vocab_size,
                    eos_token=self._eos)
                self._executor = llguidance.LLExecutor()
            return self._ll_tokenizer

    def compile(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        """InvalidRequest naming constraint.param if llguidance cannot enforce it."""
        return self._cached(constraint)

    def cache_info(self):
        return self._cached.cache_info()

    def _compile(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance

        template = llguidance.LLMatcher(self._tokenizer(), grammar_text(constraint), log_level=0,
                                        limits=llguidance.LLParserLimits(**PARSER_LIMITS))
        if template.is_error():
            raise _invalid(constraint, template.get_error())
        return CompiledGrammar(template)

    def fill_bitmask(self, rows: Sequence[tuple[GrammarMatcher, int]],
                     bitmask: np.ndarray) -> None:
        """Write each matcher's allowed tokens into bitmask[row] (i32[R, ceil(V / 32)], C order);
        other rows are left as they are. Runs the rows in parallel on llguidance's threads. A
        step whose masks take longer than the mask budget makes the next one time each row
        alone (a mask, once computed, is cached: it cannot be timed again), and end the rows
        over the budget (MASK_BUDGET_S)."""
        if not rows:
            return
        import llguidance.numpy

        if self._time_rows:
            self._time_rows = False
            for matcher, row in rows:
                started = time.perf_counter()
                llguidance.numpy.fill_next_token_bitmask(matcher._matcher, bitmask, row)
                took = time.perf_counter() - started
                if took > self.mask_budget_s:
                    matcher._over_budget = (
                        f"the constraint took {took * 1000:.0f} ms to enforce for one token, "
                        f"over the server's budget of {self.mask_budget_s * 1000:.0f} ms; "
                        "simplify it")
            return
        started = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(m._matcher, row) for m, row in rows], bitmask)
        self._time_rows = time.perf_counter() - started > self.mask_budget_s
