"""Write tests/fixtures/prompt_logprobs_smollm2.json: HF transformers' prompt log-probabilities on
SmolLM2 (the suite's real weights, float32), the reference of tests/test_prompt_logprobs.py and
tests/test_lm_eval.py.

Run with a venv that has torch and transformers (not the suite's):

    /work/.venv-bench/bin/python tools/make_prompt_logprobs_fixture.py

What it records:
- `prompts`: token ids (the golden chat prompts, and a longer text that chunked prefill splits
  across several steps) with, per position i >= 1, log p(ids[i] | ids[:i]) and the argmax of that
  distribution;
- `lm_eval`: for the local tasks under tests/fixtures/lm_eval, each (question, choice) pair
  tokenized as lm-eval's `_encode_pair` does (a context's trailing spaces move to the
  continuation; whole and context encoded without special tokens; the continuation is the whole's
  tokens after the context's), with the summed continuation log-likelihood and whether every
  continuation token is the argmax; and the generation task's greedy continuation up to "\\n".
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(os.environ.get("JAXSERVE_GOLDEN_DIR") or ROOT.parent / "shared" / "golden")
TASKS = ROOT / "tests" / "fixtures" / "lm_eval"
LONG_TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
             "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted "
             "from those used to make wine. Within fifty years, presses in more than two hundred "
             "cities had printed millions of books, and the price of a book fell so far that "
             "ordinary merchants could own a small library of their own.")
MAX_NEW_TOKENS = 8  # the generation task's max_gen_toks


def scores(model, ids: list[int]) -> tuple[list[float], list[int]]:
    """log p(ids[i] | ids[:i]) and the argmax at i - 1, for i >= 1."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return ([float(lp[i - 1, ids[i]]) for i in range(1, len(ids))],
            [int(lp[i - 1].argmax()) for i in range(1, len(ids))])


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path,
                    default=ROOT / "tests" / "fixtures" / "prompt_logprobs_smollm2.json")
    args = ap.parse_args()
    from jaxserve.model_registry import resolve

    path = resolve("smollm2-135m-instruct").path
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    golden = json.loads((GOLDEN / "smollm2_golden.json").read_text())
    prompts = [c["input_ids"] for c in golden["cases"]]
    prompts.append(tok.encode(LONG_TEXT, add_special_tokens=False))
    out = {"model": golden["model"],
           "reference": f"HF transformers {__import__('transformers').__version__} GGUF loader, "
                        f"torch {torch.__version__} CPU, float32 (log-softmax in float64)",
           "prompts": []}
    for ids in prompts:
        lps, argmax = scores(model, ids)
        out["prompts"].append({"input_ids": ids, "logprobs": lps, "argmax": argmax})

    mc = []
    for doc in map(json.loads, (TASKS / "mc.jsonl").read_text().splitlines()):
        context = f"Question: {doc['question']}\nAnswer:"
        choices = []
        for choice in doc["choices"]:
            ctx, cont = encode_pair(tok, context, " " + choice)
            lps, argmax = scores(model, ctx + cont)
            tail = lps[len(ctx) - 1:]
            choices.append({"context_ids": ctx, "continuation_ids": cont,
                            "loglikelihood": sum(tail),
                            "is_greedy": argmax[len(ctx) - 1:] == cont})
        mc.append(choices)
    gen = []
    for doc in map(json.loads, (TASKS / "gen.jsonl").read_text().splitlines()):
        ids = tok.encode(doc["prompt"], add_special_tokens=False)
        with torch.inference_mode():
            new = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False)[0, len(ids):].tolist()
        gen.append({"prompt_ids": ids, "greedy_ids": new,
                    "text": tok.decode(new, skip_special_tokens=True).split("\n")[0]})
    out["lm_eval"] = {"jaxserve_mc": mc, "jaxserve_gen": gen}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
