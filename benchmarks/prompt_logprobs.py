"""What scoring a prompt costs: a request with `prompt_logprobs` against the same request without.

One SmolLM2 engine (float32, prefix caching off so both kinds compute the whole prompt, chunked
prefill at --budget tokens a step). For each prompt length, alternating the two kinds, best of
`--repeats`: the wall time of `LLM.generate` of one prompt with max_tokens=1 (what lm-eval's
multiple-choice scoring sends), plain and with prompt_logprobs=1 (every step of the prompt also
runs the score program: the LM head over the step's rows, log-softmax and top-k on the device).
Also the score programs' compile seconds at warmup (one per token bucket), beside the forwards'.

    python benchmarks/prompt_logprobs.py [--lengths 64 256 1024] [--budget 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jaxserve import LLM, SamplingParams

SMOLLM2 = "smollm2-135m-instruct"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(SMOLLM2, dtype="float32", max_num_seqs=8, max_num_batched_tokens=args.budget,
              max_model_len=max(args.lengths) + 16, enable_prefix_caching=False,
              strict_compile=True, progress=False)
    compile_s = {"forward": {}, "score": {}}
    for key, secs in llm.engine.runner.program_compile_seconds.items():
        if key[0] in compile_s:
            compile_s[key[0]][key[1]] = round(secs, 2)
    rng = np.random.default_rng(0)
    vocab = llm.engine.config.model.vocab_size
    rows = []
    for n in args.lengths:
        prompt = {"prompt_token_ids": rng.integers(100, vocab, n).tolist()}
        best = {"plain": float("inf"), "scored": float("inf")}
        for _ in range(args.repeats):
            for kind, params in (("plain", SamplingParams(max_tokens=1, temperature=0)),
                                 ("scored", SamplingParams(max_tokens=1, temperature=0,
                                                           prompt_logprobs=1))):
                started = time.perf_counter()
                out = llm.generate([prompt], params)[0]
                best[kind] = min(best[kind], time.perf_counter() - started)
                assert (out.prompt_logprobs is not None) == (kind == "scored")
        rows.append({"prompt_tokens": n, "plain_ms": round(best["plain"] * 1e3, 1),
                     "scored_ms": round(best["scored"] * 1e3, 1),
                     "ratio": round(best["scored"] / best["plain"], 3)})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"budget": args.budget, "compile_seconds": compile_s, "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
