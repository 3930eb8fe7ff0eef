"""Apply a pack's text rules to text that may still be growing: a model's output as it streams,
or, in one final call, a prompt.

The filter keeps one position, `_pos`: text before it is decided (released, or replaced by a
redaction). On each `update(text)` with the choice's whole text so far it scans only from there:
a rule either matches for sure (the match cannot change whatever text follows), or the text from
some point on may still become a match (a `regex` partial match, or a match that touches the end
and could grow or fail a lookahead) and is held back. So a blocked term is never released, even
when the tokens that spell it arrive one by one; what is held is just the tail that could still
be one, never more than `max_holdback` characters. The cost per update is a scan of the held tail
plus the new text, per rule.

The engine does the same for stop strings (jaxserve/core/engine.py holds back len(stop) - 1
characters); this filter sits after it, on the text the engine shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from jaxserve.safety.rules import ACTION_ORDER, Intervention, Rule


@dataclass(frozen=True)
class FilterResult:
    """What one update lets out. `text` is new text to send (redactions applied); `blocked` is set
    when a block rule matched: `text` is then everything before the match not sent yet, and the
    stream must end there (finish_reason "content_filter")."""

    text: str
    blocked: Intervention | None = None


def _scan(rule: Rule, text: str, pos: int, final: bool) -> tuple[list[tuple[int, int]], int]:
    """The sure matches of `rule` starting at or after `pos`, and where text must be held back
    from (len(text) when nothing is pending)."""
    n = len(text)
    spans = []
    for m in rule.pattern.finditer(text, pos, partial=not final):
        start, end = m.span()
        if end == start:  # an empty partial match at the end: nothing pending
            continue
        growing = m.partial or (end == n and not final and (
            rule.action != "block" or rule.needs_lookahead))
        if growing:
            return spans, start
        if rule.check is None or rule.check(m.group()):
            spans.append((start, end))
    return spans, n


class TextFilter:
    """One text stream (one choice's output, or one prompt) under a list of rules of one stage."""

    def __init__(self, rules: Sequence[Rule], stage: str, max_holdback: int):
        self._rules = tuple(rules)
        self._stage = stage
        self._max_holdback = max_holdback
        self._pos = 0
        self._rule_pos = [0] * len(self._rules)  # per rule: matches before it were counted
        self._hits = [0] * len(self._rules)
        self.blocked: Intervention | None = None

    def update(self, text: str, final: bool = False) -> FilterResult:
        """`text`: the whole text so far (it only ever grows); `final`: no more will come."""
        if self.blocked is not None:
            return FilterResult("", self.blocked)
        n = len(text)
        hold = n
        events = []
        for i, rule in enumerate(self._rules):
            spans, rule_hold = _scan(rule, text, max(self._rule_pos[i], self._pos), final)
            hold = min(hold, rule_hold)
            events.extend((s, ACTION_ORDER[rule.action], -e, i) for s, e in spans)
        # A pattern that can keep growing (`a.*b`) must not hold the stream forever.
        hold = max(hold, n - self._max_holdback, self._pos)
        events.sort()
        block = next((ev for ev in events if self._rules[ev[3]].action == "block"), None)
        limit = block[0] if block is not None else hold
        out = []
        for start, _, neg_end, i in events:
            if start >= limit:
                break
            if start < self._pos or start < self._rule_pos[i]:
                continue  # inside a redaction, or an overlapping match of the same rule
            rule, end = self._rules[i], -neg_end
            self._hits[i] += 1
            self._rule_pos[i] = end
            if rule.action == "redact":
                out.append(text[self._pos:start])
                out.append(rule.replacement)
                self._pos = end
        if limit > self._pos:
            out.append(text[self._pos:limit])
            self._pos = limit
        if block is not None:
            i = block[3]
            self._hits[i] += 1
            self.blocked = Intervention(self._rules[i].name, "block", self._stage)
        return FilterResult("".join(out), self.blocked)

    @property
    def position(self) -> int:
        """Text before this index is decided (sent or redacted); the rest is held back."""
        return self._pos

    @property
    def interventions(self) -> list[Intervention]:
        """Every rule that acted so far (a block included), with its number of matches."""
        return [Intervention(r.name, r.action, self._stage, k)
                for r, k in zip(self._rules, self._hits) if k]
