"""Is a version worse than the one before it on a task, beyond noise?

Both runs are paired on the same questions (lm-eval's doc hash). Scores of 0/1 (accuracy, exact
match) go through McNemar's exact test: only the questions that flipped carry information, and
under "no change" a flip is as likely in either direction, so the count of lost answers among the
flips is Binomial(flips, 1/2). Other scores go through a paired bootstrap of the mean difference
with a fixed seed (the same stores give the same p-value). An alert needs both: a drop of at
least `min_drop_points` percentage points *and* a p-value below `alpha` — a 1-point drop on 100
questions is usually noise, and a significant 0.1-point drop on a huge task is usually not news.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import binomtest

from jaxserve.evals.store import Sample
from jaxserve.evals.suite import RegressionConfig

_BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class Comparison:
    task: str
    metric: str
    baseline: str  # version names
    candidate: str
    paired: int  # questions in both runs
    baseline_score: float  # on the paired questions, 0..1
    candidate_score: float
    drop_points: float  # 100 * (baseline - candidate); negative is a gain
    p_value: float
    test: str  # "mcnemar-exact" | "paired-bootstrap"
    lost: tuple[int, ...]  # doc ids right before, wrong now
    gained: tuple[int, ...]
    alert: bool

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def _binary(values: np.ndarray) -> bool:
    return bool(np.all((values == 0) | (values == 1)))


def confidence_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Of a run's score: Wilson's interval for 0/1 scores, else the normal one on the mean."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return (0.0, 0.0)
    if _binary(x):
        ci = binomtest(int(x.sum()), int(x.size)).proportion_ci(level, method="wilson")
        return (float(ci.low), float(ci.high))
    from scipy.stats import norm

    half = norm.ppf(0.5 + level / 2) * (x.std(ddof=1) / np.sqrt(x.size) if x.size > 1 else 0.0)
    return (float(x.mean() - half), float(x.mean() + half))


def mcnemar_exact(lost: int, gained: int) -> float:
    flips = lost + gained
    return 1.0 if flips == 0 else float(binomtest(lost, flips, 0.5).pvalue)


def paired_bootstrap(diffs: np.ndarray, samples: int) -> float:
    """Two-sided p-value that the mean paired difference is 0."""
    if diffs.size == 0 or not np.any(diffs):
        return 1.0
    rng = np.random.default_rng(_BOOTSTRAP_SEED)
    means = np.empty(samples)
    for start in range(0, samples, 1000):  # bounded memory for large tasks
        n = min(1000, samples - start)
        means[start:start + n] = diffs[rng.integers(0, diffs.size, (n, diffs.size))].mean(axis=1)
    return float(min(1.0, 2 * min(np.mean(means <= 0), np.mean(means >= 0))))


def compare(task: str, metric: str, baseline: str, base_samples: list[Sample], candidate: str,
            cand_samples: list[Sample], config: RegressionConfig) -> Comparison:
    base = {s.doc_hash: s for s in base_samples}
    pairs = [(base[s.doc_hash], s) for s in cand_samples if s.doc_hash in base]
    b = np.array([p[0].correct for p in pairs], dtype=np.float64)
    c = np.array([p[1].correct for p in pairs], dtype=np.float64)
    lost = tuple(cs.doc_id for bs, cs in pairs if bs.correct > cs.correct)
    gained = tuple(cs.doc_id for bs, cs in pairs if bs.correct < cs.correct)
    if _binary(b) and _binary(c):
        test, p = "mcnemar-exact", mcnemar_exact(len(lost), len(gained))
    else:
        test, p = "paired-bootstrap", paired_bootstrap(b - c, config.bootstrap_samples)
    base_score = float(b.mean()) if pairs else 0.0
    cand_score = float(c.mean()) if pairs else 0.0
    drop = 100.0 * (base_score - cand_score)
    return Comparison(task, metric, baseline, candidate, len(pairs), base_score, cand_score,
                      drop, p, test, lost, gained,
                      alert=bool(pairs) and drop >= config.min_drop_points and p < config.alpha)
