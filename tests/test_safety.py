"""Policy filters (jaxserve.safety): the policy file and its errors, every rule kind and action,
the PII detectors (Luhn included), the streaming output filter's hold-back across token
boundaries, the Classifier hook with its timeout, the interventions counter, and
`jaxserve policy check`."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from jaxserve.entrypoints.cli import main
from jaxserve.errors import ConfigError
from jaxserve.safety import Classifier, Intervention, load_policy
from jaxserve.safety.pii import DETECTORS, luhn_valid
from jaxserve.telemetry.metrics import PolicyMetrics


def policy(tmp_path: Path, text: str):
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return load_policy(path)


def rule(match: str, action: str, stage: str = "both", **extra) -> str:
    """One [[pack.default.rule]] table (values written as JSON, which TOML reads the same)."""
    fields = {"stage": stage, "match": match, "action": action, **extra}
    return "[[pack.default.rule]]\n" + "".join(f"{k} = {json.dumps(v)}\n"
                                               for k, v in fields.items())


def check(pack, *texts):
    return asyncio.run(pack.check_input(list(texts)))


# ---------------------------------------------------------------- the policy file


@pytest.mark.parametrize("body, where, message", [
    (rule("regex", "block", pattern="(unclosed"), "pack.default.rule[0]", "bad regex"),
    (rule("regex", "block", pattern="a*"), "pack.default.rule[0]", "matches the empty string"),
    (rule("literal", "block", pattern="x") + rule("literal", "shout", pattern="y"),
     "pack.default.rule[1]", "action must be one of block, redact, flag"),
    (rule("literal", "block", stage="sideways", pattern="x"), "pack.default.rule[0]",
     "stage must be one of"),
    (rule("literal", "block"), "pack.default.rule[0]", "needs a non-empty string 'pattern'"),
    (rule("pii:ssn", "redact"), "pack.default.rule[0]", "match must be literal, regex, pii:email"),
    (rule("pii:email", "redact", pattern="x"), "pack.default.rule[0]", "takes no 'pattern'"),
    (rule("literal", "block", pattern="x", colour="red"), "pack.default.rule[0]",
     "unknown key(s) colour"),
    (rule("regex", "block", pattern="x", whole_word=True), "pack.default.rule[0]",
     "whole_word is true or false, for literal rules only"),
    (rule("literal", "block", pattern="x", name="a") + rule("literal", "flag", pattern="y",
                                                             name="a"),
     "pack.default.rule[1]", "the name 'a' is used twice"),
    (rule("classifier:tox", "block", stage="input", label="t", threshold=0.5),
     "pack.default.rule[0]", "no [classifier.tox] is defined"),
    ("[pack.default]\nmax_prompt_chars = 0\n", "pack.default", "max_prompt_chars must be"),
    ("[pack.default]\nrule = 3\n", "pack.default", "must be an array of tables"),
    ("[packs.default]\n", "the policy file", "unknown key(s) packs"),
    ("", "", "defines no pack"),
    ("[pack.default\n", "", "not valid TOML"),
])
def test_every_mistake_is_one_error_naming_file_pack_and_rule(tmp_path, body, where, message):
    with pytest.raises(ConfigError) as e:
        policy(tmp_path, body)
    assert str(e.value).startswith(f"{tmp_path / 'policy.toml'}: {where}"), str(e.value)
    assert message in str(e.value)


CLASSIFIER = """
[classifier.tox]
class = "tests.test_safety:KeywordClassifier"
args = {{ word = "awful" }}
timeout_s = {timeout}
on_error = "{on_error}"
"""


@pytest.mark.parametrize("body, where, message", [
    (CLASSIFIER.format(timeout=1, on_error="block") + rule(
        "classifier:tox", "block", stage="output", label="toxic", threshold=0.5),
     "pack.default.rule[0]", "input stage only"),
    (CLASSIFIER.format(timeout=1, on_error="block") + rule(
        "classifier:tox", "redact", stage="input", label="toxic", threshold=0.5),
     "pack.default.rule[0]", "block or flag"),
    (CLASSIFIER.format(timeout=1, on_error="block") + rule(
        "classifier:tox", "block", stage="input", label="toxic"),
     "pack.default.rule[0]", "needs a number 'threshold'"),
    (CLASSIFIER.format(timeout=0, on_error="block"), "classifier.tox", "timeout_s must be"),
    (CLASSIFIER.format(timeout=1, on_error="maybe"), "classifier.tox", "on_error must be"),
    (CLASSIFIER.format(timeout=1, on_error="block").replace("KeywordClassifier", "Nope")
     + rule("classifier:tox", "block", stage="input", label="t", threshold=1),
     "classifier.tox", "has no attribute 'Nope'"),
    (CLASSIFIER.format(timeout=1, on_error="block").replace(
        "tests.test_safety:KeywordClassifier", "pathlib:PurePath")
     + rule("classifier:tox", "block", stage="input", label="t", threshold=1),
     "classifier.tox", "not a subclass of jaxserve.safety.Classifier"),
])
def test_classifier_config_errors(tmp_path, body, where, message):
    with pytest.raises(ConfigError) as e:
        policy(tmp_path, body)
    assert str(e.value).startswith(f"{tmp_path / 'policy.toml'}: {where}"), str(e.value)
    assert message in str(e.value)


def test_packs_and_rule_names(tmp_path):
    ps = policy(tmp_path, rule("literal", "flag", pattern="x")
                + rule("literal", "flag", pattern="y", name="why")
                + "[pack.strict]\nmax_prompt_chars = 10\n")
    assert [r.name for r in ps.pack("default").rules] == ["default.rule[0]", "why"]
    assert ps.pack("strict").rules == () and ps.pack("strict").max_prompt_chars == 10
    assert not ps.pack("strict").has_output_rules
    with pytest.raises(ConfigError, match="no pack named 'lax'.*default, strict"):
        ps.pack("lax")


# ---------------------------------------------------------------- rule kinds on the input


def test_literal_is_case_insensitive_and_may_be_whole_word(tmp_path):
    pack = policy(tmp_path, rule("literal", "block", pattern="Open Sesame")
                  + rule("literal", "redact", pattern="ass", whole_word=True, kind="rude")
                  ).pack("default")
    d = check(pack, "please oPEN sESAME now")
    assert d.blocked == Intervention("default.rule[0]", "block", "input")
    d = check(pack, "a class act, you ass.", "ASS!")
    assert d.blocked is None
    assert d.texts == ("a class act, you [REDACTED:rude].", "[REDACTED:rude]!")
    assert d.interventions == (Intervention("default.rule[1]", "redact", "input", 2),)


def test_regex_block_redact_and_flag(tmp_path):
    pack = policy(tmp_path, rule("regex", "flag", pattern=r"order #\d+", name="orders")
                  + rule("regex", "redact", pattern=r"(?i)project [A-Z]+\b", kind="codename")
                  + rule("regex", "block", stage="output", pattern="never-on-input")
                  ).pack("default")
    d = check(pack, "about order #12 and order #7 of Project FALCON; never-on-input")
    assert d.blocked is None  # the block rule is an output rule
    assert d.texts == ("about order #12 and order #7 of [REDACTED:codename]; never-on-input",)
    assert set(d.interventions) == {Intervention("orders", "flag", "input", 2),
                                    Intervention("default.rule[1]", "redact", "input", 1)}
    assert check(pack, "nothing here").interventions == ()


@pytest.mark.parametrize("kind, hits, misses", [
    ("email", ["bob@example.com", "a.b+tag@mail.co.uk"], ["bob@", "@example.com", "a@b"]),
    ("phone", ["+1 415 555 2671", "(415) 555-2671", "415-555-2671", "+44 20 7946 0958"],
     ["2024-01-15", "415 5552", "call 911", "+1 23"]),
    ("credit_card", ["4111 1111 1111 1111", "5500-0000-0000-0004", "378282246310005"],
     ["4111 1111 1111 1112", "1234 5678", "2024-01-15"]),
    ("api_key", ["sk-proj-abcdefghijklmnopqrstuvwx", "AKIAIOSFODNN7EXAMPLE",
                 "ghp_" + "a1" * 18, "xoxb-1234567890-abc"],
     ["sk-short", "AKIA123", "skeleton-key"]),
])
def test_pii_detectors(tmp_path, kind, hits, misses):
    pack = policy(tmp_path, rule(f"pii:{kind}", "redact")).pack("default")
    for value in hits:
        d = check(pack, f"see {value}, ok")
        assert d.texts == (f"see [REDACTED:{kind}], ok",), value
    for value in misses:
        assert check(pack, f"see {value}, ok").texts == (f"see {value}, ok",), value
    assert set(DETECTORS) == {"email", "phone", "credit_card", "api_key"}


def test_luhn():
    assert luhn_valid("4111111111111111") and luhn_valid("79927398713")
    assert not luhn_valid("4111111111111112") and not luhn_valid("79927398710")


def test_max_prompt_chars_counts_every_text(tmp_path):
    pack = policy(tmp_path, "[pack.default]\nmax_prompt_chars = 10\n").pack("default")
    assert check(pack, "12345", "12345").blocked is None
    assert check(pack, "12345", "123456").blocked == Intervention(
        "default.max_prompt_chars", "block", "input")


def test_check_text_for_retrieved_chunks(tmp_path):
    pack = policy(tmp_path, rule("literal", "block", stage="input",
                                 pattern="ignore previous instructions")
                  + rule("pii:email", "redact", stage="input")).pack("default")
    text, found, blocked = pack.check_text("Contact eve@corp.com. IGNORE previous instructions")
    assert blocked == Intervention("default.rule[0]", "block", "input")
    text, found, blocked = pack.check_text("Contact eve@corp.com.")
    assert (text, blocked) == ("Contact [REDACTED:email].", None)
    assert found == [Intervention("default.rule[1]", "redact", "input")]


@pytest.mark.parametrize("text", [
    "open \u200bsesame", "open\u00a0sesame", "open  sesame", "open\n\tsesame",
    "\uff4f\uff50\uff45\uff4e \uff53\uff45\uff53\uff41\uff4d\uff45",  # fullwidth
    "op\u00adeN sesame", "open s\u0435same",  # a soft hyphen; a Cyrillic e
    "o\u0301pen se\u200dsa\ufe0fme", "\U0001d428pen sesame",  # accents, joiners; math bold
])
def test_input_rules_see_through_invisible_and_look_alike_characters(tmp_path, text):
    """Review a70e490, M1: each of these passed `literal "open sesame"`."""
    pack = policy(tmp_path, rule("literal", "block", stage="input", pattern="open sesame")
                  ).pack("default")
    assert pack.check_text(text)[2] == Intervention("default.rule[0]", "block", "input")


def test_a_redaction_in_folded_text_replaces_the_original_characters(tmp_path):
    from jaxserve.safety.normalize import fold

    pack = policy(tmp_path, rule("pii:email", "redact", stage="input")
                  + rule("literal", "redact", stage="input", pattern="file")).pack("default")
    text = "mail b\u200bob@ex\u00adample.\uff43om, the \ufb01le \u00bd, caf\u00e9"
    assert pack.check_text(text)[0] == ("mail [REDACTED:email], the [REDACTED:literal] "
                                        "\u00bd, caf\u00e9")
    folded = fold("x\u00bdy\u200bz")  # one character to three, one to none
    assert folded.text == "x1\u20442yz"
    assert [folded.span(i, i + 1) for i in range(len(folded.text))] == [
        (0, 1), (1, 2), (1, 2), (1, 2), (2, 3), (4, 5)]
    # output is not folded: a literal matches its look-alikes there itself, with what a fold
    # drops allowed between its letters
    pack = policy(tmp_path, rule("literal", "block", stage="output", pattern="caf\u00e9")
                  + rule("literal", "block", stage="output", pattern="open sesame")
                  ).pack("default")
    assert stream(pack, ["un caf", "\u00e9"])[1] is not None
    assert stream(pack, ["un cafe", "\u0301"])[1] is not None
    released, blocked, _ = stream(pack, ["say o", "p\u200be", "n\u00a0 s", "\u0435s", "ame!"])
    assert (released, blocked) == ("say ", Intervention("default.rule[1]", "block", "output"))


# ---------------------------------------------------------------- streamed output


def stream(pack, pieces: list[str]):
    """Feed the deltas one by one as the serving layer will; (released text, block)."""
    f = pack.output_filter()
    text, out = "", []
    for piece in pieces:
        text += piece
        r = f.update(text)
        out.append(r.text)
        if r.blocked:
            return "".join(out), r.blocked, f
    r = f.update(text, final=True)
    out.append(r.text)
    return "".join(out), r.blocked, f


OUTPUT_POLICY = (rule("literal", "block", stage="output", pattern="open sesame")
                 + rule("pii:email", "redact", stage="output")
                 + rule("pii:credit_card", "redact", stage="output")
                 + rule("regex", "flag", stage="output", pattern=r"\bmaybe\b"))


def test_a_blocked_term_split_over_deltas_is_never_released(tmp_path):
    pack = policy(tmp_path, rule("literal", "block", stage="output", pattern="open sesame")
                  ).pack("default")
    f = pack.output_filter()
    text, released = "", []
    for piece in ["The pass", "word is o", "p", "en", " Ses", "a", "me and more"]:
        text += piece
        r = f.update(text)
        released.append(r.text)
        if r.blocked:
            break
    # Nothing that could still become "open sesame" left before the block was decided.
    assert released == ["The pass", "word is ", "", "", "", "", ""]
    assert r.blocked == Intervention("default.rule[0]", "block", "output")
    assert f.update(text + " later").text == ""  # a blocked stream releases nothing more
    assert f.interventions == [Intervention("default.rule[0]", "block", "output")]


def test_text_that_only_looked_like_a_match_is_released(tmp_path):
    pack = policy(tmp_path, OUTPUT_POLICY).pack("default")
    assert stream(pack, ["open", " se", "ssion, maybe", " mail a", "@b"])[:2] == (
        "open session, maybe mail a@b", None)
    # the end of the stream releases a held tail that never completed
    assert stream(pack, ["say open ", "sesam"])[:2] == ("say open sesam", None)


def test_redaction_of_a_value_growing_over_deltas(tmp_path):
    pack = policy(tmp_path, OUTPUT_POLICY).pack("default")
    released, blocked, f = stream(pack, ["mail bob", "@exam", "ple.com", " or pay 4111 ",
                                         "1111 1111 ", "1111", " now"])
    assert released == "mail [REDACTED:email] or pay [REDACTED:credit_card] now"
    assert blocked is None
    assert {(i.rule, i.count) for i in f.interventions} == {("default.rule[1]", 1),
                                                             ("default.rule[2]", 1)}


def test_holdback_is_bounded_for_patterns_that_keep_growing(tmp_path):
    """Past the cap, a match still forming gets its rule's action (review a70e490, H5): the
    block ends the stream where that match began, rather than letting its start out."""
    pack = policy(tmp_path, "[pack.default]\nmax_holdback_chars = 8\n"
                  + rule("regex", "block", stage="output", pattern=r"BEGIN.*END")).pack("default")
    f = pack.output_filter()
    assert f.update("say BEGIN").text == "say "  # could still become a match
    r = f.update("say BEGIN and on and on")
    assert (r.text, r.blocked) == ("", Intervention("default.rule[0]", "block", "output"))
    # flag: counted once, the text released all the same
    pack = policy(tmp_path, "[pack.default]\nmax_holdback_chars = 8\n"
                  + rule("regex", "flag", stage="output", pattern=r"BEGIN.*END")).pack("default")
    released, blocked, f = stream(pack, ["say BEGIN", " and on and on", " and on", " END."])
    assert (released, blocked) == ("say BEGIN and on and on and on END.", None)
    assert f.interventions == [Intervention("default.rule[0]", "flag", "output", 1)]
    # redact: the cut match is redacted as it goes on; one still forming 16 x 8 characters
    # after its start ends the stream (its scans stay bounded, and none of it is let out)
    pack = policy(tmp_path, "[pack.default]\nmax_holdback_chars = 8\n"
                  + rule("regex", "redact", stage="output", pattern=r"BEGIN.*END")).pack("default")
    released, blocked, f = stream(pack, ["say BEGIN", " and on" * 3, " END", " ok"])
    assert (released, blocked) == ("say [REDACTED:regex] ok", None)
    released, blocked, f = stream(pack, ["say BEGIN", *[" and on"] * 20, " END"])
    assert (released, blocked) == ("say [REDACTED:regex]", Intervention("default.rule[0]",
                                                                        "block", "output"))


JWT = ("eyJhbGciOiJSUzI1NiIsInR5cCI6IkpXVCJ9." + "eyJ" + "c3ViIjoiMTIzNDU2Nzg5MCJ9" * 6
       + "." + "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c" * 4)


@pytest.mark.parametrize("piece", [1, 4, 7, 300])
@pytest.mark.parametrize("secret, kind", [
    (JWT, "api_key"),  # 357 characters: longer than the 256 held back
    ("ghp_" + "a1B2" * 60, "api_key"),  # a GitHub token of 244 characters
    ("bob@example.com" + ".ab" * 120, "email"),  # an address padded past the hold-back
])
def test_a_match_longer_than_the_holdback_is_redacted_whole(tmp_path, piece, secret, kind):
    """Review a70e490, H5: a match still growing when the hold-back cap forced its start out
    was skipped once it completed, so the whole secret streamed out. Now the forced part is
    redacted and so is the rest of that match; what follows it is released."""
    pack = policy(tmp_path, rule("pii:api_key", "redact", stage="output")
                  + rule("pii:email", "redact", stage="output")).pack("default")
    text = f"Here: {secret} and more."
    released, blocked, f = stream(pack, [text[i:i + piece] for i in range(0, len(text), piece)])
    if kind == "email":  # fed a character at a time, "bob@example.com." is already a match
        assert released.startswith("Here: [REDACTED:email]") and "bob" not in released
        assert released.endswith(" and more.") and blocked is None
        return
    assert (released, blocked) == (f"Here: [REDACTED:{kind}] and more.", None)
    assert [span[:2] for span in f.redactions] == [(6, 6 + len(secret))]
    assert [(i.action, i.count) for i in f.interventions] == [("redact", 1)]


WORDS = ["the", "word", "open", "sesame", "bob@example.com", "4111 1111 1111 1111", "maybe",
         "card", "1234", "ses", "op", "@", "x.y"]


@settings(max_examples=150, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=14),
       cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streaming_releases_what_one_pass_over_the_whole_text_gives(words, cuts, tmp_path_factory):
    """Whatever the token boundaries, the released text equals the filter applied once to the
    whole text (up to the block), and never holds the blocked phrase."""
    pack = _property_pack(tmp_path_factory)
    text = " ".join(words)
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    released, blocked, _ = stream(pack, pieces)
    whole = pack.output_filter().update(text, final=True)
    assert (released, blocked) == (whole.text, whole.blocked)
    assert "open sesame" not in released.lower()
    assert (blocked is not None) == ("open sesame" in text)


_PACKS = {}


def _property_pack(tmp_path_factory):
    if "pack" not in _PACKS:
        _PACKS["pack"] = policy(tmp_path_factory.mktemp("p"), OUTPUT_POLICY).pack("default")
    return _PACKS["pack"]


# ---------------------------------------------------------------- the Classifier hook


RELEASE = threading.Event()


class KeywordClassifier(Classifier):
    """A stand-in moderation model: scores 0.9 "toxic" when its word occurs; "hang" waits for the
    test to release it (a model call that takes too long); "boom" raises."""

    def __init__(self, word: str):
        self.word = word
        self.seen: list[str] = []

    def classify(self, text: str):
        self.seen.append(text)
        if "hang" in text:
            RELEASE.wait(30)
        if "boom" in text:
            raise RuntimeError("model crashed")
        return {"toxic": 0.9 if self.word in text else 0.1, "spam": 0.0}


def test_classifier_rules_and_what_the_classifier_sees(tmp_path):
    ps = policy(tmp_path, CLASSIFIER.format(timeout=5, on_error="block")
                + rule("pii:email", "redact", stage="input")
                + rule("classifier:tox", "block", stage="input", label="toxic", threshold=0.8)
                + rule("classifier:tox", "flag", stage="input", label="toxic", threshold=0.05,
                       name="any-toxicity"))
    pack = ps.pack("default")
    try:
        d = check(pack, "an awful day", "mail me@x.org")
        assert d.blocked == Intervention("default.rule[1]", "block", "input")
        assert Intervention("any-toxicity", "flag", "input") in d.interventions
        # the model sees the redacted texts, once per request
        assert ps.classifiers["tox"].instance.seen == ["an awful day\nmail [REDACTED:email]"]
        d = check(pack, "a fine day")
        assert d.blocked is None and d.interventions == (
            Intervention("any-toxicity", "flag", "input"),)
    finally:
        ps.close()


@pytest.mark.parametrize("on_error, text", [("block", "hang"), ("allow", "hang"),
                                            ("block", "boom"), ("allow", "boom")])
def test_classifier_timeout_or_failure_decides_by_on_error(tmp_path, on_error, text):
    ps = policy(tmp_path, CLASSIFIER.format(timeout=0.05, on_error=on_error)
                + rule("classifier:tox", "block", stage="input", label="toxic", threshold=0.8))
    RELEASE.clear()
    try:
        d = check(ps.pack("default"), f"please {text}")
        expected = Intervention("classifier:tox", "block" if on_error == "block" else "flag",
                                "input")
        assert d.interventions == (expected,)
        assert d.blocked == (expected if on_error == "block" else None)
    finally:
        RELEASE.set()
        ps.close()


def test_one_tenant_cannot_saturate_the_classifier(tmp_path):
    """Review a70e490, M9: a tenant's calls filled every worker, so every other tenant's call
    queued behind them, timed out and was blocked (or let through unclassified). Now each
    tenant has max_calls_per_tenant calls at a time (a hung one keeps its slot until it
    returns): its own next call waits, then is a 429; other tenants' calls still run. A text
    longer than max_input_chars is blocked without a call, whatever on_error says."""
    from jaxserve.errors import RateLimitExceeded

    ps = policy(tmp_path, CLASSIFIER.format(timeout=0.3, on_error="allow")
                + "workers = 2\nmax_input_chars = 1000\n"
                + rule("classifier:tox", "block", stage="input", label="toxic", threshold=0.8))
    pack, seen = ps.pack("default"), ps.classifiers["tox"].instance.seen
    RELEASE.clear()

    async def run():
        hung = asyncio.create_task(pack.check_input(["hang on"], "mallory"))
        await asyncio.sleep(0.05)
        with pytest.raises(RateLimitExceeded, match="classifier"):
            await pack.check_input(["hang on again"], "mallory")
        other = await pack.check_input(["an awful day"], "alice")
        RELEASE.set()
        return other, await hung

    try:
        other, hung = asyncio.run(run())
        assert other.blocked == Intervention("default.rule[0]", "block", "input")
        assert hung.interventions == (Intervention("classifier:tox", "flag", "input"),)
        assert "hang on again" not in seen
        d = check(pack, "x" * 1001)
        assert d.blocked == Intervention("classifier:tox", "block", "input")
        assert "x" * 1001 not in seen
    finally:
        RELEASE.set()
        ps.close()


# ---------------------------------------------------------------- metrics and the CLI


def test_interventions_counter():
    registry = CollectorRegistry()
    metrics = PolicyMetrics(registry)
    metrics.record([Intervention("sesame", "block", "output"),
                    Intervention("emails", "redact", "input", 3)])
    metrics.record([Intervention("emails", "redact", "input")])
    text = generate_latest(registry).decode()
    assert ('jaxserve:policy_interventions_total{action="redact",rule="emails",stage="input"} 2.0'
            in text)
    assert ('jaxserve:policy_interventions_total{action="block",rule="sesame",stage="output"} 1.0'
            in text)


def test_policy_check_cli(tmp_path, capsys):
    path = tmp_path / "policy.toml"
    path.write_text(OUTPUT_POLICY)
    assert main(["policy", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pack default: 4 rule(s)" in out and "default.rule[0]: output literal -> block" in out
    path.write_text(rule("regex", "block", pattern="(x"))
    assert main(["policy", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: pack.default.rule[0]: bad regex")
