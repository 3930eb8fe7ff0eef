"""One (version, task) run through lm-evaluation-harness as a library: its `local-completions` (or
`local-chat-completions`) model against the version's server, its task configs and its scorers,
with `log_samples` on so every question's score comes back for the paired test.

The tokenizer: lm-eval's default ("auto") uses the server's /tokenizer_info + /tokenize when the
server has them, else it would load the HF tokenizer by name (transformers, which the eval extra
does not pull). So the driver asks the same question lm-eval asks; without those routes it sends
text prompts with no client tokenizer, which generation tasks need nothing more for (multiple
choice ones, scored by log-likelihood, need the remote tokenizer and fail in lm-eval saying so).

A version with `via = "batch"` sends the same requests as OpenAI batches (evals/batch_path.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from jaxserve.errors import ConfigError, InvalidRequest
from jaxserve.evals.store import Sample
from jaxserve.evals.suite import Suite, TaskSpec, VersionSpec


@dataclass(frozen=True)
class TaskResult:
    metric: str
    score: float
    samples: list[Sample]
    settings: dict  # what lm-eval was run with, beyond the suite's seed


def _task_argument(task: TaskSpec):
    """A registered task's name, or a local file's config with its data files made absolute
    (lm-eval would read them relative to the working directory, not to the YAML)."""
    if task.path is None:
        return task.name
    from lm_eval.tasks._yaml_loader import load_yaml  # what TaskManager reads task files with

    config = load_yaml(task.path)
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        config["dataset_kwargs"]["data_files"] = {
            split: _local_data(task.path.parent, f) for split, f in files.items()}
    elif isinstance(files, (str, list)):
        config["dataset_kwargs"]["data_files"] = _local_data(task.path.parent, files)
    return config


def task_digest(task: TaskSpec) -> str:
    """What decides a task's questions: a registered task's name (and lm-eval's version), or a
    local file with the data files it reads."""
    import lm_eval

    if task.path is None:
        return f"{task.name}@lm-eval-{getattr(lm_eval, '__version__', 'unknown')}"
    files = (_task_argument(task).get("dataset_kwargs") or {}).get("data_files") or {}
    paths = sorted({task.path, *map(Path, _flatten(files))})
    h = hashlib.sha256()
    for path in paths:
        h.update(str(path).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _flatten(files) -> list[str]:
    if isinstance(files, dict):
        return [f for v in files.values() for f in _flatten(v)]
    return files if isinstance(files, list) else [files]


def _local_data(base: Path, files):
    if isinstance(files, list):
        return [_local_data(base, f) for f in files]
    path = (base / files).resolve()
    if not path.is_file():
        raise InvalidRequest(f"task file {base}: data file {files!r} not found")
    return str(path)


def _api_key(version: VersionSpec) -> str:
    key = os.environ.get(version.api_key_env, "") if version.api_key_env else ""
    if version.api_key_env and not key:
        raise InvalidRequest(f"version {version.name}: ${version.api_key_env} is not set")
    return key


def check_server(version: VersionSpec) -> None:
    """Before lm-eval starts: the server answers GET /v1/models and serves the version's model
    (one line naming the version, instead of lm-eval's retries and traceback)."""
    request = urllib.request.Request(f"{version.url}/models", headers={
        "Authorization": f"Bearer {_api_key(version) or 'none'}"})
    where = f"version {version.name} ({version.url})"
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            listed = json.loads(resp.read(1 << 20))
    except urllib.error.HTTPError as e:
        raise ConfigError(f"{where}: GET /models answered {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ConfigError(f"{where}: cannot reach the server: {getattr(e, 'reason', e)}") from None
    served = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)]
    if version.model not in served:
        raise ConfigError(f"{where}: the server serves {served[:8]}, not {version.model!r}")


def _model_args(version: VersionSpec, seed: int) -> tuple[str, dict]:
    from lm_eval.utils import check_remote_tokenizer_support

    endpoint = "completions" if version.api == "completions" else "chat/completions"
    base_url = f"{version.url}/{endpoint}"
    key = _api_key(version)
    args = {"model": version.model, "base_url": base_url, "num_concurrent":
            version.num_concurrent, "batch_size": version.batch_size,
            "max_gen_toks": version.max_gen_toks, "seed": seed,
            "max_retries": 3, "header": {"Authorization": f"Bearer {key or 'none'}"},
            "auth_token": key or None}  # the remote tokenizer's calls (the header is not theirs)
    if version.api == "chat-completions":  # messages go as text; lm-eval scores generations
        return "local-chat-completions", args | {"tokenizer_backend": None,
                                                 "tokenized_requests": False}
    if check_remote_tokenizer_support(base_url, auth_token=key or None):
        return "local-completions", args | {"tokenizer_backend": "remote",
                                            "tokenized_requests": True}
    return "local-completions", args | {"tokenizer_backend": None, "tokenized_requests": False}


def _metric_key(results: dict, task: TaskSpec) -> tuple[str, str]:
    """The result key ("exact_match,strip") of the task's chosen (or first) metric."""
    keys = [k for k in results if "," in k and not k.split(",")[0].endswith("_stderr")]
    wanted = [k for k in keys if task.metric is None or k.split(",")[0] == task.metric]
    if not wanted:
        raise InvalidRequest(f"task {task.name}: no metric {task.metric!r} among "
                             f"{sorted({k.split(',')[0] for k in keys})}")
    return wanted[0], wanted[0].split(",")[0]


def _response(sample: dict) -> str:
    resp = sample.get("filtered_resps")
    while isinstance(resp, list) and len(resp) == 1:
        resp = resp[0]
    return str(resp)[:2000]


def _batch_model(version: VersionSpec, model: str, model_args: dict, ledger, run_key: str):
    """lm-eval's model of `model` with its requests sent as batches (evals/batch_path.py)."""
    from jaxserve.evals.batch_path import BatchChatCompletions, BatchClient, BatchCompletions

    chat = model == "local-chat-completions"
    client = BatchClient(version.url, "/v1/chat/completions" if chat else "/v1/completions",
                         _api_key(version), ledger, run_key)
    cls = BatchChatCompletions if chat else BatchCompletions
    # num_concurrent > 1: lm-eval then hands every request of a pass over at once
    return cls(batch_client=client, **model_args | {"num_concurrent": 2})


def run_task(suite: Suite, version: VersionSpec, task: TaskSpec, ledger=None,
             run_key: str = "") -> TaskResult:
    """`ledger` (an evals.batch_path.BatchLedger: the results store) records the batches of a
    `via = "batch"` version under `run_key`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model, model_args = _model_args(version, suite.seed)
    lm = (_batch_model(version, model, model_args, ledger, run_key) if version.via == "batch"
          else model)
    # A registered name needs lm-eval's task index; local configs need none of it.
    manager = TaskManager(include_defaults=task.path is None)
    chat = version.api == "chat-completions"
    import aiohttp
    import requests

    try:
        out = lm_eval.simple_evaluate(
            model=lm, model_args=model_args, tasks=[_task_argument(task)],
            num_fewshot=task.num_fewshot, limit=suite.limit, log_samples=True,
            bootstrap_iters=0, task_manager=manager,
            system_instruction=version.system_instruction, apply_chat_template=chat,
            random_seed=suite.seed, numpy_random_seed=suite.seed, torch_random_seed=suite.seed,
            fewshot_random_seed=suite.seed)
    except (aiohttp.ClientError, requests.RequestException, asyncio.TimeoutError) as e:
        raise ConfigError(f"version {version.name}, task {task.name}: the server failed "
                          f"during the run: {e}") from e
    results = out["results"][task.name]
    key, metric = _metric_key(results, task)
    filter_name = key.split(",", 1)[1]
    samples = [Sample(doc_id=int(s["doc_id"]), doc_hash=str(s["doc_hash"]),
                      correct=float(s[metric]), target=str(s.get("target", ""))[:2000],
                      response=_response(s))
               for s in out["samples"][task.name] if s.get("filter") in (None, filter_name)]
    settings = {"model": model, "via": version.via,
                "tokenizer_backend": model_args["tokenizer_backend"],
                "num_fewshot": task.num_fewshot, "limit": suite.limit, "filter": filter_name,
                "lm_eval": getattr(lm_eval, "__version__", "unknown")}
    return TaskResult(metric, float(results[key]), samples, settings)
