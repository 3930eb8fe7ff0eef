"""One request under its tenant's policy pack (`Screening`): the input stage's interventions and
the prompt texts as the model saw them, one output filter per choice as it streams, and (with the
tenant's audit_content) the text each choice was sent. RequestPolicy (request_policy.py) makes
one per admitted request; its outcome carries it to the audit log and the policy counters.
Host-side: no JAX.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
from typing import Callable, Sequence

from jaxserve.errors import InvalidRequest
from jaxserve.safety import Intervention, Pack, Rule, TextFilter
from jaxserve.tool_calling.functions import FunctionTool, parse_tools


def pii_redactions(pack: Pack) -> tuple[Rule, ...]:
    """The pack's PII detectors as redactions, whatever their own action: what logs and audit
    content are cleaned with."""
    return tuple(dataclasses.replace(r, action="redact", stage="both") for r in pack.rules
                 if r.match.startswith("pii:"))


def _redacted(redactions: list[tuple[int, int, str]], start: int, end: int) -> bool:
    """Whether text[start:end] overlaps one of the (sorted, disjoint) redacted spans."""
    i = bisect.bisect_right(redactions, start, key=lambda span: span[1])
    return i < len(redactions) and redactions[i][0] < end


def prompt_texts(parsed, decode: Callable[[list[int]], str]) -> list[str]:
    """Every text of a request that its prompt renders, for the input rules (review a70e490,
    M1): a completion's prompts (token ids as their text); a chat's message contents, each
    assistant tool call (its id, name and arguments, as the tool prompt writes them: JSON
    escapes decoded), each tool message's tool_call_id (templates that handle tools may write
    ids) and each tool (name, description, parameters schema). So a rule is not passed by moving
    its text into a tool's description or a past call's arguments (a /v1/responses
    function_call item is such a call)."""
    if parsed.kind != "chat":
        return [p if isinstance(p, str) else decode(p) for p in parsed.prompts]
    texts = []
    for m in parsed.prompts[0]:
        if isinstance(m.get("content"), str):
            texts.append(m["content"])
        if isinstance(m.get("tool_call_id"), str):
            texts.append(m["tool_call_id"])
        texts.extend(_call_text(call) for call in m.get("tool_calls") or ())
    texts.extend(json.dumps(t.to_openai(), ensure_ascii=False) for t in parsed.tools)
    return texts


def with_prompt_texts(parsed, before: Sequence[str], after: Sequence[str]):
    """`parsed` with the texts of prompt_texts replaced by their redacted versions; a token-id
    prompt whose text a redaction changed becomes the redacted text (tokenized again).
    ValueError when a redaction leaves a tool or a tool call that no longer parses."""
    if list(before) == list(after):
        return parsed
    if parsed.kind != "chat":
        prompts = [p if b == a else a for p, b, a in zip(parsed.prompts, before, after)]
        return dataclasses.replace(parsed, prompts=prompts)
    pairs = iter(zip(before, after))
    messages = []
    for m in parsed.prompts[0]:
        m = dict(m)
        if isinstance(m.get("content"), str):
            m["content"] = next(pairs)[1]
        if isinstance(m.get("tool_call_id"), str):
            m["tool_call_id"] = next(pairs)[1]
        if m.get("tool_calls"):
            m["tool_calls"] = [_with_call_text(call, *next(pairs)) for call in m["tool_calls"]]
        messages.append(m)
    tools = tuple(tool if b == a else _tool(a) for tool, (b, a) in zip(parsed.tools, pairs))
    return dataclasses.replace(parsed, prompts=[messages], tools=tools)


def _json(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _call_text(call) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):  # the tool prompt refuses it (400)
        return json.dumps(call, ensure_ascii=False, default=str)
    args = fn.get("arguments")
    return json.dumps({"id": call.get("id"), "name": fn.get("name"),
                       "arguments": _json(args) if isinstance(args, str) else args},
                      ensure_ascii=False)


def _with_call_text(call: dict, before: str, after: str) -> dict:
    if before == after:
        return call
    redacted = _json(after)
    if not isinstance(redacted, dict) or not {"id", "name", "arguments"} <= redacted.keys():
        raise ValueError("a redaction broke a tool call")
    args = redacted["arguments"]
    return {**call, "id": redacted["id"],
            "function": {**call["function"], "name": redacted["name"], "arguments":
                         args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


def _tool(text: str) -> FunctionTool:
    try:
        return parse_tools([_json(text)])[0]
    except InvalidRequest:
        raise ValueError("a redaction broke a tool") from None


class Screening:
    """One request under its tenant's pack: the input stage's interventions and the prompt texts
    as the model saw them, one output filter per choice, and (with the tenant's audit_content)
    the text each choice was sent."""

    def __init__(self, pack: Pack | None, input_interventions: Sequence[Intervention],
                 prompt_texts: Sequence[str], pii_rules: Sequence[Rule], keep_content: bool,
                 token_text: Callable[[int], str] | None = None):
        self.pack = pack
        self.input_interventions = tuple(input_interventions)
        self.prompt_texts = tuple(prompt_texts)
        self._pii_rules = tuple(pii_rules)
        self._filtering = pack is not None and pack.has_output_rules
        self._filters: dict[int, TextFilter] = {}
        self.retrieval_interventions: list[Intervention] = []
        # Per choice: the token ids (and logprobs) not sent yet, in groups of those that came
        # with one text delta: [text start, text end, ids, logprobs].
        self._held: dict[int, list[list]] = {}
        # One id's text: what a top-logprob alternative says (the same ids come back often).
        self._token_text = functools.lru_cache(4096)(token_text) if token_text else None
        self._terms: dict = {}  # per choice: its safety.policy.TermTest
        self.outputs: dict[int, list[str]] | None = {} if keep_content else None

    def output(self, choice: int, text_so_far: str, new_text: str, ids: list, logprobs,
               final: bool, lag: int = 0) -> tuple[str, list, list | None, bool]:
        """One choice's delta through its output filter: (text, token ids, logprobs) that may
        be sent, and whether a block rule ended the choice. `new_text` is the delta's raw text
        (the end of `text_so_far`), `lag` how many characters of a token's text the engine may
        show only later (a stop string's hold-back).

        Token ids and logprobs would spell the text they stand for, so they follow the filter
        (review a70e490, H4): they wait while it holds their text back; those whose text it
        redacted, or that a block ended, are never sent; and a top-logprob alternative that
        would complete a blocked or redacted term is left out."""
        blocked = False
        if self._filtering:
            f = self._filters.get(choice)
            if f is None:
                f = self._filters[choice] = self.pack.output_filter()
            result = f.update(text_so_far, final)
            blocked = result.blocked is not None
            ids, logprobs = self._release(choice, f, text_so_far, len(new_text), ids, logprobs,
                                          final or blocked, lag)
            new_text = result.text
        if self.outputs is not None and new_text:
            self.outputs.setdefault(choice, []).append(new_text)
        return new_text, ids, logprobs, blocked

    def _release(self, choice: int, f: TextFilter, text: str, new_chars: int, ids: list,
                 logprobs, done: bool, lag: int) -> tuple[list, list | None]:
        held = self._held.setdefault(choice, [])
        end = len(text)
        if held and held[-1][0] == held[-1][1]:  # ids whose text had not shown: it is this
            held[-1][1] = end
            held[-1][2].extend(ids)
            held[-1][3].extend(logprobs or ())
        elif ids:
            held.append([end - new_chars, end, list(ids), list(logprobs or ())])
        elif held:
            held[-1][1] = end
        out_ids, out_lps = [], []
        while held and (done or held[0][0] < held[0][1] and held[0][1] + lag <= f.position):
            start, stop, group_ids, group_lps = held.pop(0)
            if f.blocked is not None or _redacted(f.redactions, start, stop + lag):
                continue
            out_ids.extend(group_ids)
            if group_lps:
                out_lps.extend(self._alternatives(choice, text, start, stop, group_ids,
                                                  group_lps))
        return out_ids, None if logprobs is None else out_lps

    def _alternatives(self, choice: int, text: str, start: int, stop: int, ids: list,
                      logprobs: list) -> list:
        """The logprobs of the ids whose text is text[start:stop], with each top alternative
        that would complete a term an output rule blocks or redacts left out."""
        if self._token_text is None or not any(lp.top for lp in logprobs):
            return logprobs
        terms = self._terms.get(choice)
        if terms is None:
            terms = self._terms[choice] = self.pack.term_test()
        out = []
        for tid, lp in zip(ids, logprobs):
            completes = terms.at(text, start)
            out.append(lp._replace(top=[(alt, v) for alt, v in lp.top
                                        if not completes(self._token_text(alt))]))
            start = min(stop, start + len(self._token_text(tid)))
        return out

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
