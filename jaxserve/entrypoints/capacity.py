"""`jaxserve capacity measure` (one replica's prefill and decode rates on this machine, as JSON) and
`jaxserve capacity plan` (the replicas a workload needs: jaxserve.telemetry.capacity).

The measure runs the engine's own step loop offline, on the engine flags serve would take:
prefill is full-budget steps of long prompts that each generate one token (prompt tokens per
second of the whole run); decode is a full batch of short prompts generating `--decode-tokens`
each, timed from the step where every sequence has its first token to the last one (generated
tokens per second of that span).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from jaxserve.entrypoints.engine_flags import add_engine_arguments
from jaxserve.errors import ConfigError


def add_capacity_command(sub) -> None:
    p = sub.add_parser("capacity", help="replicas a workload needs, from this engine's measured "
                                        "prefill and decode rates")
    actions = p.add_subparsers(dest="capacity_action", required=True)
    m = actions.add_parser("measure", help="measure one replica's prefill and decode tokens/s "
                                           "and write them as JSON (for `capacity plan` and "
                                           "`serve --capacity-rates`)")
    add_engine_arguments(m)
    m.add_argument("--output", "-o", type=Path, default=None, metavar="FILE",
                   help="write the rates here (default: stdout)")
    m.add_argument("--decode-tokens", type=int, default=64, metavar="N",
                   help="tokens each sequence of the decode batch generates (default 64)")
    m.set_defaults(func=cmd_measure)

    a = actions.add_parser("plan", help="print the replicas a workload needs: the prefill and "
                                        "decode limits, the binding one, and the zone redundancy")
    a.add_argument("--rates", type=Path, required=True, metavar="FILE",
                   help="a rates file (`jaxserve capacity measure`)")
    a.add_argument("--rps", type=float, required=True, help="requests per second to serve")
    source = a.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", type=Path, metavar="FILE",
                        help="JSONL of requests, each with prompt_tokens and completion_tokens "
                             "(or input_tokens / output_tokens; the access log's lines do)")
    source.add_argument("--prompt-tokens", type=float, metavar="MEAN",
                        help="mean prompt tokens per request (with --output-tokens)")
    a.add_argument("--output-tokens", type=float, metavar="MEAN",
                   help="mean output tokens per request (with --prompt-tokens)")
    a.add_argument("--headroom", type=float, default=0.2,
                   help="share of each replica kept free for bursts (default 0.2)")
    a.add_argument("--zones", type=int, default=1,
                   help="zones the replicas spread over; losing one leaves enough (default 1: "
                        "no zone redundancy)")
    a.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    a.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from jaxserve.telemetry.capacity import (Workload, check_headroom, check_zones, plan,
                                             read_rates, read_workload)

    check_headroom(args.headroom)  # the flags before the files
    check_zones(args.zones)
    rates = read_rates(args.rates)
    if args.workload is not None:
        if args.output_tokens is not None:
            raise ConfigError("--output-tokens goes with --prompt-tokens, not --workload")
        try:
            with open(args.workload) as f:
                workload = read_workload(f, args.rps, str(args.workload))
        except OSError as e:
            raise ConfigError(f"{args.workload}: {e.strerror}") from None
    else:
        if args.output_tokens is None:
            raise ConfigError("--prompt-tokens needs --output-tokens")
        workload = Workload(args.rps, args.prompt_tokens, args.output_tokens)
    p = plan(rates, workload, args.headroom, args.zones)
    result = {"rps": workload.rps, "prompt_tokens": workload.prompt_tokens,
              "output_tokens": workload.output_tokens, "requests": workload.requests,
              "prefill_tokens_per_s": rates.prefill_tokens_per_s,
              "decode_tokens_per_s": rates.decode_tokens_per_s, "headroom": args.headroom,
              "prefill_replicas": p.prefill_replicas, "decode_replicas": p.decode_replicas,
              "binding": p.binding, "no_overlap_replicas": p.prefill_replicas + p.decode_replicas,
              "zones": p.zones, "zone_factor": p.zone_factor, "desired": p.desired,
              "per_zone": p.per_zone, "replicas": p.replicas}
    if args.json:
        print(json.dumps(result))
        return 0
    pct = f"{args.headroom:.0%}"
    print(f"workload: {workload.rps:g} req/s x {workload.prompt_tokens:.1f} prompt + "
          f"{workload.output_tokens:.1f} output tokens"
          + (f" (means of {workload.requests} requests)" if workload.requests else ""))
    print(f"one replica: prefill {rates.prefill_tokens_per_s:.1f} tok/s, decode "
          f"{rates.decode_tokens_per_s:.1f} tok/s; headroom {pct}")
    print(f"prefill limit: {p.prefill_replicas:.2f} replicas "
          f"({workload.rps * workload.prompt_tokens:.1f} tok/s)")
    print(f"decode limit:  {p.decode_replicas:.2f} replicas "
          f"({workload.rps * workload.output_tokens:.1f} tok/s)")
    print(f"binding: {p.binding} ({p.need:.2f}; both with no overlap at all: "
          f"{p.prefill_replicas + p.decode_replicas:.2f})")
    if p.zones > 1:
        print(f"zones: {p.zones}, x z/(z-1) = {p.zone_factor:.3f} -> {p.desired:.2f}; "
              f"{p.per_zone} per zone")
    else:
        print("zones: 1 (no zone redundancy)")
    print(f"replicas: {p.replicas}")
    return 0


def _run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
    """Generate from every prompt at once: (seconds in all, seconds from the step where every
    sequence has a token to the end, tokens generated in that span)."""
    from jaxserve.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"capacity-{time.monotonic_ns()}-{i}", ids, params)
    started = time.perf_counter()
    decoding_since, tokens_then, produced = None, 0, {}
    while engine.has_unfinished():
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
        if decoding_since is None and len(produced) == len(prompts) and all(produced.values()):
            decoding_since, tokens_then = time.perf_counter(), sum(produced.values())
    ended = time.perf_counter()
    return ended - started, ended - (decoding_since or ended), sum(produced.values()) - tokens_then


def measure(engine, decode_tokens: int) -> dict:
    """One replica's rates (module doc), after one warm-up round of each."""
    if decode_tokens < 8:
        raise ConfigError("--decode-tokens must be at least 8")
    config = engine.config.scheduler
    budget, seqs, max_len = config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len
    prompt_len = max(1, min(max_len - 1, budget))  # one full-budget chunk per prompt
    vocab = engine.config.model.vocab_size
    long = [[(7 * i + j) % (vocab - 1) + 1 for j in range(prompt_len)] for i in range(8)]
    short_len = max(1, min(16, max_len - decode_tokens))
    short = [[(3 * i + j) % (vocab - 1) + 1 for j in range(short_len)] for i in range(seqs)]
    if short_len + decode_tokens > max_len:
        raise ConfigError(f"--decode-tokens {decode_tokens} does not fit --max-model-len "
                          f"{max_len}")
    _run(engine, long[:1], 1)  # warm-up: the first steps of each kind pay once-only costs
    _run(engine, short, 8)
    engine.scheduler.cache.forget_contents()  # no prefix hits in what is measured
    prefill_s, _, _ = _run(engine, long, 1)
    engine.scheduler.cache.forget_contents()
    _, decode_s, decoded = _run(engine, short, decode_tokens)
    return {"prefill_tokens_per_s": len(long) * prompt_len / prefill_s,
            "decode_tokens_per_s": decoded / decode_s if decode_s > 0 else 0.0,
            "prefill_prompt_tokens": prompt_len, "decode_batch": seqs,
            "decode_tokens": decode_tokens, "max_num_batched_tokens": budget}


def cmd_measure(args: argparse.Namespace) -> int:
    from jaxserve.core.engine_factory import build_engine
    from jaxserve.entrypoints.engine_flags import engine_args

    engine = build_engine(args.model, progress=False, **engine_args(args))
    try:
        rates = {"model": args.model, **measure(engine, args.decode_tokens),
                 "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    finally:
        engine.close()
    text = json.dumps(rates, indent=1) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0
