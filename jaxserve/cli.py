"""`jaxserve fetch | convert | generate`.

Every error a user can cause surfaces as a JaxServeError and is printed as one line on stderr with
exit code 1 — never a traceback. Progress goes to stderr so stdout carries only the result (with
--json, its last line is one JSON object).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

from jaxserve.errors import ContextLengthExceeded, InvalidRequest, JaxServeError, ModelNotFound
from jaxserve.model_registry import ModelSpec


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- fetch


def cmd_fetch(args) -> int:
    from jaxserve.model_registry import fetch

    print(fetch(args.name))
    return 0


# ---------------------------------------------------------------- convert


def tokenizer_source(spec: ModelSpec) -> str | None:
    """Where the tokenizer of a model lives: the GGUF itself, an HF tokenizer.json, or what an
    orbax checkpoint recorded about the model it was converted from."""
    if spec.format == "gguf":
        return str(spec.path.resolve())
    if spec.format == "hf":
        path = spec.path / "tokenizer.json"
        return str(path.resolve()) if path.exists() else None
    from jaxserve.weights.checkpoint import read_meta

    return read_meta(spec.path).get("tokenizer_source")


def _timed_load(spec: ModelSpec, dtype: str | None):
    import jax

    from jaxserve.weights import load_model

    t0 = time.perf_counter()
    config, params = load_model(spec, dtype)
    jax.block_until_ready(params)
    return config, params, time.perf_counter() - t0


def cmd_convert(args) -> int:
    from jaxserve.model_registry import resolve
    from jaxserve.weights.checkpoint import save_checkpoint

    spec = resolve(args.src)
    if spec.format == "orbax":
        raise InvalidRequest(f"{spec.path} is already an orbax checkpoint")
    config, params, source_s = _timed_load(spec, args.dtype)
    _log(f"loaded {spec.format} {spec.path} in {source_s:.2f} s")
    dst = Path(args.dst)
    save_checkpoint(dst, config, params, tokenizer_source(spec))
    del params
    _, _, orbax_s = _timed_load(ModelSpec(spec.name, "orbax", dst.resolve()), None)
    print(f"wrote {dst}: loads in {orbax_s:.2f} s vs {source_s:.2f} s from {spec.format} "
          f"(speed-up {source_s / orbax_s:.1f}x)")
    return 0


# ---------------------------------------------------------------- generate


def load_tokenizer(spec: ModelSpec):
    from jaxserve.tokenizer import Tokenizer

    source = tokenizer_source(spec)
    if source is None:
        raise ModelNotFound(f"{spec.path}: no tokenizer found (expected tokenizer.json)")
    return Tokenizer.from_gguf(source) if source.endswith(".gguf") else Tokenizer.from_file(source)


def parse_token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise InvalidRequest(f"--prompt-token-ids must be comma-separated integers, got {text!r}",
                             param="prompt_token_ids") from None


def check_args(args) -> None:
    """What can be checked before loading anything, so a bad command fails in milliseconds."""
    if args.chat and args.prompt is None:
        raise InvalidRequest("--chat needs --prompt", param="chat")
    if args.prompt is not None and not args.prompt:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if args.prompt_token_ids is not None and not parse_token_ids(args.prompt_token_ids):
        raise InvalidRequest("the prompt is empty", param="prompt_token_ids")
    if args.max_tokens < 1:
        raise InvalidRequest(f"--max-tokens must be >= 1, got {args.max_tokens}",
                             param="max_tokens")
    if args.temperature < 0:
        raise InvalidRequest(f"--temperature must be >= 0, got {args.temperature}",
                             param="temperature")


def prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_token_ids is not None:
        return parse_token_ids(args.prompt_token_ids)
    if args.chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                 add_generation_prompt=True)
        # The rendered template holds its own special tokens: encode without adding BOS again.
        ids = (tokenizer.encode(rendered, add_special_tokens=False) if isinstance(rendered, str)
               else list(rendered))
    else:
        ids = tokenizer.encode(args.prompt)
    if not ids:
        raise InvalidRequest("the prompt encodes to no tokens", param="prompt")
    return ids


def check_prompt(ids: list[int], config, max_tokens: int) -> None:
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, "
                             f"{config.vocab_size})", param="prompt_token_ids")
    if len(ids) + max_tokens > config.max_position_embeddings:
        raise ContextLengthExceeded(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceed the model's context "
            f"of {config.max_position_embeddings}")


def _sample_step(params, config, kv_cache, batch, key, temperature):
    import jax
    import jax.numpy as jnp

    from jaxserve.models import llama

    hidden, kv_cache = llama.forward(params, config, kv_cache, batch)
    logits = llama.compute_logits(params, config, hidden[batch.logits_indices[:1]])[0]
    sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits)).astype(jnp.int32), kv_cache


@functools.cache
def _jitted_sample_step():
    import jax

    return jax.jit(_sample_step, static_argnums=1, donate_argnums=2)


def generate_ids(params, config, ids: list[int], *, max_tokens: int, temperature: float = 0.0,
                 seed: int = 0, stop_ids=(), page_size: int = 16) -> tuple[list[int], str]:
    """One sequence through forward() on a private page pool: (generated ids, finish reason).

    A stand-in until jaxserve.engine.LLM serves the CLI: one compiled program for the prompt's
    token bucket and one for single-token decode steps.
    """
    import jax
    import jax.numpy as jnp

    from jaxserve.batch import SeqChunk, make_plan, next_power_of_two
    from jaxserve.models import llama

    step = _jitted_sample_step()
    # Page counts rounded to powers of two so prompts of similar length share compiled programs.
    pages_per_seq = next_power_of_two(-(-(len(ids) + max_tokens) // page_size))
    table = list(range(1, pages_per_seq + 1))  # page 0 is the null page
    kv_cache = llama.init_kv_cache(config, pages_per_seq + 1, page_size)
    key = jax.random.key(seed)
    out: list[int] = []
    chunk = SeqChunk(ids, 0, table)
    while True:
        n = len(chunk.token_ids)
        plan = make_plan([chunk], num_tokens_padded=1 if n == 1 else max(16, next_power_of_two(n)),
                         num_seqs_padded=1, pages_per_seq=pages_per_seq, page_size=page_size)
        key, sub = jax.random.split(key)
        token, kv_cache = step(params, config, kv_cache, jax.tree.map(jnp.asarray, plan), sub,
                               jnp.float32(temperature))
        out.append(int(token))
        if out[-1] in stop_ids:
            return out, "stop"
        if len(out) == max_tokens:
            return out, "length"
        chunk = SeqChunk([out[-1]], len(ids) + len(out) - 1, table)


def cmd_generate(args) -> int:
    from jaxserve.model_registry import resolve

    check_args(args)
    spec = resolve(args.model)
    config, params, load_s = _timed_load(spec, args.dtype)
    _log(f"loaded {spec.name} ({spec.format}) in {load_s:.2f} s")
    tokenizer = load_tokenizer(spec)
    ids = prompt_ids(args, tokenizer)
    check_prompt(ids, config, args.max_tokens)
    stop_ids = set(config.eos_token_ids) | set(tokenizer.eos_token_ids)
    t0 = time.perf_counter()
    out, finish_reason = generate_ids(params, config, ids, max_tokens=args.max_tokens,
                                      temperature=args.temperature, seed=args.seed,
                                      stop_ids=stop_ids)
    gen_s = time.perf_counter() - t0
    text = tokenizer.decode(out)
    _log(f"generated {len(out)} tokens in {gen_s:.2f} s (incl. compile)")
    if args.json:
        print(json.dumps({"model": spec.name, "prompt_token_ids": ids, "token_ids": out,
                          "text": text, "finish_reason": finish_reason}))
    else:
        print(text)
    return 0


# ---------------------------------------------------------------- entry


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fetch", help="download a registered model into the model cache")
    f.add_argument("name")
    f.set_defaults(func=cmd_fetch)

    c = sub.add_parser("convert", help="write an orbax checkpoint that loads faster than SRC")
    c.add_argument("src", help="registered model name, .gguf file or HF directory")
    c.add_argument("dst", help="new directory for the checkpoint")
    c.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    c.set_defaults(func=cmd_convert)

    g = sub.add_parser("generate", help="generate from one prompt")
    g.add_argument("--model", required=True, help="registered name or path")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-token-ids", help="comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--chat", action="store_true",
                   help="render --prompt as one user message through the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (token_ids, text, ...) as the last stdout line")
    g.set_defaults(func=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except JaxServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
