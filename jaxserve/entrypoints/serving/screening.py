"""One request under its tenant's policy pack (`Screening`): the input stage's interventions and
the prompt texts as the model saw them, one output filter per choice as it streams, and (with the
tenant's audit_content) the text each choice was sent. RequestPolicy (request_policy.py) makes
one per admitted request; its outcome carries it to the audit log and the policy counters.
Host-side: no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxserve.safety import Intervention, Pack, Rule, TextFilter


def pii_redactions(pack: Pack) -> tuple[Rule, ...]:
    """The pack's PII detectors as redactions, whatever their own action: what logs and audit
    content are cleaned with."""
    return tuple(dataclasses.replace(r, action="redact", stage="both") for r in pack.rules
                 if r.match.startswith("pii:"))


class Screening:
    """One request under its tenant's pack: the input stage's interventions and the prompt texts
    as the model saw them, one output filter per choice, and (with the tenant's audit_content)
    the text each choice was sent."""

    def __init__(self, pack: Pack | None, input_interventions: Sequence[Intervention],
                 prompt_texts: Sequence[str], pii_rules: Sequence[Rule], keep_content: bool):
        self.pack = pack
        self.input_interventions = tuple(input_interventions)
        self.prompt_texts = tuple(prompt_texts)
        self._pii_rules = tuple(pii_rules)
        self._filtering = pack is not None and pack.has_output_rules
        self._filters: dict[int, TextFilter] = {}
        self.retrieval_interventions: list[Intervention] = []
        self._held: dict[int, tuple[list, list]] = {}  # per choice: token ids, logprobs
        self.outputs: dict[int, list[str]] | None = {} if keep_content else None

    def output(self, choice: int, text_so_far: str, new_text: str, ids: list, logprobs,
               final: bool) -> tuple[str, list, list | None, bool]:
        """One choice's delta through its output filter: (text, token ids, logprobs) that may
        be sent, and whether a block rule ended the choice. Token ids and logprobs wait while
        the filter holds text back (they would spell it), and those of a blocked term are
        never sent."""
        blocked = False
        if self._filtering:
            f = self._filters.get(choice)
            if f is None:
                f = self._filters[choice] = self.pack.output_filter()
            result = f.update(text_so_far, final)
            new_text, blocked = result.text, result.blocked is not None
            held_ids, held_lps = self._held.setdefault(choice, ([], []))
            held_ids.extend(ids)
            held_lps.extend(logprobs or ())
            if blocked or f.position < len(text_so_far):
                ids, logprobs = [], None if logprobs is None else []
            else:
                ids, logprobs = held_ids[:], None if logprobs is None else held_lps[:]
            if blocked or f.position == len(text_so_far):
                held_ids.clear()
                held_lps.clear()
        if self.outputs is not None and new_text:
            self.outputs.setdefault(choice, []).append(new_text)
        return new_text, ids, logprobs, blocked

    def screen_chunks(self, results: list) -> list:
        """Retrieved chunks (rag.SearchResult) through the input text rules: a chunk a block
        rule matches is dropped from the context (prompt injection through a document), others
        are redacted; each rule that acted is recorded with stage "retrieval"."""
        if self.pack is None:
            return results
        kept = []
        for r in results:
            text, found, blocked = self.pack.check_text(r.text)
            self.retrieval_interventions.extend(
                dataclasses.replace(i, stage="retrieval") for i in found)
            if blocked is None:
                kept.append(dataclasses.replace(r, text=text))
        return kept

    @property
    def later_interventions(self) -> list[Intervention]:
        """Those of the request's processing after admission: retrieval, then each choice's."""
        return [*self.retrieval_interventions,
                *(i for f in self._filters.values() for i in f.interventions)]

    @property
    def interventions(self) -> list[Intervention]:
        return [*self.input_interventions, *self.later_interventions]

    def redact_pii(self, text: str) -> str:
        if not self._pii_rules:
            return text
        return TextFilter(self._pii_rules, "input", len(text) + 1).update(text, final=True).text
