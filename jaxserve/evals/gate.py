"""The fleet's eval gate (`[route.X.gate] eval = "suite.toml"`): before a route's weight on a
version grows, that version must have passed the suite — a stored run of every task, and no
regression against the version listed before it in the suite. Fleet version names are the suite's
version names. The gate only reads the results store: a suite takes minutes, an admin call must
not, so `jaxserve eval run` comes first."""

from __future__ import annotations

from jaxserve.errors import JaxServeError
from jaxserve.evals.suite import load_suite


def eval_gate_refusal(suite_path: str, version: str) -> str | None:
    """Why `version` may not get more traffic under this suite, or None when it passed."""
    # scipy and the store only when a gated route changes: every `serve` wires the gate in
    from jaxserve.evals.regression import compare
    from jaxserve.evals.store import open_store

    try:
        suite = load_suite(suite_path)
    except JaxServeError as e:
        return f"eval suite {suite_path}: {e}"
    names = [v.name for v in suite.versions]
    if version not in names:
        return f"eval suite {suite.name!r} has no version {version!r}"
    position = names.index(version)
    with open_store(suite.store, suite.path.parent) as store:
        latest = {(run.version, run.task): run for run in store.runs(suite.name)}
        for task in suite.tasks:
            run = latest.get((version, task.name))
            if run is None:
                return (f"eval suite {suite.name!r} has no stored run of {version!r} on "
                        f"{task.name!r}; run `jaxserve eval run {suite.path}` first")
            if position == 0:  # the suite's first version is the baseline: nothing to compare
                continue
            before = names[position - 1]
            base = latest.get((before, task.name))
            if base is None:
                return (f"eval suite {suite.name!r} has no stored run of the baseline "
                        f"{before!r} on {task.name!r}")
            c = compare(task.name, run.metric, before, store.samples(base.id), version,
                        store.samples(run.id), suite.regression)
            if c.alert:
                return (f"it regressed on {task.name!r} in eval suite {suite.name!r}: "
                        f"{c.drop_points:.2f} points below {before!r} (p = {c.p_value:.3g})")
    return None
