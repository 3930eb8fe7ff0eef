"""`jaxserve fetch | convert | generate | serve | batch | manifest | index | search | audit |
policy | kernels | eval | slo | capacity`.

Every error a user can cause surfaces as a JaxServeError and is printed as one line on stderr with
exit code 1 — never a traceback. Progress goes to stderr so stdout carries only the result (with
--json, its last line is one JSON object).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from jaxserve.audit.cli import add_audit_command
from jaxserve.disagg.router import add_router_arguments
from jaxserve.entrypoints.batch import add_batch_arguments
from jaxserve.entrypoints.capacity import add_capacity_command
from jaxserve.engine_settings import DTYPES
from jaxserve.entrypoints.engine_flags import add_engine_arguments, add_engine_flags
from jaxserve.entrypoints.kernels import add_kernels_command, configure_cpu_kernels
from jaxserve.errors import ContextLengthExceeded, InvalidRequest, JaxServeError
from jaxserve.evals.cli import add_eval_command
from jaxserve.model_registry import ModelSpec
from jaxserve.safety.cli import add_policy_command
from jaxserve.telemetry.slo.cli import add_slo_command
from jaxserve.entrypoints.launcher import add_serve_arguments
from jaxserve.tokenizer import tokenizer_source


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- fetch


def cmd_fetch(args) -> int:
    from jaxserve.model_registry import fetch

    print(fetch(args.name))
    return 0


# ---------------------------------------------------------------- convert


def _timed_load(spec: ModelSpec, dtype: str | None):
    import jax

    from jaxserve.weights import load_model

    t0 = time.perf_counter()
    # Dequantized ("none"): a checkpoint serves on any device or mesh, not only the CPU kernels.
    config, params = load_model(spec, dtype, quantization="none")
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
    """The prompt's token ids, unchecked: LLM.generate prepares them as it does any prompt."""
    if args.prompt_token_ids is not None:
        return parse_token_ids(args.prompt_token_ids)
    if not args.chat:
        return tokenizer.encode(args.prompt)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                             add_generation_prompt=True)
    # The rendered template holds its own special tokens: encode without adding BOS again.
    return (tokenizer.encode(rendered, add_special_tokens=False) if isinstance(rendered, str)
            else list(rendered))


def cmd_generate(args) -> int:
    from jaxserve.entrypoints.engine_flags import engine_args
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.core.sampling_params import SamplingParams

    check_args(args)
    t0 = time.perf_counter()
    # One prompt: compile each program when first needed instead of every bucket up front.
    llm = LLM(args.model, warmup=False, progress=False, **engine_args(args))
    _log(f"loaded {args.model} in {time.perf_counter() - t0:.2f} s")
    ids = prompt_ids(args, llm.get_tokenizer())
    max_len = llm.engine.max_model_len
    if len(ids) + args.max_tokens > max_len:
        raise ContextLengthExceeded(
            f"prompt ({len(ids)} tokens) + max_tokens ({args.max_tokens}) exceed the context of "
            f"{max_len} tokens (--max-model-len)", param="max_tokens")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    _log(f"generated {len(out.token_ids)} tokens in {time.perf_counter() - t0:.2f} s "
         f"(incl. compile)")
    if args.json:
        print(json.dumps({"model": args.model, "prompt_token_ids": ids,
                          "token_ids": out.token_ids, "text": out.text,
                          "finish_reason": out.finish_reason}))
    else:
        print(out.text)
    return 0


def cmd_serve(args) -> int:
    from jaxserve.entrypoints.batch_lines import ServingLines
    from jaxserve.entrypoints.launcher import run

    return run(args, ServingLines)


def cmd_router(args) -> int:
    from jaxserve.disagg.router import run_router

    return asyncio.run(run_router(args))


def cmd_batch(args) -> int:
    from jaxserve.entrypoints.batch import run_batch

    return run_batch(args)


def cmd_manifest(args) -> int:
    from jaxserve.entrypoints.engine_flags import engine_args
    from jaxserve.fleet.deployment import VersionSpec
    from jaxserve.fleet.manifest import manifest_of

    spec = VersionSpec.of("manifest", args.model, engine_args(args))
    print(json.dumps(manifest_of(spec).to_dict(), indent=2))
    return 0


# ---------------------------------------------------------------- index, search (RAG)


def _rag_service(args):
    from jaxserve.rag.config import RagConfig, default_data_dir
    from jaxserve.rag.service import RagService

    return RagService(RagConfig(args.data_dir or default_data_dir()))


def cmd_index(args) -> int:
    from jaxserve.gateway.tenants import check_name
    from jaxserve.rag.ingest import index_paths

    if args.tenant is not None:
        check_name(args.tenant, "--tenant")
    service = _rag_service(args)
    try:
        docs, chunks = index_paths(service, args.collection, args.paths,
                                   progress=not args.no_progress, tenant=args.tenant)
    finally:
        service.close()
    print(f"indexed {docs} documents ({chunks} chunks) into {args.collection} "
          f"at {service.config.data_dir}")
    return 0


def cmd_search(args) -> int:
    service = _rag_service(args)
    try:
        results = service.search(args.collection, args.query, args.top_k, args.mode,
                                 args.rerank)
    finally:
        service.close()
    if args.json:
        print(json.dumps({"results": [r.to_dict() for r in results]}))
    for r in [] if args.json else results:
        print(f"{r.score:.4f}  {r.chunk_id}\n    {' '.join(r.text.split())[:200]}")
    return 0


def _add_rag_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collection", required=True)
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where collections live (default: $JAXSERVE_CACHE/rag, else "
                             "~/.cache/jaxserve/rag)")


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
    c.add_argument("--dtype", choices=DTYPES, default=None)
    c.set_defaults(func=cmd_convert)

    g = sub.add_parser("generate", help="generate from one prompt")
    add_engine_arguments(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-token-ids", help="comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--chat", action="store_true",
                   help="render --prompt as one user message through the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (token_ids, text, ...) as the last stdout line")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (and gRPC with --grpc-port)")
    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)

    r = sub.add_parser("router", help="load-aware proxy in front of `serve --role decode` "
                                      "servers (docs/disaggregation.md)")
    add_router_arguments(r)
    r.set_defaults(func=cmd_router)

    b = sub.add_parser("batch", help="answer an OpenAI Batch API .jsonl file offline")
    add_batch_arguments(b)
    b.set_defaults(func=cmd_batch)

    m = sub.add_parser("manifest", help="print a model version's content-addressed manifest "
                                        "(weight and tokenizer sha256, settings, price) as JSON")
    m.add_argument("model", help="registered model name or path, as --model takes")
    add_engine_flags(m)
    m.set_defaults(func=cmd_manifest)

    ix = sub.add_parser("index", help="chunk, embed and index files into a RAG collection")
    _add_rag_arguments(ix)
    ix.add_argument("paths", nargs="+", type=Path,
                    help="text/markdown files (one document each), .jsonl files ({id, text, "
                         "metadata?} per line) or directories of them")
    ix.add_argument("--no-progress", action="store_true")
    ix.add_argument("--tenant", default=None, metavar="NAME",
                    help="the tenant (of serve --tenants) a new collection belongs to; another "
                         "tenant's collection of that name is an error (default: the open "
                         "server's tenant 'default')")
    ix.set_defaults(func=cmd_index)

    se = sub.add_parser("search", help="search a RAG collection")
    _add_rag_arguments(se)
    se.add_argument("query")
    se.add_argument("--mode", choices=("dense", "bm25", "hybrid"), default="hybrid")
    se.add_argument("--rerank", action="store_true",
                    help="rerank the best documents by late interaction (slower, often better)")
    se.add_argument("--top-k", type=int, default=5)
    se.add_argument("--json", action="store_true", help="print {\"results\": [...]} as JSON")
    se.set_defaults(func=cmd_search)

    add_audit_command(sub)
    add_policy_command(sub)
    add_slo_command(sub)
    add_kernels_command(sub)
    add_eval_command(sub, _eval_in_process)
    add_capacity_command(sub)
    return p


def _eval_in_process():
    """`jaxserve eval run`'s in-process versions (the fleet and its engines: imported on use)."""
    from jaxserve.entrypoints.eval_versions import InProcessVersions

    return InProcessVersions(progress=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "compile_cache_dir"):  # every command that builds an engine
            from jaxserve.entrypoints.engine_flags import configure_compile_cache

            configure_compile_cache(args)
        if hasattr(args, "cpu_kernels"):  # the same commands: the CPU kernels' switch
            configure_cpu_kernels(args)
        return args.func(args)
    except JaxServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
