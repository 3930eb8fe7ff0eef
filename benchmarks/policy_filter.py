"""What the streaming output filter (jaxserve.safety) costs per delta, at 32 streams.

32 streams of 128 tokens each (text cut from Python's documentation, `workload.pydoc_workload`),
detokenized incrementally as the engine does, one token per delta; a quarter of the streams carry
an e-mail address and a card number spread over several deltas, so redaction runs too. The
deltas go round-robin over the streams, as a serving loop sees them, through:

  baseline  what the serving layer already does per streamed delta: build the OpenAI chunk and
            encode it as one SSE event (json.dumps);
  filter    `TextFilter.update(text_so_far)` with each pack below, one filter per stream.

Prints microseconds per delta (best of --repeats), the ratio to the baseline, and the share of
one core the filter would take at --output-tok-s generated tokens per second (the serving
benchmark's rate; the goal is under 5% of output throughput). Run on a shared machine, read the
ratios, not the absolute times.

    python benchmarks/policy_filter.py [--output-tok-s 200]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import timeit
from pathlib import Path

from workload import pydoc_workload  # benchmarks/ is the script's directory

from jaxserve.model_registry import resolve
from jaxserve.safety import load_policy
from jaxserve.tokenizer import IncrementalDetokenizer, load_tokenizer

STREAMS, TOKENS = 32, 128
PII = " write to bob.smith@example.com or pay with 4111 1111 1111 1111 today "

def _rule(match: str, action: str, **fields) -> str:
    body = {"stage": "output", "match": match, "action": action, **fields}
    return "[[pack.p.rule]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in body.items())


LITERALS = (_rule("literal", "block", pattern="open sesame")
            + _rule("literal", "block", pattern="internal use only", whole_word=True))
PACKS = {
    "2 literals": LITERALS,
    "2 literals + 4 PII + 1 regex": LITERALS + "".join(
        _rule(f"pii:{kind}", "redact") for kind in ("email", "phone", "credit_card", "api_key"))
    + _rule("regex", "flag", pattern=r"(?i)\bproject [a-z]+ codename\b"),
}


def stream_texts(tokenizer) -> list[list[str]]:
    """Per stream, its whole text after each delta."""
    work = pydoc_workload(tokenizer, STREAMS, seed=0, prompt_tokens=(TOKENS, TOKENS),
                          output_tokens=(1, 1))
    streams = []
    for s, (ids, _) in enumerate(work):
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True, prompt_ids=[])
        deltas = []
        for t in ids:
            before = len(detok.text)
            detok.add(t)
            deltas.append(detok.text[before:])
        if s % 4 == 0:  # PII arriving 4 characters at a time, mid-stream
            deltas[64:64] = [PII[i:i + 4] for i in range(0, len(PII), 4)]
        text, texts = "", []
        for d in deltas:
            text += d
            texts.append(text)
        streams.append(texts)
    return streams


def baseline(streams: list[list[str]]) -> int:
    sent = 0
    for step in range(max(map(len, streams))):
        for s, texts in enumerate(streams):
            if step < len(texts):
                delta = texts[step][len(texts[step - 1]) if step else 0:]
                chunk = {"id": "cmpl-0", "object": "text_completion", "created": 0,
                         "model": "m", "choices": [{"index": s, "text": delta,
                                                    "logprobs": None, "finish_reason": None}]}
                sent += len(f"data: {json.dumps(chunk)}\n\n")
    return sent


def filtered(streams: list[list[str]], pack) -> int:
    filters = [pack.output_filter() for _ in streams]
    sent = 0
    for step in range(max(map(len, streams))):
        for f, texts in zip(filters, streams):
            if step < len(texts):
                sent += len(f.update(texts[step], final=step == len(texts) - 1).text)
    return sent


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--output-tok-s", type=float, default=200.0,
                    help="generated tokens per second to express the cost against")
    args = ap.parse_args()
    streams = stream_texts(load_tokenizer(resolve(args.model)))
    deltas = sum(map(len, streams))
    print(f"{cpu_name()}, {STREAMS} streams, {deltas} deltas")
    base = min(timeit.repeat(lambda: baseline(streams), number=1, repeat=args.repeats)) / deltas
    print(f"{'baseline: chunk + SSE encoding':40s} {base * 1e6:7.2f} us/delta")
    with tempfile.TemporaryDirectory() as d:
        for name, body in PACKS.items():
            path = Path(d) / "policy.toml"
            path.write_text(body)
            pack = load_policy(path).pack("p")
            cost = min(timeit.repeat(lambda: filtered(streams, pack), number=1,
                                     repeat=args.repeats)) / deltas
            print(f"{'filter, ' + name:40s} {cost * 1e6:7.2f} us/delta  {cost / base:5.2f}x "
                  f"baseline  {100 * cost * args.output_tok_s:5.2f}% of a core at "
                  f"{args.output_tok_s:g} tok/s")


if __name__ == "__main__":
    main()
