"""Apply a pack's text rules to text that may still be growing: a model's output as it streams,
or, in one final call, a prompt.

The filter keeps one position, `_pos`: text before it is decided (released, or replaced by a
redaction). On each `update(text)` with the choice's whole text so far it scans only from there:
a rule either matches for sure (the match cannot change whatever text follows), or the text from
some point on may still become a match (a `regex` partial match, or a match that touches the end
and could grow or fail a lookahead) and is held back. So a blocked term is never released, even
when the tokens that spell it arrive one by one; what is held is just the tail that could still
be one, never more than `max_holdback` characters. A match still forming when the cap forces its
start out (a JWT longer than the hold-back) gets its rule's action all the same: what is forced
out is redacted (one `[REDACTED:kind]`, and the rest of that match after it) or blocks the
stream, or is counted (flag); a redacted match still forming 16 x max_holdback characters after
its start ends the stream (content_filter) rather than be scanned on without bound. The cost per update is a scan of the held tail plus the new text,
per rule (from the start of a match the cap cut, while that match goes on).

`redactions` lists the spans of the text that were not released verbatim, so the serving layer
can hold back the token ids and logprobs that would spell them.

The engine does the same for stop strings (jaxserve/core/engine.py holds back len(stop) - 1
characters); this filter sits after it, on the text the engine shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from jaxserve.safety.rules import ACTION_ORDER, Intervention, Rule


# A redaction whose match is still forming this many times max_holdback characters after it
# began ends the stream instead (see update).
OPEN_MATCH_FACTOR = 16


@dataclass(frozen=True)
class FilterResult:
    """What one update lets out. `text` is new text to send (redactions applied); `blocked` is set
    when a block rule matched: `text` is then everything before the match not sent yet, and the
    stream must end there (finish_reason "content_filter")."""

    text: str
    blocked: Intervention | None = None


def scan(rule: Rule, text: str, pos: int, final: bool,
         end: int | None = None) -> tuple[list[tuple[int, int]], int]:
    """The sure matches of `rule` in text[:end] starting at or after `pos`, and where text must
    be held back from (`end`, by default len(text), when nothing is pending)."""
    n = len(text) if end is None else end
    spans = []
    for m in rule.pattern.finditer(text, pos, n, partial=not final):
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
        # Per rule whose match was cut by the hold-back cap: where that match starts. It is
        # scanned from there while the match goes on, so all of it gets the rule's action.
        self._open: dict[int, int] = {}
        # (start, end, what replaced it) of each span of the text not released verbatim
        self.redactions: list[tuple[int, int, str]] = []
        self.blocked: Intervention | None = None

    def update(self, text: str, final: bool = False) -> FilterResult:
        """`text`: the whole text so far (it only ever grows); `final`: no more will come."""
        if self.blocked is not None:
            return FilterResult("", self.blocked)
        n = len(text)
        for i, start in self._open.items():
            if n - start > OPEN_MATCH_FACTOR * self._max_holdback and \
                    self._rules[i].action == "redact":
                # Each update scans a cut match from its start: past this bound, ending the
                # stream keeps that cost bounded and still lets nothing of the match out.
                self._hits[i] += 1
                self.blocked = Intervention(self._rules[i].name, "block", self._stage)
                return FilterResult("", self.blocked)
        events, growing, pos = [], [], self._pos
        for i, rule in enumerate(self._rules):
            start = self._open.get(i) if self._open else None
            if start is None:
                start = max(self._rule_pos[i], pos)
            spans, g = scan(rule, text, start, final)
            growing.append(g)
            if spans:
                order = ACTION_ORDER[rule.action]
                events.extend((s, order, -e, i) for s, e in spans)
        # A pattern that can keep growing (`a.*b`) must not hold the stream forever: past the
        # cap, a match still forming is released under its rule's action (H5), so a secret
        # longer than the hold-back is redacted (or blocks) all the same.
        first = min(growing, default=n)
        release = max(first, n - self._max_holdback, pos)
        self._open = {}
        if first < release:
            for i, g in enumerate(growing):
                if g < release:
                    events.append((g, ACTION_ORDER[self._rules[i].action], -release, i))
                    self._open[i] = g
        events.sort()
        block = next((ev for ev in events if self._rules[ev[3]].action == "block"), None)
        limit = block[0] if block is not None else release
        out = []
        for start, _, neg_end, i in events:
            if start >= limit:
                break
            rule, end = self._rules[i], -neg_end
            if start < self._pos or start < self._rule_pos[i]:
                # A match that began inside text already redacted (the rest of a cut match,
                # or one overlapping a redaction): a redaction swallows its tail too.
                self._rule_pos[i] = max(self._rule_pos[i], end)
                if rule.action == "redact" and end > self._pos and start < self._pos:
                    self._redacted(self._pos, end, "")
                continue
            self._hits[i] += 1
            self._rule_pos[i] = end
            if rule.action == "redact":
                out.append(text[self._pos:start])
                out.append(rule.replacement)
                self._redacted(start, end, rule.replacement)
        if limit > self._pos:
            out.append(text[self._pos:limit])
            self._pos = limit
        if block is not None:
            i = block[3]
            self._hits[i] += 1
            self.blocked = Intervention(self._rules[i].name, "block", self._stage)
        return FilterResult("".join(out), self.blocked)

    def _redacted(self, start: int, end: int, replacement: str) -> None:
        if self.redactions and self.redactions[-1][1] >= start:
            start, _, before = self.redactions.pop()
            replacement = before + replacement
        self.redactions.append((start, end, replacement))
        self._pos = end

    @property
    def position(self) -> int:
        """Text before this index is decided (sent or redacted); the rest is held back."""
        return self._pos

    @property
    def interventions(self) -> list[Intervention]:
        """Every rule that acted so far (a block included), with its number of matches."""
        return [Intervention(r.name, r.action, self._stage, k)
                for r, k in zip(self._rules, self._hits) if k]
