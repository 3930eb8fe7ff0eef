"""`jaxserve eval run SUITE`: every (version, task) pair of the suite run once, stored, and each
version compared with the one before it.

Resumable: a pair's run key is a hash of everything that decides its result (suite, version name
and id, the version's settings, the task and its files' digest, seed, limit), so a re-run skips
the pairs already stored and runs only the rest; a changed task file or setting is a new run.
Within a pair, a `via = "batch"` version's batches are recorded under its run key, so a re-run
after a kill waits on the batch already submitted instead of submitting it again.

A version with no URL (a model path, or a deployment file's version) is served in-process for its
pairs by `in_process` (the entrypoints' InProcessVersions: this package starts no engine), and its
id is its manifest's, known before its weights load, so a stored pair is skipped without loading.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import sys
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Iterator, Protocol

from jaxserve.errors import ConfigError
from jaxserve.evals.regression import Comparison, compare, confidence_interval
from jaxserve.evals.store import ResultsStore, Run
from jaxserve.evals.suite import Suite, TaskSpec, VersionSpec


@dataclass(frozen=True)
class SuiteResult:
    suite: Suite
    runs: dict[tuple[str, str], Run]  # (version, task) -> its run
    ran: tuple[tuple[str, str], ...]  # pairs run by this invocation (the rest were stored)
    comparisons: tuple[Comparison, ...]

    @property
    def alert(self) -> bool:
        return any(c.alert for c in self.comparisons)

    def to_dict(self, store: ResultsStore) -> dict:
        config = self.suite.regression
        runs = []
        for (version, task), run in self.runs.items():
            low, high = confidence_interval([s.correct for s in store.samples(run.id)])
            runs.append({"version": version, "version_id": run.version_id, "task": task,
                         "metric": run.metric, "score": run.score, "ci95": [low, high],
                         "num_samples": run.num_samples, "seed": run.seed,
                         "resumed": (version, task) not in self.ran})
        return {"suite": self.suite.name, "alert": self.alert,
                "min_drop_points": config.min_drop_points, "alpha": config.alpha,
                "runs": runs, "comparisons": [c.to_dict() for c in self.comparisons]}


class InProcess(Protocol):
    """Serves suite versions that name no running server (jaxserve.entrypoints.eval_versions)."""

    def version_id(self, version: VersionSpec) -> str:
        """The version's manifest id, without loading its weights."""

    def serve(self, version: VersionSpec) -> AbstractContextManager[str]:
        """The version loaded behind a server for the block: its OpenAI base URL (…/v1)."""


def version_id(version: VersionSpec, in_process: InProcess | None) -> str:
    if version.manifest_id is not None:
        return version.manifest_id
    if not version.in_process:
        return f"{version.model}@{version.url}"
    return _require(in_process, version).version_id(version)


def _require(in_process: InProcess | None, version: VersionSpec) -> InProcess:
    if in_process is None:
        raise ConfigError(f"version {version.name}: no url, and this runner serves no version "
                          "in-process")
    return in_process


@contextlib.contextmanager
def _served(version: VersionSpec, in_process: InProcess | None) -> Iterator[VersionSpec]:
    """The version as lm-eval reaches it: its own URL, or one served in-process for the block."""
    if not version.in_process:
        yield version
        return
    with _require(in_process, version).serve(version) as url:
        yield dataclasses.replace(version, url=url)


def run_key(suite: Suite, version: VersionSpec, task: TaskSpec, task_digest: str,
            version_id: str) -> str:
    material = {"suite": suite.name, "version": version.name, "version_id": version_id,
                "settings": version.settings(), "task": task.name, "task_digest": task_digest,
                "metric": task.metric, "num_fewshot": task.num_fewshot, "seed": suite.seed,
                "limit": suite.limit}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_suite(suite: Suite, store: ResultsStore,
              in_process: InProcess | None = None) -> SuiteResult:
    # lm-eval is imported only when a suite runs
    from jaxserve.evals.driver import check_server, run_task, task_digest

    digests = {task.name: task_digest(task) for task in suite.tasks}
    runs, ran = {}, []
    for version in suite.versions:
        vid = version_id(version, in_process)
        keys = {task.name: run_key(suite, version, task, digests[task.name], vid)
                for task in suite.tasks}
        todo = [task for task in suite.tasks if store.run(keys[task.name]) is None]
        # Only versions with work left need their server up (or their engine loaded).
        with _served(version, in_process) if todo else contextlib.nullcontext() as served:
            if todo:
                check_server(served)
            for task in todo:
                _log(f"eval: {version.name} / {task.name}: running")
                started = time.time()
                result = run_task(suite, served, task, store, keys[task.name])
                store.add_run(Run(keys[task.name], suite.name, version.name, vid, task.name,
                                  result.metric, result.score, len(result.samples), suite.seed,
                                  version.settings() | result.settings, started, time.time()),
                              result.samples)
                ran.append((version.name, task.name))
        for task in suite.tasks:
            run = store.run(keys[task.name])
            stored = "" if (version.name, task.name) in ran else ", stored"
            _log(f"eval: {version.name} / {task.name}: {run.metric} {run.score:.4f} "
                 f"({run.num_samples} questions{stored})")
            runs[(version.name, task.name)] = run
    comparisons = []
    for before, after in zip(suite.versions, suite.versions[1:]):
        for task in suite.tasks:
            a, b = runs[(before.name, task.name)], runs[(after.name, task.name)]
            comparisons.append(compare(task.name, b.metric, before.name, store.samples(a.id),
                                       after.name, store.samples(b.id), suite.regression))
    return SuiteResult(suite, runs, tuple(ran), tuple(comparisons))
