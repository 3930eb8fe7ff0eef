"""`jaxserve eval run SUITE`: every (version, task) pair of the suite run once, stored, and each
version compared with the one before it.

Resumable: a pair's run key is a hash of everything that decides its result (suite, version name
and id, the version's settings, the task and its files' digest, seed, limit), so a re-run skips
the pairs already stored and runs only the rest; a changed task file or setting is a new run.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass

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


def run_key(suite: Suite, version: VersionSpec, task: TaskSpec, task_digest: str) -> str:
    material = {"suite": suite.name, "version": version.name, "version_id": version.version_id,
                "settings": version.settings(), "task": task.name, "task_digest": task_digest,
                "metric": task.metric, "num_fewshot": task.num_fewshot, "seed": suite.seed,
                "limit": suite.limit}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_suite(suite: Suite, store: ResultsStore) -> SuiteResult:
    # lm-eval is imported only when a suite runs
    from jaxserve.evals.driver import check_server, run_task, task_digest

    digests = {task.name: task_digest(task) for task in suite.tasks}
    runs, ran = {}, []
    for version in suite.versions:
        checked = False
        for task in suite.tasks:
            key = run_key(suite, version, task, digests[task.name])
            run = store.run(key)
            if run is None:
                if not checked:  # only versions with work left need their server up
                    check_server(version)
                    checked = True
                _log(f"eval: {version.name} / {task.name}: running")
                started = time.time()
                result = run_task(suite, version, task)
                store.add_run(Run(key, suite.name, version.name, version.version_id, task.name,
                                  result.metric, result.score, len(result.samples), suite.seed,
                                  version.settings() | result.settings, started, time.time()),
                              result.samples)
                run = store.run(key)
                ran.append((version.name, task.name))
            stored = "" if ran[-1:] == [(version.name, task.name)] else ", stored"
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
