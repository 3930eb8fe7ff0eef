"""The Batch API's behaviour over its store: files and batches owned by their tenant, and every
batch driven in the background from `validating` to its end.

    validating -> in_progress -> finalizing -> completed
    validating -> failed (the input file's lines do not make a batch: `errors` names each line)
    validating | in_progress -> cancelling -> cancelled (partial output)
    in_progress -> expired (completion_window passed: partial output)

Each line is run by a `LineExecutor` the serving layer provides (the same request path as live
traffic, at the lowest priority class), at most `max_concurrent_lines` at once over every batch.
A line's result is committed with its count before the line is done (store.record); a restart
(`start`) resumes every unfinished batch and runs only the lines without a result. A line cut
off by a cancel, the window's end or a shutdown has no result, so it is run again on resume, or
written to the error file as never run (`batch_cancelled`, `batch_expired`).

For other host-side callers (the eval pipeline): `submit` a list of request lines, `wait` for
the end, `results` reads the output and error lines back."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from jaxserve.batches.config import BatchLimits, window_seconds
from jaxserve.batches.store import BatchStore, UNFINISHED, new_id
from jaxserve.errors import Conflict, EngineDead, InvalidRequest

log = logging.getLogger("jaxserve.batches")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
TERMINAL = ("completed", "failed", "expired", "cancelled")
MAX_LISTED_ERRORS = 100  # of a failed validation; the first ones, by line
_METADATA_PAIRS, _METADATA_KEY, _METADATA_VALUE = 16, 64, 512  # OpenAI's bounds
_UNRUN = {"cancelled": ("batch_cancelled", "This request was not executed because the batch "
                                           "was cancelled."),
          "expired": ("batch_expired", "This request could not be executed before the "
                                       "completion window expired.")}


@dataclass(frozen=True)
class Line:
    """One request line of an input file, as the line executor parsed it."""
    number: int  # 1-based line number in the file
    custom_id: str | None
    error: dict | None = None  # a line that cannot run: its BatchError {code, line, message, param}
    model: str | None = None
    payload: Any = None  # what the executor runs


class LineExecutor(Protocol):
    def parse(self, endpoint: str, number: int, text: str) -> Line:
        """One non-blank line of an input file for a batch of `endpoint`."""

    async def execute(self, tenant: str, key_id: str | None, line: Line) -> tuple[int, dict]:
        """Run `line` as the tenant: (HTTP status, response body or OpenAI error body). Raises
        EngineDead when nothing can run (the batch is resumed later), never for one line."""


def split_lines(content: bytes) -> list[tuple[int, str]]:
    """(line number, text) of each non-blank line; only "\\n" ends a line (JSON text may hold
    U+2028 and the other line breaks str.splitlines knows). InvalidRequest if not UTF-8."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the file is not UTF-8 text (byte {e.start})", "file") from None
    return [(n, t) for n, t in enumerate(text.split("\n"), start=1) if t.strip()]


def check_metadata(metadata: Any) -> dict | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > _METADATA_PAIRS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= _METADATA_KEY
            and len(v) <= _METADATA_VALUE for k, v in metadata.items()):
        raise InvalidRequest(f"'metadata' must be an object of at most {_METADATA_PAIRS} string "
                             f"values, keys up to {_METADATA_KEY} characters, values up to "
                             f"{_METADATA_VALUE}", "metadata")
    return metadata


def _usage(body: dict) -> tuple[int, int, int, int]:
    """(input, output, cached, reasoning) tokens of a response body of any endpoint."""
    u = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(u, dict):
        return 0, 0, 0, 0
    inp = u.get("prompt_tokens", u.get("input_tokens")) or 0
    out = u.get("completion_tokens", u.get("output_tokens")) or 0
    cached = ((u.get("prompt_tokens_details") or u.get("input_tokens_details") or {})
              .get("cached_tokens") or 0)
    reasoning = ((u.get("completion_tokens_details") or u.get("output_tokens_details") or {})
                 .get("reasoning_tokens") or 0)
    return inp, out, cached, reasoning


def result_line(line: Line, status: int, body: dict) -> dict:
    """A line's output in OpenAI's format: its request id is the response's id where it has one
    (what the access and audit logs name)."""
    request_id = body.get("id") if status == 200 and isinstance(body.get("id"), str) else None
    return {"id": new_id("batch_req_"), "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id or new_id("req_"),
                         "body": body},
            "error": None}


class BatchService:
    def __init__(self, store: BatchStore, limits: BatchLimits = BatchLimits(),
                 endpoints: tuple[str, ...] = ENDPOINTS):
        self.store = store
        self.limits = limits
        self.endpoints = endpoints
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batch-store")
        self._lines: LineExecutor | None = None
        self._slots: asyncio.Semaphore | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._stop_events: dict[str, asyncio.Event] = {}

    async def _db(self, fn, *args, **kwargs):
        """A store call on the store's thread (SQLite and large blobs stay off the event loop;
        one thread keeps the calls in order)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args, **kwargs))

    # ---------------------------------------------------------------- files

    async def create_file(self, tenant: str, purpose: str, filename: str,
                          content: bytes) -> dict:
        if purpose != "batch":
            raise InvalidRequest(f"'purpose' must be 'batch' (this server stores batch input "
                                 f"files only), got {purpose[:40]!r}", "purpose")
        if len(content) > self.limits.max_file_bytes:
            raise InvalidRequest(f"the file is larger than the server's limit of "
                                 f"{self.limits.max_file_bytes} bytes", "file")
        lines = await asyncio.get_running_loop().run_in_executor(None, split_lines, content)
        if len(lines) > self.limits.max_file_lines:
            raise InvalidRequest(f"the file has {len(lines)} requests, over the server's limit "
                                 f"of {self.limits.max_file_lines}", "file")
        return await self._db(self.store.add_file, tenant, purpose, filename, content,
                              self.limits.max_tenant_bytes)

    async def file(self, tenant: str, file_id: str) -> dict:
        return await self._db(self.store.file, tenant, file_id)

    async def file_content(self, tenant: str, file_id: str) -> bytes:
        return await self._db(self.store.file_content, tenant, file_id)

    async def files(self, tenant: str, purpose: str | None, after: str | None, limit: int,
                    order: str) -> tuple[list[dict], bool]:
        return await self._db(self.store.files, tenant, purpose, after, limit, order)

    async def delete_file(self, tenant: str, file_id: str) -> dict:
        return await self._db(self.store.delete_file, tenant, file_id)

    # ---------------------------------------------------------------- batches

    async def create_batch(self, tenant: str, key_id: str | None, input_file_id: str,
                           endpoint: str, completion_window: str, metadata: Any = None) -> dict:
        if endpoint not in self.endpoints:
            raise InvalidRequest(f"'endpoint' must be one of {', '.join(self.endpoints)}, got "
                                 f"{endpoint[:80]!r}", "endpoint")
        window = window_seconds(completion_window)
        now = int(self.store.clock())
        obj = {"id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "errors": None,
               "input_file_id": input_file_id, "completion_window": completion_window,
               "status": "validating", "output_file_id": None, "error_file_id": None,
               "created_at": now, "in_progress_at": None, "expires_at": now + window,
               "finalizing_at": None, "completed_at": None, "failed_at": None,
               "expired_at": None, "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": 0, "completed": 0, "failed": 0},
               "metadata": check_metadata(metadata), "model": None, "usage": None}
        obj = await self._db(self.store.add_batch, tenant, key_id, obj,
                             self.limits.max_active_batches)
        self._spawn(obj["id"])
        return obj

    async def batch(self, tenant: str, batch_id: str) -> dict:
        return await self._db(self.store.batch, tenant, batch_id)

    async def batches(self, tenant: str, after: str | None, limit: int
                      ) -> tuple[list[dict], bool]:
        return await self._db(self.store.batches, tenant, after, limit)

    async def cancel(self, tenant: str, batch_id: str) -> dict:
        """validating or in_progress -> cancelling (its lines stop; the batch ends cancelled
        with what finished); a batch cancelling already is answered as it is; one that is
        finalizing or ended: Conflict (409)."""
        obj = await self._db(self.store.batch, tenant, batch_id)
        if obj["status"] == "cancelling":
            return obj
        obj = await self._db(self.store.update, batch_id, {"status": "cancelling"},
                             only_from=("validating", "in_progress"), tenant=tenant)
        self._stop_event(batch_id).set()
        return obj

    # ---------------------------------------------------------------- for host-side callers

    async def submit(self, tenant: str, requests: list[dict], endpoint: str,
                     completion_window: str = "24h", metadata: dict | None = None) -> dict:
        """A batch of `requests` (each {"custom_id", "method", "url", "body"}), as if uploaded
        and created through the routes by `tenant`."""
        content = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in requests).encode()
        file = await self.create_file(tenant, "batch", "submitted.jsonl", content)
        return await self.create_batch(tenant, None, file["id"], endpoint, completion_window,
                                       metadata)

    async def wait(self, tenant: str, batch_id: str, poll_s: float = 0.2) -> dict:
        """The batch once it has ended."""
        while (obj := await self.batch(tenant, batch_id))["status"] not in TERMINAL:
            await asyncio.sleep(poll_s)
        return obj

    async def results(self, tenant: str, obj: dict) -> list[dict]:
        """An ended batch's output and error lines, in that order."""
        out = []
        for key in ("output_file_id", "error_file_id"):
            if obj[key] is not None:
                content = await self.file_content(tenant, obj[key])
                out += [json.loads(t) for _, t in split_lines(content)]
        return out

    # ---------------------------------------------------------------- running

    def start(self, lines: LineExecutor) -> None:
        """Run batches with `lines` from now on (on the running event loop), resuming every
        unfinished one."""
        self._lines = lines
        self._slots = asyncio.Semaphore(self.limits.max_concurrent_lines)
        for batch_id in self.store.unfinished():
            self._spawn(batch_id)

    async def stop(self) -> None:
        """Cancel the running batches' work (each resumes on the next start) and close."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pool.shutdown(wait=True)
        self.store.close()

    def _spawn(self, batch_id: str) -> None:
        if self._lines is not None and batch_id not in self._tasks:
            self._tasks[batch_id] = asyncio.get_running_loop().create_task(self._drive(batch_id))

    def _stop_event(self, batch_id: str) -> asyncio.Event:
        return self._stop_events.setdefault(batch_id, asyncio.Event())

    async def _drive(self, batch_id: str) -> None:
        try:
            await self._drive_batch(batch_id)
        except EngineDead:
            log.warning("batch %s paused: the engine is not running (it resumes on restart)",
                        batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one batch's fault must not stop the others
            log.exception("batch %s failed", batch_id)
            await self._db(self.store.update, batch_id, {"status": "failed", "errors": {
                "object": "list", "data": [{"code": "server_error", "line": None, "param": None,
                                            "message": "the batch failed inside the server"}]}})
        finally:
            self._tasks.pop(batch_id, None)
            self._stop_events.pop(batch_id, None)

    async def _drive_batch(self, batch_id: str) -> None:
        obj = await self._db(self.store.batch, None, batch_id)
        tenant, key_id = await self._db(self.store.owner, batch_id)
        content = await self._db(self.store.file_content, tenant, obj["input_file_id"])
        lines, errors = await asyncio.get_running_loop().run_in_executor(
            None, self._validate, obj["endpoint"], content)
        if obj["status"] == "validating":
            if errors:
                await self._db(self.store.update, batch_id, {"status": "failed", "errors": {
                    "object": "list", "data": errors[:MAX_LISTED_ERRORS]}})
                return
            models = {line.model for line in lines}
            obj = await self._transition(batch_id, {
                "status": "in_progress", "model": models.pop() if len(models) == 1 else None,
                "request_counts": {"total": len(lines), "completed": 0, "failed": 0}},
                ("validating",))
        # Resumed after the lines: a batch that was finalizing completed, one cancelling did not.
        ending = "completed" if obj["status"] == "finalizing" else "cancelled"
        if obj["status"] == "in_progress":
            ending = await self._run_lines(obj, tenant, key_id, lines)
            if ending == "completed":
                obj = await self._transition(batch_id, {"status": "finalizing"},
                                             ("in_progress",))
                if obj["status"] == "cancelling":  # cancelled after its last line: as it is
                    ending = "cancelled"
        done = await self._db(self.store.done_lines, batch_id)
        code, message = _UNRUN.get(ending, (None, None))
        unrun = [{"id": new_id("batch_req_"), "custom_id": line.custom_id, "response": None,
                  "error": {"code": code, "message": message}}
                 for line in lines if line.number not in done]
        await self._db(self.store.finalize, batch_id, ending, unrun)

    async def _transition(self, batch_id: str, changes: dict, only_from: tuple) -> dict:
        """The batch after `changes`, or as it is if it left `only_from` meanwhile (a cancel)."""
        try:
            return await self._db(self.store.update, batch_id, changes, only_from=only_from)
        except Conflict:
            return await self._db(self.store.batch, None, batch_id)

    def _validate(self, endpoint: str, content: bytes) -> tuple[list[Line], list[dict]]:
        """The input's lines and OpenAI's validation errors (each naming its line)."""
        try:
            numbered = split_lines(content)
        except InvalidRequest as e:
            return [], [{"code": "invalid_file", "line": None, "param": None, "message": str(e)}]
        lines = [self._lines.parse(endpoint, n, t) for n, t in numbered]
        errors = [line.error for line in lines if line.error is not None]
        first: dict[str, int] = {}
        for line in lines:
            if line.custom_id is not None and line.custom_id in first:
                errors.append({"code": "duplicate_custom_id", "line": line.number,
                               "param": "custom_id",
                               "message": f"custom_id {line.custom_id[:64]!r} is also the "
                                          f"custom_id of line {first[line.custom_id]}"})
            first.setdefault(line.custom_id, line.number)
        if not lines:
            errors.append({"code": "empty_file", "line": None, "param": None,
                           "message": "the input file has no request"})
        if len(lines) > self.limits.max_file_lines:  # a file uploaded under a larger bound
            errors.append({"code": "too_many_tasks", "line": None, "param": None,
                           "message": f"the input file has {len(lines)} requests, over the "
                                      f"server's limit of {self.limits.max_file_lines}"})
        errors.sort(key=lambda e: e["line"] or 0)
        return lines, errors

    async def _run_lines(self, obj: dict, tenant: str, key_id: str | None,
                         lines: list[Line]) -> str:
        """Run the lines without a result until all have one ("completed"), the batch is
        cancelled ("cancelled") or its window ends ("expired"); a line still running then is
        cancelled (its engine requests aborted) and has no result."""
        batch_id = obj["id"]
        done = await self._db(self.store.done_lines, batch_id)
        stop = self._stop_event(batch_id)

        async def one(line: Line) -> None:
            async with self._slots:
                if stop.is_set():
                    return
                status, body = await self._lines.execute(tenant, key_id, line)
            await self._db(self.store.record, batch_id, line.number, status == 200,
                           result_line(line, status, body), _usage(body))

        async def every_line() -> None:
            async with asyncio.TaskGroup() as group:
                for line in lines:
                    if line.number not in done:
                        group.create_task(one(line))

        work = asyncio.ensure_future(every_line())
        stopped = asyncio.ensure_future(stop.wait())
        left = obj["expires_at"] - self.store.clock()
        try:
            finished, _ = await asyncio.wait({work, stopped}, timeout=max(left, 0),
                                             return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the service stops: every line's engine requests aborted
            stopped.cancel()
            if not work.done():
                work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        if work in finished:
            try:
                work.result()
            except* EngineDead:
                raise EngineDead("the engine stopped while the batch ran") from None
            return "completed"
        return "cancelled" if stop.is_set() else "expired"
