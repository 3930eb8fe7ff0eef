"""Detectors for common PII: e-mail addresses, phone numbers, credit-card numbers (Luhn-checked)
and API-key-shaped strings.

Each detector is a `regex` pattern (the `regex` module, for its partial matching: the streaming
output filter asks whether the text so far could still grow into a match) plus an optional check
on the matched text. The patterns aim at what a person would call that kind of data in running
text, not at every syntax the standards allow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import regex


def luhn_valid(digits: str) -> bool:
    """The Luhn checksum every payment card number carries (ISO/IEC 7812)."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _digits(text: str) -> str:
    return "".join(ch for ch in text if ch.isdigit())


def _card(text: str) -> bool:
    return luhn_valid(_digits(text))


def _phone(text: str) -> bool:
    return 8 <= len(_digits(text)) <= 15  # E.164 allows at most 15 digits


@dataclass(frozen=True)
class Detector:
    kind: str  # "email" | "phone" | "credit_card" | "api_key"
    pattern: regex.Pattern
    check: Callable[[str], bool] | None = None  # a match failing it is not that kind of data


_EMAIL = (r"(?<![\w.%+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63})*"
          r"\.[A-Za-z]{2,24}(?![\w-])")
# +CC then 2-5 groups (E.164, spaced or not), or North-American style 555-123-4567,
# (555) 123-4567, 555.123.4567, 555 123 4567.
_PHONE = (r"(?<![\w+])(?:\+\d{1,3}(?:[ .-]?\(?\d{1,4}\)?){2,5}"
          r"|(?:\(\d{3}\) ?|\d{3}[ .-])\d{3}[ .-]\d{4})(?![\w])")
# 13-19 digits, optionally grouped by single spaces or dashes.
_CARD = r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d])"
# Published key formats: OpenAI (sk-, sk-proj-), Anthropic (sk-ant-), AWS access key ids,
# GitHub tokens, Slack tokens, Google API keys, Stripe keys, GitLab personal tokens, and JWTs.
_API_KEY = (r"(?<![\w-])(?:sk-[A-Za-z0-9_-]{20,200}|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{36,251}"
            r"|github_pat_[A-Za-z0-9_]{22,251}|xox[abprs]-[A-Za-z0-9-]{10,200}"
            r"|AIza[0-9A-Za-z_-]{35}|(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{16,200}"
            r"|glpat-[A-Za-z0-9_-]{20,200}"
            r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})"
            r"(?![\w-])")

DETECTORS: dict[str, Detector] = {
    "email": Detector("email", regex.compile(_EMAIL)),
    "phone": Detector("phone", regex.compile(_PHONE), _phone),
    "credit_card": Detector("credit_card", regex.compile(_CARD), _card),
    "api_key": Detector("api_key", regex.compile(_API_KEY)),
}
