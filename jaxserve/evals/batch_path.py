"""lm-evaluation-harness's API models with their requests sent as OpenAI batches (`via = "batch"`):
lm-eval builds every request body and scores every response as it does live (its
`_create_payload`, `parse_logprobs`, `parse_generations`); only the transport differs. Where
lm-eval would POST each body to the completions route, the bodies become the lines of one batch
input file (`POST /v1/files`, `POST /v1/batches`), the run waits for the batch to end and reads
its output file back, each line's body in the place of the live response.

Resumable: each batch is recorded in the results store under its run key and the digest of its
input file before the run waits on it. lm-eval builds the same bodies again on a re-run (same
task files, seed and settings: the run key), so a runner killed while a batch runs finds its
batch id on the re-run and waits on that batch (or reads its output) instead of submitting the
work again. A recorded batch that ended without output (failed, expired, cancelled, or deleted)
is submitted anew.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import requests
from lm_eval.models.api_models import LMEVAL_MODEL_NONE_ANSWER_PLACEHOLDER
from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI
from lm_eval.models.utils import chunks

from jaxserve.errors import ConfigError

# Lines per batch: OpenAI allows 50,000; a smaller file keeps each upload and its output
# well under the server's default 64 MiB file bound (a log-likelihood line echoes its prompt).
MAX_LINES = 5_000
POLL_S = 1.0
_PROGRESS_S = 30.0  # a waiting runner says how far its batch is this often
_TIMEOUT_S = 120  # one HTTP call (an upload or download of up to a file's bound)
_ENDED = ("completed", "failed", "expired", "cancelled")


class BatchLedger(Protocol):
    """Where a run's batches are recorded (the results store)."""

    def batch_id(self, batch_key: str) -> str | None: ...

    def record_batch(self, batch_key: str, batch_id: str) -> None: ...


@dataclass(frozen=True)
class BatchClient:
    """Runs request bodies as batches on one server (its …/v1 base URL), as the key's tenant."""

    base_url: str
    endpoint: str  # the batch's endpoint: /v1/completions or /v1/chat/completions
    api_key: str
    ledger: BatchLedger
    run_key: str  # scopes the recorded batches to one (version, task) run

    def run(self, bodies: list[dict]) -> list[dict]:
        """The response body of each request body, in order."""
        out = []
        for part in chunks(bodies, n=MAX_LINES):
            out += self._run_part(part)
        return out

    def _run_part(self, bodies: list[dict]) -> list[dict]:
        content = "".join(json.dumps({"custom_id": str(i), "method": "POST",
                                      "url": self.endpoint, "body": body}, sort_keys=True) + "\n"
                          for i, body in enumerate(bodies)).encode()
        key = f"{self.run_key}:{hashlib.sha256(content).hexdigest()}"
        batch = self._recorded(key)
        if batch is None:
            batch = self._submit(content)
            self.ledger.record_batch(key, batch["id"])
        batch = self._wait(batch)
        if batch["status"] != "completed":
            errors = (batch.get("errors") or {}).get("data") or []
            raise ConfigError(f"batch {batch['id']} ended {batch['status']}"
                              + (f": {errors[0].get('message')}" if errors else ""))
        by_id = {}
        for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
            if file_id:
                for text in self._get(f"files/{file_id}/content").text.splitlines():
                    if text.strip():
                        line = json.loads(text)
                        by_id[line["custom_id"]] = line
        return [self._body(by_id, str(i), batch["id"]) for i in range(len(bodies))]

    @staticmethod
    def _body(by_id: dict, custom_id: str, batch_id: str) -> dict:
        line = by_id.get(custom_id)
        if line is None:
            raise ConfigError(f"batch {batch_id}: no result for line {custom_id}")
        response = line.get("response") or {}
        if response.get("status_code") != 200:
            error = (response.get("body") or {}).get("error") or line.get("error") or {}
            raise ConfigError(f"batch {batch_id}, line {custom_id}: "
                              f"{response.get('status_code')} {error.get('message')}")
        return response["body"]

    def _recorded(self, key: str) -> dict | None:
        """The batch recorded under `key`, unless it ended without output or is gone."""
        batch_id = self.ledger.batch_id(key)
        if batch_id is None:
            return None
        resp = self._call("GET", f"batches/{batch_id}", ok=(200, 404))
        batch = resp.json() if resp.status_code == 200 else None
        if batch is None or batch["status"] in ("failed", "expired", "cancelled", "cancelling"):
            _log(f"eval: batch {batch_id} "
                 f"{'is gone' if batch is None else 'ended ' + batch['status']}: submitting again")
            return None
        _log(f"eval: resuming batch {batch_id} ({batch['status']})")
        return batch

    def _submit(self, content: bytes) -> dict:
        file = self._call("POST", "files", data={"purpose": "batch"},
                          files={"file": ("eval.jsonl", content, "application/jsonl")}).json()
        batch = self._call("POST", "batches", json={
            "input_file_id": file["id"], "endpoint": self.endpoint, "completion_window": "24h",
            "metadata": {"jaxserve_eval_run": self.run_key[:64]}}).json()
        lines = content.count(b"\n")
        _log(f"eval: submitted batch {batch['id']} ({lines} requests)")
        return batch

    def _wait(self, batch: dict) -> dict:
        logged = time.monotonic()
        while batch["status"] not in _ENDED:
            time.sleep(POLL_S)
            batch = self._get(f"batches/{batch['id']}").json()
            if time.monotonic() - logged >= _PROGRESS_S:
                counts, logged = batch.get("request_counts") or {}, time.monotonic()
                _log(f"eval: batch {batch['id']} {batch['status']}: {counts.get('completed')} "
                     f"of {counts.get('total')} requests done")
        return batch

    def _get(self, path: str) -> requests.Response:
        return self._call("GET", path)

    def _call(self, method: str, path: str, ok=(200,), **kwargs) -> requests.Response:
        url = f"{self.base_url}/{path}"
        try:
            resp = requests.request(method, url, timeout=_TIMEOUT_S, headers={
                "Authorization": f"Bearer {self.api_key or 'none'}"}, **kwargs)
        except requests.RequestException as e:
            raise ConfigError(f"{method} {url}: {e}") from None
        if resp.status_code not in ok:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text[:300]
            raise ConfigError(f"{method} {url} answered {resp.status_code}: {message}")
        return resp


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _ViaBatch:
    """Replaces lm-eval's transport (get_batched_requests, which it calls with every request of a
    log-likelihood pass, or of one generation-settings group, at once); its scoring is unchanged.
    lm-eval takes that path only with num_concurrent > 1, which the driver sets (the server's
    --batch-max-concurrent-lines decides how many lines run at once)."""

    def __init__(self, *, batch_client: BatchClient, **kwargs):
        super().__init__(**kwargs)
        self.batch_client = batch_client

    async def get_batched_requests(self, requests, cache_keys, *, generate=True, ctxlens=None,
                                   **kwargs):
        gen_kwargs = kwargs.pop("gen_kwargs", None)
        messages = list(chunks(requests, n=self._batch_size))
        lens = list(chunks(ctxlens or [None] * len(requests), n=self._batch_size))
        bodies = [self._create_payload(self.create_message(m), generate=generate,
                                       gen_kwargs=copy.deepcopy(gen_kwargs), seed=self._seed,
                                       **kwargs) for m in messages]
        outputs = self.batch_client.run(bodies)
        if generate:
            answers = [self.parse_generations(outputs=out) for out in outputs]
        else:
            answers = [self.parse_logprobs(outputs=out, tokens=m, ctxlens=c)
                       for out, m, c in zip(outputs, messages, lens)]
        # As lm-eval's live path: a null answer becomes its placeholder.
        return [[LMEVAL_MODEL_NONE_ANSWER_PLACEHOLDER if a is None else a for a in part]
                for part in answers]


class BatchCompletions(_ViaBatch, LocalCompletionsAPI):
    """`local-completions` over the Batch API."""


class BatchChatCompletions(_ViaBatch, LocalChatCompletion):
    """`local-chat-completions` over the Batch API."""
