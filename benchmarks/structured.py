"""Structured outputs: throughput of N concurrent json_schema requests vs the same requests
unconstrained, same engine, same run (goal: constrained >= 0.9x unconstrained output tok/s).

    python benchmarks/structured.py [--num-requests 32] [--rounds 3]

Each round runs the N constrained requests (seeded sampling, a schema with nested objects,
arrays, enums and required fields), then the same prompts unconstrained with each request held
to the exact number of tokens its constrained twin produced (min_tokens = max_tokens = that
count, ignore_eos): both runs then generate the same tokens per request, in batches of the same
shape over time, so the ratio measures what the constraint costs (the host bitmask fill, the
bitmask step on the device, the matcher), not how long the outputs are. Prefix caching is off,
so neither run gains from prompts the other computed. A warm-up round first compiles the schema
(cached afterwards) and touches every program. Every constrained output that finished with
"stop" is checked against the schema.

Reported per round and as the median over rounds: the output tok/s ratio, and the ratio of the
process CPU time the two runs took (all threads: XLA's and llguidance's). On a CPU shared with
other jobs the wall-clock ratio swings with their load; the CPU-time ratio says what the
constraint costs in work. Also: the host time spent filling bitmasks.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

SMOLLM2 = "smollm2-135m-instruct"

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "sentiment": {"enum": ["positive", "negative", "mixed"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "reviewer": {"type": "object", "properties": {
            "name": {"type": "string"}, "verified": {"type": "boolean"}},
            "required": ["name", "verified"], "additionalProperties": False},
        "pros": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "cons": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["title", "sentiment", "rating", "reviewer", "pros", "cons"],
    "additionalProperties": False,
}
PRODUCTS = ["laptop", "coffee machine", "bicycle", "phone", "hotel", "novel", "headphones",
            "restaurant", "camera", "tent", "keyboard", "blender", "film", "car", "watch", "sofa"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    import jsonschema

    from jaxserve import LLM, SamplingParams
    from jaxserve.structured import StructuredOutputsParams

    llm = LLM(args.model, max_num_seqs=args.num_requests, max_num_batched_tokens=512,
              max_model_len=1024, enable_prefix_caching=False, progress=False)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content":
               f"Write a short review of a {PRODUCTS[i % len(PRODUCTS)]} as JSON."}])}
               for i in range(args.num_requests)]
    constraint = StructuredOutputsParams(json=SCHEMA)
    constrained = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens,
                                  structured_outputs=constraint)
                   for i in range(args.num_requests)]
    grammars = llm.engine.grammars
    fill = grammars.fill_bitmask
    fill_seconds = [0.0]

    def timed_fill(*a, **kw):
        t = time.perf_counter()
        fill(*a, **kw)
        fill_seconds[0] += time.perf_counter() - t

    grammars.fill_bitmask = timed_fill

    def run(params):
        fill_seconds[0] = 0.0
        t, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params)
        elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return outs, {"seconds": elapsed, "cpu_seconds": cpu, "output_tokens": tokens,
                      "output_tok_s": tokens / elapsed, "fill_seconds": fill_seconds[0]}

    llm.generate(prompts[:4], constrained[:4])  # compile the schema, touch every program
    rounds = []
    for r in range(args.rounds):
        outs, c = run(constrained)
        valid = 0
        for o in outs:
            if o.outputs[0].finish_reason == "stop":
                jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
                valid += 1
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        _, u = run([SamplingParams(temperature=0.8, seed=i, max_tokens=n, min_tokens=n,
                                   ignore_eos=True) for i, n in enumerate(lengths)])
        assert u["output_tokens"] == c["output_tokens"]
        ratio = c["output_tok_s"] / u["output_tok_s"]
        cpu_ratio = u["cpu_seconds"] / c["cpu_seconds"]
        rounds.append({"constrained": c, "unconstrained": u, "ratio": ratio,
                       "cpu_ratio": cpu_ratio, "valid": valid})
        print(f"round {r}: constrained {c['output_tok_s']:6.1f} tok/s ({c['output_tokens']} "
              f"tokens, {valid}/{len(outs)} finished and valid, bitmask fill "
              f"{c['fill_seconds']:.2f} s of {c['seconds']:.1f} s, CPU {c['cpu_seconds']:.1f} s) "
              f"| unconstrained {u['output_tok_s']:6.1f} tok/s (CPU {u['cpu_seconds']:.1f} s) "
              f"| ratio {ratio:.3f}, CPU-time ratio {cpu_ratio:.3f}", flush=True)
    median = {k: statistics.median(r[k] for r in rounds) for k in ("ratio", "cpu_ratio")}
    print(f"{args.num_requests} concurrent requests, {platform.machine()} "
          f"{platform.processor() or ''}".rstrip())
    print(f"median of {args.rounds} rounds: output tok/s ratio {median['ratio']:.3f}, CPU-time "
          f"ratio {median['cpu_ratio']:.3f} (goal >= 0.9)")
    print(json.dumps({"rounds": rounds, "median": median}))


if __name__ == "__main__":
    main()
