"""How much a prompt's scores depend on what else shares its steps, with and without --deterministic.

For each mode (default, deterministic), one engine (float32, --budget tokens a step, prefix caching
off in both so every prompt is computed whole): --prompts prompts of 2 to --max-len random tokens
are scored (prompt_logprobs=1, 4 greedy tokens with logprobs) one at a time, then all together.
Prints, per mode, the largest difference between the two runs on prompt tokens and on generated
tokens (nats; 0 = bit-identical), and the wall time of the batched run (deterministic pads every
step to a full one).

    python benchmarks/batch_invariance.py [--model smollm2-135m-instruct] [--budget 32]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jaxserve import LLM, SamplingParams


def scores(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[float], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1,
                                       prompt_logprobs=1))
    return [([e.logprob for e in o.prompt_logprobs[1:]],
             [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def spread(a, b) -> float:
    return max((abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)), default=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--budget", type=int, default=32, help="max_num_batched_tokens")
    ap.add_argument("--prompts", type=int, default=14)
    ap.add_argument("--max-len", type=int, default=100)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.linspace(2, args.max_len, args.prompts).astype(int)
    prompts = [rng.integers(1000, 9000, n).tolist() for n in lengths]
    results = {}
    for mode in ("default", "deterministic"):
        llm = LLM(args.model, dtype="float32", max_num_seqs=8,
                  max_num_batched_tokens=args.budget, max_model_len=args.max_len + 16,
                  enable_prefix_caching=False, deterministic=mode == "deterministic",
                  strict_compile=True, progress=False)
        alone = [scores(llm, [p])[0] for p in prompts]
        start = time.perf_counter()
        together = scores(llm, prompts)
        seconds = time.perf_counter() - start
        results[mode] = {
            "prompt_tokens_max_diff": spread([a[0] for a in alone], [t[0] for t in together]),
            "generated_tokens_max_diff": spread([a[1] for a in alone], [t[1] for t in together]),
            "batched_seconds": round(seconds, 3)}
        print(mode, json.dumps(results[mode]), flush=True)
        del llm
    print(json.dumps({"model": args.model, "budget": args.budget, "prompts": args.prompts,
                      "max_len": args.max_len, **results}))


if __name__ == "__main__":
    main()
