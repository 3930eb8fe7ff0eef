"""Offline batch inference over an OpenAI Batch API .jsonl file: `jaxserve batch`.

It runs on one model (--model) or on the versions and routes of a deployment file
(--deployment, as `serve` takes it). Every request is submitted to the engine up front so
continuous batching keeps it full. Each result is appended and flushed as one whole line the
moment it finishes, so an interrupted run (crash, Ctrl-C) leaves a valid file, and a rerun skips
requests already answered."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from jaxserve.audit import audit_log_config
from jaxserve.config import RequestLimits
from jaxserve.errors import (ConfigError, EngineDead, InvalidRequest, JaxServeError,
                             RateLimitExceeded, error_reply)
from jaxserve.entrypoints.serving.admission import CallContext
from jaxserve.entrypoints.serving.calls import Call
from jaxserve.entrypoints.serving.outcome import call_outcome
from jaxserve.gateway import Gateway, Principal, load_tenants
from jaxserve.entrypoints.serving.validation import load_json

URL_KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


class DuplicateCustomIds(ValueError):
    """The input names one custom_id more than once; results could not be matched to requests."""


@dataclass(frozen=True)
class BatchLine:
    """One input line: a runnable request (kind, body), or an error answered without running."""
    line: int  # 1-based line number in the input file
    custom_id: str | None
    kind: str | None = None
    body: Any = None
    error: InvalidRequest | None = None  # a malformed line: answered with it, never run
    url: str | None = None  # as the line gave it (a malformed line's audit route)

    @property
    def key(self) -> str:
        """What a rerun matches answered results by: custom_id, else the line number."""
        return f"id:{self.custom_id}" if self.custom_id is not None else f"line:{self.line}"


def parse_line(number: int, text: str, kinds: dict[str, str] = URL_KINDS) -> BatchLine:
    """Parse one input line; a malformed line becomes an error result, never an exception.
    A line is held to the server's limits on JSON (nesting, valid Unicode). `kinds`: the urls
    a line may name, with their kind (the Batch API takes more: entrypoints/batch_lines.py)."""
    try:
        obj = load_json(text, RequestLimits().max_json_depth)
    except InvalidRequest as e:
        return BatchLine(number, None, error=InvalidRequest(f"line {number}: {e}", e.param))
    if not isinstance(obj, dict):
        return BatchLine(number, None,
                         error=InvalidRequest(f"line {number} is not a JSON object"))
    custom_id = obj.get("custom_id")
    url = obj.get("url") if isinstance(obj.get("url"), str) else None
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(number, None, url=url,
                         error=InvalidRequest(
                             "'custom_id' is required and must be a non-empty string",
                             "custom_id"))
    if obj.get("method", "POST") != "POST":
        return BatchLine(number, custom_id, url=url,
                         error=InvalidRequest("'method' must be POST", "method"))
    kind = kinds.get(url)
    if kind is None:
        return BatchLine(number, custom_id, url=url, error=InvalidRequest(
            f"'url' must be one of {sorted(kinds)}, got {obj.get('url')!r}", "url"))
    body = obj.get("body")
    if not isinstance(body, dict):
        return BatchLine(number, custom_id, url=url,
                         error=InvalidRequest("'body' must be a JSON object", "body"))
    if body.get("stream"):
        return BatchLine(number, custom_id, url=url,
                         error=InvalidRequest("batch requests cannot stream; drop 'stream'",
                                              "stream"))
    return BatchLine(number, custom_id, kind, body)


def read_input(path: Path) -> list[BatchLine]:
    """All non-blank lines of the input; raises DuplicateCustomIds naming each repeated id."""
    lines = [parse_line(n, text) for n, text in
             enumerate(path.read_text(encoding="utf-8").splitlines(), start=1) if text.strip()]
    first: dict[str, int] = {}
    repeats = []
    for item in lines:
        if item.custom_id is None:
            continue
        if item.custom_id in first:
            repeats.append(f"{item.custom_id!r} (lines {first[item.custom_id]} and {item.line})")
        first.setdefault(item.custom_id, item.line)
    if repeats:
        raise DuplicateCustomIds("duplicate custom_id values; each request needs its own: "
                                 + ", ".join(repeats))
    return lines


def answered_keys(path: Path) -> set[str]:
    """Keys of the results already in `path`, after cutting off a torn last line.

    Only whole lines are ever flushed, but a killed process can leave a partial tail; it is
    removed so the appended results start on a line of their own."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    keys = set()
    for text in data[:end].decode("utf-8").splitlines():
        if not text.strip():
            continue
        result = json.loads(text)
        if result.get("custom_id") is not None:
            keys.add(f"id:{result['custom_id']}")
        else:
            keys.add(f"line:{result['line']}")
    return keys


def result_line(item: BatchLine, status: int, body: dict) -> dict:
    """One output line in the OpenAI Batch format; `line` lets id-less errors be resumed."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.custom_id, "line": item.line,
            "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}",
                         "body": body},
            "error": None}


class ResultWriter:
    """Appends one whole line per result and flushes it, so the file is always resumable."""

    def __init__(self, path: Path):
        self.file = path.open("a", encoding="utf-8")

    def write(self, result: dict) -> None:
        self.file.write(json.dumps(result, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


async def _answer(serving, item: BatchLine, ctx: CallContext) -> dict:
    """One request through the servers' admission path, as the tenant `ctx` names. A rate limit
    that will pass is waited out (a batch paces itself rather than failing its lines); one that
    never can (larger than the limit) is the line's 429. Each try is a call of its own."""
    while True:
        try:
            gen = await serving.prepare_async(item.kind, item.body, dataclasses.replace(
                ctx, arrival=time.monotonic()), Call(serving.sinks))
        except RateLimitExceeded as e:
            if e.retry_after is None:
                raise
            await asyncio.sleep(e.retry_after)
            continue
        async with gen.running():
            return await gen.response()


async def serve_all(serving, items: list[BatchLine], writer: ResultWriter, progress,
                    ctx: CallContext | None = None) -> dict:
    """Run every item on `serving` (an OpenAIServing) concurrently, as the tenant of `ctx`
    (default: the open server's); returns summary counts."""
    ctx = ctx if ctx is not None else serving.open_context("batch")
    counts = {"succeeded": 0, "failed": 0, "completion_tokens": 0}
    start = time.monotonic()  # not progress.start_t: tqdm stamps that with time.time()

    def finish(item: BatchLine, status: int, body: dict) -> None:
        writer.write(result_line(item, status, body))
        counts["succeeded" if status == 200 else "failed"] += 1
        if status == 200:
            counts["completion_tokens"] += body["usage"]["completion_tokens"]
        progress.update(1)
        elapsed = max(time.monotonic() - start, 1e-9)
        progress.set_postfix(tok_s=f"{counts['completion_tokens'] / elapsed:.1f}",
                             failed=counts["failed"])

    async def one(item: BatchLine) -> None:
        if item.error is not None:  # refused before the serving layer: its call ends here
            Call(serving.sinks).end(call_outcome(
                dataclasses.replace(ctx, route=f"batch:{item.url or ''}"), item.error))
            finish(item, *error_reply(item.error))
            return
        try:
            body = await _answer(serving, item, ctx)
        # A refused request, or one that alone failed in the engine (a 500 line): each its own
        # line, the batch goes on. A dead engine ends the batch.
        except EngineDead:
            raise
        except JaxServeError as e:
            finish(item, *error_reply(e))
            return
        finish(item, 200, body)

    await asyncio.gather(*(one(item) for item in items))
    return counts


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxserve.entrypoints.engine_flags import add_deployment_arguments
    from jaxserve.entrypoints.launcher import add_policy_arguments

    add_deployment_arguments(parser)  # --model, or --deployment as `serve` takes it
    parser.add_argument("--input", required=True, type=Path, help="OpenAI Batch API .jsonl")
    parser.add_argument("--output", required=True, type=Path,
                        help="results .jsonl; appended to, and answered requests are skipped")
    parser.add_argument("--served-model-name", default=None,
                        help="the 'model' the input's bodies name (default: --model; not with "
                             "--deployment, whose routes and versions the bodies name)")
    parser.add_argument("--tenants", type=Path, default=None, metavar="FILE",
                        help="the server's tenants file (TOML), for --tenant's limits and class")
    parser.add_argument("--tenant", default=None,
                        help="run the batch as this tenant of --tenants: its class, share, "
                             "models, max_tokens cap and rate limits (waited out) apply "
                             "(default: the open tenant, no limits)")
    add_policy_arguments(parser)


def pending_items(input_path: Path, output_path: Path) -> list[BatchLine] | None:
    """The input's requests not yet answered in `output_path`; None, after printing why, if the
    input is unreadable or repeats a custom_id. Needs no engine, so a bad or finished batch
    exits before a model loads."""
    try:
        items = read_input(input_path)
        done = answered_keys(output_path)
    except (OSError, ValueError) as e:  # DuplicateCustomIds, or an output that is not ours
        print(f"error: {e}", file=sys.stderr)
        return None
    todo = [item for item in items if item.key not in done]
    if len(todo) < len(items):
        print(f"resuming: {len(items) - len(todo)} of {len(items)} requests already answered "
              f"in {output_path}", file=sys.stderr)
    return todo


def batch_gateway(tenants_file: Path | None, tenant: str | None) -> tuple[Gateway, Principal]:
    """The gateway and the tenant a batch runs as (ConfigError for a bad file or name)."""
    gateway = Gateway(load_tenants(tenants_file) if tenants_file is not None else None)
    if tenant is None and tenants_file is not None:
        raise ConfigError("--tenants needs --tenant: the tenant the batch runs as")
    return gateway, Principal(gateway.tenants.get(tenant or "default"))


async def answer_items(engine, model_name: str, todo: list[BatchLine], output_path: Path,
                       gateway: Gateway | None = None, principal: Principal | None = None,
                       policy=None, fleet=None) -> int:
    """Answer `todo` on `engine` (an AsyncEngine) named `model_name`, or on the versions and
    routes of `fleet` (--deployment; engine None), appending to `output_path`, as `principal`
    of `gateway` (default: the open tenant), under `policy` (a RequestPolicy: --policy and
    --audit-log); returns 0."""
    from jaxserve.entrypoints.serving.openai_serving import OpenAIServing
    serving = OpenAIServing(engine, model_name, gateway=gateway, policy=policy, fleet=fleet)
    ctx = (CallContext(principal, transport="batch") if principal is not None
           else serving.open_context("batch"))
    writer = ResultWriter(output_path)
    start = time.monotonic()
    try:
        with tqdm(total=len(todo), unit="req", file=sys.stderr) as progress:
            counts = await serve_all(serving, todo, writer, progress, ctx)
    finally:
        writer.close()
    elapsed = time.monotonic() - start
    print(f"done: {counts['succeeded']} succeeded, {counts['failed']} failed, "
          f"{counts['completion_tokens']} completion tokens in {elapsed:.1f} s "
          f"({counts['completion_tokens'] / max(elapsed, 1e-9):.1f} tok/s) -> {output_path}",
          file=sys.stderr)
    return 0


async def run_batch_on(engine, model_name: str, input_path: Path, output_path: Path) -> int:
    """Answer every request of `input_path` not yet in `output_path`; returns the exit code."""
    todo = pending_items(input_path, output_path)
    if todo is None:
        return 1
    return await answer_items(engine, model_name, todo, output_path)


def run_batch(args: argparse.Namespace) -> int:
    """`jaxserve batch`: check the files, load the engine, answer what is left, shut it down."""
    from jaxserve.core.engine_factory import start_engine
    from jaxserve.entrypoints.engine_flags import check_model_or_deployment, engine_args
    from jaxserve.entrypoints.launcher import one_version_fleet, start_fleet
    from jaxserve.entrypoints.serving.request_policy import RequestPolicy

    check_model_or_deployment(args)
    if args.deployment is not None and args.served_model_name is not None:
        raise ConfigError("--served-model-name names --model; with --deployment the bodies "
                          "name the file's routes and versions")
    gateway, principal = batch_gateway(args.tenants, args.tenant)
    todo = pending_items(args.input, args.output)
    if todo is None:
        return 1
    if not todo:
        print(f"nothing to do: every request is answered in {args.output}", file=sys.stderr)
        return 0
    policy = RequestPolicy.open(str(args.policy) if args.policy else None,
                                audit_log_config(args.audit_log, args.audit_key_file,
                                                 args.audit_max_bytes, args.audit_min_free_bytes),
                                tenants=[principal.tenant])
    engine = fleet = None
    try:
        name = args.served_model_name or args.model or str(args.deployment)
        if args.deployment is not None:  # every version loaded and compiled, as `serve` does
            fleet = start_fleet(args.deployment)
        else:  # as `serve --model`: results carry its system_fingerprint
            engine = start_engine(args.model, **engine_args(args))
            fleet = one_version_fleet(args, name, engine)
        return asyncio.run(answer_items(engine, name, todo, args.output, gateway, principal,
                                        policy, fleet))
    except KeyboardInterrupt:  # every finished result is already a whole line in the output
        print(f"interrupted: rerun the same command to answer the rest into {args.output}",
              file=sys.stderr)
        return 130
    finally:
        running = fleet if fleet is not None else engine  # a fleet shuts its engines down
        if running is not None:
            running.shutdown()
        if policy is not None:
            policy.close()
