"""What a request's output must match: StructuredOutputsParams, in vLLM's name and shape.

Exactly one of `json` (a JSON schema), `regex`, `choice`, `grammar` or `json_object` is set. The
value is checked here for shape and size only (this module imports neither JAX nor the grammar
library, so a request is parsed without them); whether the library can compile it is checked
when the engine prepares the request (`jaxserve.structured.grammar`), so a bad schema is still a
400 before any token is generated. Errors name `param`: the request field the constraint came
from (`response_format`, `structured_outputs`, `guided_json`, `tools`, ...).

A constraint is hashable and compares by what it constrains (its kind and canonical text), not by
`param`: it is the key of the compiled-grammar cache.
"""

from __future__ import annotations

import dataclasses
import json as _json
from dataclasses import dataclass, field
from typing import Any

from jaxserve.errors import InvalidRequest

# Bounds on what one request may ask the grammar compiler to chew on.
MAX_SPEC_CHARS = 65_536
MAX_CHOICES = 256

KINDS = ("json", "regex", "choice", "grammar", "json_object")
REASONING_KINDS = ("json", "json_object")  # kinds that may follow a reasoning block


@dataclass(frozen=True)
class StructuredOutputsParams:
    """json: a JSON schema (a dict, or its JSON text), kept as its compact JSON text in the
    schema's own key order (the order properties are generated in). regex: Rust `regex` syntax.
    choice: the output is exactly one of these strings. grammar: a Lark grammar in llguidance's
    dialect, or a GBNF (llama.cpp) grammar. json_object: any JSON object."""

    json: Any = None
    regex: str | None = None
    choice: Any = None
    grammar: str | None = None
    json_object: bool = False
    param: str = field(default="structured_outputs", compare=False)
    # A thinking model's reasoning block first: Lark rules whose `start` reads the block, then
    # `body`, the constraint itself (a reasoning parser's `grammar`; `after_reasoning`).
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise self._bad(f"json_object must be a boolean, got {self.json_object!r:.40}")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise self._bad(f"needs exactly one of {', '.join(KINDS)}; got "
                            f"{', '.join(given) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", self._schema(self.json))
        if self.regex is not None:
            self._text("regex", self.regex)
        if self.choice is not None:
            object.__setattr__(self, "choice", self._choices(self.choice))
        if self.grammar is not None:
            self._text("grammar", self.grammar)

    def after_reasoning(self, block: str) -> StructuredOutputsParams:
        """This constraint after a reasoning block, `block` the Lark rules reading it (json and
        json_object; any other kind is returned as it is, constraining from the first token)."""
        if self.kind not in REASONING_KINDS:
            return self
        return dataclasses.replace(self, reasoning=block)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def _bad(self, message: str) -> InvalidRequest:
        return InvalidRequest(f"'{self.param}': {message}", param=self.param)

    def _text(self, kind: str, value: Any) -> None:
        if not isinstance(value, str) or not value:
            raise self._bad(f"{kind} must be a non-empty string, got {value!r:.60}")
        if len(value) > MAX_SPEC_CHARS:
            raise self._bad(f"{kind} is {len(value)} characters; at most {MAX_SPEC_CHARS}")

    def _schema(self, schema: Any) -> str:
        if isinstance(schema, str):
            try:
                schema = _json.loads(schema)
            except RecursionError:
                raise self._bad("the JSON schema nests too deeply") from None
            except ValueError as e:
                raise self._bad(f"the JSON schema is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise self._bad(f"the JSON schema must be an object, got {type(schema).__name__}")
        try:
            text = _json.dumps(schema, separators=(",", ":"), ensure_ascii=False,
                               allow_nan=False)
        except (TypeError, ValueError) as e:
            raise self._bad(f"the JSON schema is not JSON-serialisable ({e})") from None
        self._text("json schema", text)
        return text

    def _choices(self, choices: Any) -> tuple[str, ...]:
        if (not isinstance(choices, (list, tuple)) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise self._bad(f"choice must be a non-empty list of non-empty strings, got "
                            f"{choices!r:.60}")
        if len(choices) > MAX_CHOICES:
            raise self._bad(f"choice takes at most {MAX_CHOICES} strings, got {len(choices)}")
        self._text("choice", "".join(choices))
        return tuple(choices)

    def schema(self) -> dict | None:
        """The JSON schema as a dict (json only)."""
        return None if self.json is None else _json.loads(self.json)
