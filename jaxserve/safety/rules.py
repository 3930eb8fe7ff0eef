"""A policy rule (compiled once, when the policy file loads) and the record of it acting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import regex

STAGES = ("input", "output", "both")
ACTIONS = ("block", "redact", "flag")
# When matches of several rules start at the same character, a block wins, then a redaction.
ACTION_ORDER = {"block": 0, "redact": 1, "flag": 2}


@dataclass(frozen=True, eq=False)
class Rule:
    """One `[[pack.NAME.rule]]`. Text rules carry a compiled `pattern`; classifier rules carry
    the classifier's name, the label and the score threshold instead."""

    name: str  # the `rule` label of the interventions counter, and in audit records
    stage: str  # "input" | "output" | "both"
    match: str  # "literal" | "regex" | "pii:KIND" | "classifier:NAME"
    action: str  # "block" | "redact" | "flag"
    kind: str = ""  # what `[REDACTED:<kind>]` says
    pattern: regex.Pattern | None = None
    check: Callable[[str], bool] | None = None  # a match failing it does not count (Luhn)
    # True when a match that ends where the text ends may stop being one once more text comes
    # (a lookahead such as a word boundary); only a literal without whole_word is exempt.
    needs_lookahead: bool = True
    classifier: str | None = None
    label: str | None = None
    threshold: float | None = None

    def applies_to(self, stage: str) -> bool:
        return self.stage in (stage, "both")

    @property
    def replacement(self) -> str:
        return f"[REDACTED:{self.kind}]"


@dataclass(frozen=True)
class Intervention:
    """A rule that acted on a request: `count` matches in one stage (one request's input or one
    choice's output). Holds no matched text, so it can go to logs, metrics and the audit log."""

    rule: str
    action: str  # "block" | "redact" | "flag"
    stage: str  # "input" | "output"
    count: int = 1

    def to_dict(self) -> dict:
        return {"rule": self.rule, "action": self.action, "stage": self.stage,
                "count": self.count}
