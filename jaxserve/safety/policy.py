"""The policy file (`--policy FILE`, TOML): named packs of rules, read and compiled once at start.

    [pack.default]                  # optional table: the pack's own settings
    max_prompt_chars = 100000       # a longer prompt is blocked (rule "<pack>.max_prompt_chars")
    max_holdback_chars = 256        # the most output text held back while a match may form

    [[pack.default.rule]]
    name = "sesame"                 # optional; default "<pack>.rule[<index>]"
    stage = "input"                 # "input" | "output" | "both"
    match = "literal"               # "literal" | "regex" | "pii:email" | "pii:phone"
                                    # | "pii:credit_card" | "pii:api_key" | "classifier:NAME"
    pattern = "open sesame"         # literal and regex only
    whole_word = false              # literal only: match only between non-word characters
    kind = "secret"                 # optional: the word in [REDACTED:<kind>]
    action = "block"                # "block" | "redact" | "flag"

    [classifier.NAME]               # a moderation model (see jaxserve.safety.classifier)
    class = "package.module.Class"
    args = {}                       # keyword arguments of the constructor
    timeout_s = 2.0
    on_error = "block"              # "block" (fail closed) | "allow" (fail open)
    workers = 1
    max_calls_per_tenant = 1        # a tenant's calls queued or running at once
    max_input_chars = 100000        # a longer text is blocked without a call

A classifier rule (input stage only) adds `label` and `threshold` (it matches when the label's
score >= threshold) and takes the action block or flag. Every mistake — an unknown key, a wrong
type, a bad regex, an unknown classifier — is one ConfigError naming the file and the rule.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import regex

from jaxserve.errors import ConfigError
from jaxserve.safety.classifier import ClassifierRunner
from jaxserve.safety.normalize import IGNORABLE, fold, look_alikes
from jaxserve.safety.normalize import prepare as prepare_folding
from jaxserve.safety.pii import DETECTORS
from jaxserve.safety.rules import ACTIONS, STAGES, Intervention, Rule
from jaxserve.safety.text_filter import TextFilter, scan

DEFAULT_MAX_HOLDBACK_CHARS = 256
_PACK_KEYS = {"rule", "max_prompt_chars", "max_holdback_chars"}
_RULE_KEYS = {"name", "stage", "match", "pattern", "whole_word", "kind", "action", "label",
              "threshold"}
_CLASSIFIER_KEYS = {"class", "args", "timeout_s", "on_error", "workers", "max_calls_per_tenant",
                    "max_input_chars"}


@dataclass(frozen=True)
class InputDecision:
    """The input stage's verdict on one request: `texts` as the model may see them (redacted),
    every rule that acted, and the block, if one did (then nothing may be generated)."""

    texts: tuple[str, ...]
    interventions: tuple[Intervention, ...]
    blocked: Intervention | None = None


@dataclass(frozen=True, eq=False)
class Pack:
    name: str
    rules: tuple[Rule, ...]
    max_prompt_chars: int | None = None
    max_holdback_chars: int = DEFAULT_MAX_HOLDBACK_CHARS
    classifiers: Mapping[str, ClassifierRunner] = field(default_factory=dict)

    def _text_rules(self, stage: str) -> list[Rule]:
        return [r for r in self.rules if r.pattern is not None and r.applies_to(stage)]

    @property
    def has_output_rules(self) -> bool:
        return bool(self._text_rules("output"))

    def output_filter(self) -> TextFilter:
        """A filter for one choice's streamed output (one per choice)."""
        return TextFilter(self._text_rules("output"), "output", self.max_holdback_chars)

    def term_test(self) -> "TermTest":
        """For one choice's output: what its top-logprob alternatives may not name."""
        return TermTest([r for r in self._text_rules("output") if r.action != "flag"])

    def check_text(self, text: str) -> tuple[str, list[Intervention], Intervention | None]:
        """The input text rules on one text, at once (no classifier): (redacted text,
        interventions, the block or None). For retrieved chunks as well as prompts. The rules
        match the text folded (normalize.py: no invisible characters, accents, compatibility
        forms or look-alikes); a redaction replaces the original characters."""
        f = TextFilter(self._text_rules("input"), "input", self.max_holdback_chars)
        folded = fold(text)
        result = f.update(folded.text, final=True)
        if result.blocked is not None or not f.redactions:
            return text, f.interventions, result.blocked
        out, last = [], 0
        for start, end, replacement in f.redactions:
            start, end = folded.span(start, end)
            out += [text[last:start], replacement]
            last = end
        out.append(text[last:])
        return "".join(out), f.interventions, None

    async def check_input(self, texts: Sequence[str], tenant: str = "") -> InputDecision:
        """A request's prompt texts (a completion prompt, or each chat message's content): the
        size limit, then the text rules on each text, then each classifier the pack's rules use,
        once, on the redacted texts joined by newlines, as one of `tenant`'s calls
        (RateLimitExceeded when the tenant has too many classifier calls at once)."""
        if self.max_prompt_chars is not None and sum(map(len, texts)) > self.max_prompt_chars:
            block = Intervention(f"{self.name}.max_prompt_chars", "block", "input")
            return InputDecision(tuple(texts), (block,), block)
        out, found = [], []
        for text in texts:
            redacted, interventions, blocked = self.check_text(text)
            found.extend(interventions)
            if blocked is not None:
                return InputDecision(tuple(texts), _merge(found), blocked)
            out.append(redacted)
        blocked = await self._classify("\n".join(out), found, tenant)
        return InputDecision(tuple(out), _merge(found), blocked)

    async def _classify(self, text: str, found: list[Intervention],
                        tenant: str) -> Intervention | None:
        rules = [r for r in self.rules if r.classifier is not None]
        if not rules:
            return None
        names = list(dict.fromkeys(r.classifier for r in rules))
        results = dict(zip(names, await asyncio.gather(
            *(self.classifiers[n].classify(text, tenant) for n in names))))
        blocked = None
        for name, result in results.items():
            if result.error is not None:
                runner = self.classifiers[name]
                action = "block" if runner.on_error == "block" or result.oversized else "flag"
                found.append(Intervention(f"classifier:{name}", action, "input"))
                blocked = blocked or (found[-1] if action == "block" else None)
        for r in rules:
            score = results[r.classifier].scores.get(r.label)
            if score is not None and score >= r.threshold:
                found.append(Intervention(r.name, r.action, "input"))
                if r.action == "block" and blocked is None:
                    blocked = found[-1]
        return blocked


class TermTest:
    """Whether a token written at some point of a growing text would complete a match of an
    output rule that blocks or redacts: what a top-logprob alternative there may not name. The
    text is scanned once as it grows, as the output filter does: a match a token completes
    starts no earlier than where the text before it could still become one."""

    _CONTEXT = 16  # characters kept before that point, for lookbehinds

    def __init__(self, rules: Sequence[Rule]):
        self._rules = tuple(rules)
        self._starts = [0] * len(self._rules)

    def at(self, text: str, end: int) -> Callable[[str], bool]:
        """The test for a token written after text[:end] (`end` never goes back)."""
        self._starts = [scan(r, text, start, False, end)[1] if start < end else start
                        for r, start in zip(self._rules, self._starts)]
        lead = max(0, min(self._starts, default=end) - self._CONTEXT)
        before = text[lead:end]
        cut = end - lead
        scans = [(r.pattern.finditer, start - lead, r.check)
                 for r, start in zip(self._rules, self._starts)]

        def completes(token: str) -> bool:
            candidate = before + token
            for finditer, start, check in scans:
                for m in finditer(candidate, start):
                    if m.end() > cut and (check is None or check(m.group())):
                        return True
            return False
        return completes


def _merge(interventions: list[Intervention]) -> tuple[Intervention, ...]:
    """One intervention per (rule, action), the counts added."""
    counts: dict[tuple[str, str, str], int] = {}
    for i in interventions:
        key = (i.rule, i.action, i.stage)
        counts[key] = counts.get(key, 0) + i.count
    return tuple(Intervention(r, a, s, k) for (r, a, s), k in counts.items())


@dataclass(frozen=True, eq=False)
class PolicySet:
    """Every pack of one policy file, and the classifiers they share."""

    path: Path
    packs: Mapping[str, Pack]
    classifiers: Mapping[str, ClassifierRunner] = field(default_factory=dict)

    def pack(self, name: str) -> Pack:
        try:
            return self.packs[name]
        except KeyError:
            raise ConfigError(f"{self.path}: no pack named {name!r} (packs: "
                              f"{', '.join(sorted(self.packs)) or 'none'})") from None

    def close(self) -> None:
        for runner in self.classifiers.values():
            runner.close()


# ---------------------------------------------------------------- loading


def load_policy(path: str | Path) -> PolicySet:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read the policy file {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    _no_unknown(path, "the policy file", data, {"pack", "classifier"})
    classifier_specs = _table(path, "classifier", data.get("classifier", {}))
    for name, spec in classifier_specs.items():
        _check_classifier(path, name, spec)
    packs_data = _table(path, "pack", data.get("pack", {}))
    if not packs_data:
        raise ConfigError(f"{path}: defines no pack ([[pack.NAME.rule]])")
    used = set()
    packs = {}
    for name, pack_data in packs_data.items():
        packs[name] = _load_pack(path, name, _table(path, f"pack.{name}", pack_data),
                                 classifier_specs, used)
    runners = {}
    try:
        for name in sorted(used):
            spec = classifier_specs[name]
            try:
                runners[name] = ClassifierRunner(
                    name, spec["class"], spec.get("args", {}), float(spec.get("timeout_s", 2.0)),
                    spec.get("on_error", "block"), spec.get("workers", 1),
                    spec.get("max_calls_per_tenant", 1), spec.get("max_input_chars", 100_000))
            except ConfigError as e:
                raise ConfigError(f"{path}: classifier.{name}: {e}") from None
    except ConfigError:
        for runner in runners.values():
            runner.close()
        raise
    packs = {name: dataclasses.replace(
        p, classifiers={r.classifier: runners[r.classifier] for r in p.rules if r.classifier})
        for name, p in packs.items()}
    if any(p._text_rules("input") for p in packs.values()):
        prepare_folding()  # its tables now, not in the first request
    return PolicySet(path, packs, runners)


def _load_pack(path: Path, name: str, data: dict, classifiers: dict, used: set) -> Pack:
    where = f"pack.{name}"
    _no_unknown(path, where, data, _PACK_KEYS)
    max_prompt = _positive_int(path, where, data, "max_prompt_chars")
    holdback = _positive_int(path, where, data, "max_holdback_chars")
    rules_data = data.get("rule", [])
    if not isinstance(rules_data, list):
        raise ConfigError(f"{path}: {where}.rule must be an array of tables ([[{where}.rule]])")
    rules, names = [], set()
    for i, rule_data in enumerate(rules_data):
        rule = _load_rule(path, name, i, _table(path, f"{where}.rule[{i}]", rule_data),
                          classifiers)
        if rule.name in names:
            raise ConfigError(f"{path}: {where}.rule[{i}]: the name {rule.name!r} is used twice")
        names.add(rule.name)
        if rule.classifier:
            used.add(rule.classifier)
        rules.append(rule)
    return Pack(name, tuple(rules), max_prompt,
                holdback if holdback is not None else DEFAULT_MAX_HOLDBACK_CHARS)


def _load_rule(path: Path, pack: str, index: int, data: dict, classifiers: dict) -> Rule:
    where = f"pack.{pack}.rule[{index}]"

    def fail(msg: str) -> ConfigError:
        return ConfigError(f"{path}: {where}: {msg}")

    _no_unknown(path, where, data, _RULE_KEYS)
    for key in ("stage", "match", "action"):
        if key not in data:
            raise fail(f"'{key}' is required")
    stage, match, action = data["stage"], data["match"], data["action"]
    if stage not in STAGES:
        raise fail(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
    if action not in ACTIONS:
        raise fail(f"action must be one of {', '.join(ACTIONS)}, got {action!r}")
    name = _string(path, where, data, "name") or f"{pack}.rule[{index}]"
    kind = _string(path, where, data, "kind")
    if not isinstance(match, str):
        raise fail(f"match must be a string, got {match!r}")
    text_keys = {"pattern", "whole_word", "kind"} & data.keys()
    if match.startswith("classifier:"):
        return _classifier_rule(fail, data, name, stage, match, action, classifiers, text_keys)
    if {"label", "threshold"} & data.keys():
        raise fail("'label' and 'threshold' belong to classifier rules")
    if match in ("literal", "regex"):
        pattern = data.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise fail(f"a {match} rule needs a non-empty string 'pattern'")
        whole_word = data.get("whole_word", False)
        if not isinstance(whole_word, bool) or (whole_word and match != "literal"):
            raise fail("whole_word is true or false, for literal rules only")
        if match == "literal":
            source = _literal_source(pattern)
            if whole_word:
                source = rf"(?<!\w){source}(?!\w)"
            compiled = regex.compile(source, regex.IGNORECASE)
        else:
            try:
                compiled = regex.compile(pattern)
            except regex.error as e:
                raise fail(f"bad regex {pattern!r}: {e}") from None
            if compiled.search("") is not None:
                raise fail(f"the regex {pattern!r} matches the empty string")
        return Rule(name, stage, match, action, kind or match, compiled,
                    needs_lookahead=match == "regex" or whole_word)
    if match.startswith("pii:") and match[4:] in DETECTORS:
        if "pattern" in data or "whole_word" in data:
            raise fail(f"a {match} rule takes no 'pattern' or 'whole_word'")
        detector = DETECTORS[match[4:]]
        return Rule(name, stage, match, action, kind or detector.kind, detector.pattern,
                    detector.check)
    raise fail(f"match must be literal, regex, {', '.join('pii:' + k for k in DETECTORS)} or "
               f"classifier:NAME, got {match!r}")


def _literal_source(pattern: str) -> str:
    """A literal as a regex that matches it in folded text (input) and in text as written
    (output) alike: each character of its fold matches that character or a look-alike, with
    what a fold drops (zero-width and format characters, combining marks) allowed after it;
    its whitespace matches any run of whitespace."""
    parts = []
    for ch in fold(pattern).text:
        if ch.isspace():
            if not parts or parts[-1] != r"\s+":
                parts.append(r"\s+")
            continue
        alikes = "".join(dict.fromkeys(look_alikes(ch.lower()) + look_alikes(ch.upper())))
        parts.append(regex.escape(ch) if len(alikes) == 1 else f"[{regex.escape(alikes)}]")
    return f"{IGNORABLE}*".join(parts)


def _classifier_rule(fail, data, name, stage, match, action, classifiers, text_keys) -> Rule:
    clf = match.removeprefix("classifier:")
    if clf not in classifiers:
        raise fail(f"no [classifier.{clf}] is defined")
    if stage != "input":
        raise fail("classifier rules apply to the input stage only")
    if action not in ("block", "flag"):
        raise fail("a classifier rule's action is block or flag (it names no text to redact)")
    if text_keys:
        raise fail(f"a classifier rule takes no {', '.join(sorted(text_keys))}")
    label, threshold = data.get("label"), data.get("threshold")
    if not isinstance(label, str) or not label:
        raise fail("a classifier rule needs a string 'label'")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise fail("a classifier rule needs a number 'threshold'")
    return Rule(name, stage, match, action, classifier=clf, label=label,
                threshold=float(threshold))


def _check_classifier(path: Path, name: str, spec: Any) -> None:
    where = f"classifier.{name}"
    spec = _table(path, where, spec)
    _no_unknown(path, where, spec, _CLASSIFIER_KEYS)
    if not isinstance(spec.get("class"), str):
        raise ConfigError(f"{path}: {where}: 'class' (a dotted path) is required")
    _table(path, f"{where}.args", spec.get("args", {}))
    timeout = spec.get("timeout_s", 2.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"{path}: {where}: timeout_s must be a number > 0, got {timeout!r}")
    if spec.get("on_error", "block") not in ("block", "allow"):
        raise ConfigError(f"{path}: {where}: on_error must be block or allow, got "
                          f"{spec['on_error']!r}")
    for key in ("workers", "max_calls_per_tenant", "max_input_chars"):
        _positive_int(path, where, spec, key)


def _table(path: Path, where: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {where} must be a table, got {type(value).__name__}")
    return value


def _no_unknown(path: Path, where: str, data: dict, known: set) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: {where}: unknown key(s) {', '.join(unknown)} (known: "
                          f"{', '.join(sorted(known))})")


def _string(path: Path, where: str, data: dict, key: str) -> str | None:
    value = data.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{path}: {where}: {key} must be a non-empty string, got {value!r}")
    return value


def _positive_int(path: Path, where: str, data: dict, key: str) -> int | None:
    value = data.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ConfigError(f"{path}: {where}: {key} must be an integer >= 1, got {value!r}")
    return value
