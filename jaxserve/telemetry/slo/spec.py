"""The SLO file (TOML; configs/slo.example.toml):

    window_days = 30                 # the error budget's period

    [[slo]]
    name = "interactive"             # a label value: letters, digits, '_', '.', '-'
    tier = "interactive"             # whose traffic: tier, route and/or model_name (all: none)
    availability = 0.999             # good / (good + bad): 5xx bad, 4xx and clients gone left out
    ttft_p95_s = 0.5                 # 95 % of first tokens within 0.5 s (a histogram bucket bound)
    itl_p95_s = 0.1                  # 95 % of inter-token gaps within 0.1 s (likewise)
    stream_completion = 0.999        # streams that reached a terminal event / streams started

Each objective becomes an error budget: 1 - target (for the latency ones 5 %, the p95's share of
slow events). A bad value is one ConfigError naming the file, the SLO and the field.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxserve.errors import ConfigError
from jaxserve.telemetry import sli

TIERS = ("interactive", "standard", "batch")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# SLI name -> (its field in the file, the target of a latency objective's share of fast events)
RATIO_FIELDS = {"availability": "availability", "stream_completion": "stream_completion"}
LATENCY_FIELDS = {"ttft": "ttft_p95_s", "itl": "itl_p95_s"}
P95 = 0.95


@dataclass(frozen=True)
class Objective:
    sli: str  # "availability" | "ttft" | "itl" | "stream_completion"
    target: float  # the share of good events (availability 0.999; a p95 latency 0.95)
    threshold_s: float | None = None  # a latency objective's bound (a bucket bound)

    @property
    def budget(self) -> float:
        """The error budget: the share of events that may be bad."""
        return 1.0 - self.target


@dataclass(frozen=True)
class SLO:
    name: str
    objectives: tuple[Objective, ...]
    tier: str | None = None
    route: str | None = None
    model_name: str | None = None

    @property
    def matchers(self) -> dict[str, str]:
        """The SLI series' labels this SLO's traffic has."""
        return {k: v for k, v in (("tier", self.tier), ("route", self.route),
                                  ("model_name", self.model_name)) if v is not None}


@dataclass(frozen=True)
class SLOSpec:
    slos: tuple[SLO, ...]
    window_days: int = 30


def load_slo_file(path: str | Path) -> SLOSpec:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the SLO file: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return parse_slo_spec(data, str(path))


def parse_slo_spec(data: dict[str, Any], where: str) -> SLOSpec:
    unknown = set(data) - {"window_days", "slo"}
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: "
                          f"['slo', 'window_days']")
    window = data.get("window_days", 30)
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= 366:
        raise ConfigError(f"{where}.window_days: must be an integer in [1, 366], got {window!r}")
    tables = data.get("slo")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict)
                                                              for t in tables):
        raise ConfigError(f"{where}: no SLO defined; add [[slo]] tables")
    slos = [_slo(t, f"{where}: slo[{i}]") for i, t in enumerate(tables)]
    names = [s.name for s in slos]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: SLO names must be unique, got {names}")
    return SLOSpec(tuple(slos), window)


def _slo(table: dict[str, Any], where: str) -> SLO:
    known = {"name", "tier", "route", "model_name", *RATIO_FIELDS.values(),
             *LATENCY_FIELDS.values()}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    name = table.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{where}.name: must be a name (1-64 letters, digits, '_', '.', '-'), "
                          f"got {name!r}")
    where = f"{where} ({name})"
    tier = table.get("tier")
    if tier is not None and tier not in TIERS:
        raise ConfigError(f"{where}.tier: must be one of {list(TIERS)}, got {tier!r}")
    selectors = {}
    for f in ("route", "model_name"):
        v = table.get(f)
        if v is not None and (not isinstance(v, str) or not _NAME.match(v)):
            raise ConfigError(f"{where}.{f}: must be a route or model name, got {v!r}")
        selectors[f] = v
    objectives = []
    for sli_name, f in RATIO_FIELDS.items():
        if f in table:
            objectives.append(Objective(sli_name, _target(table[f], f"{where}.{f}")))
    for sli_name, f in LATENCY_FIELDS.items():
        if f in table:
            objectives.append(Objective(sli_name, P95, _bound(table[f], f"{where}.{f}")))
    if not objectives:
        raise ConfigError(f"{where}: no objective; give one or more of "
                          f"{sorted({*RATIO_FIELDS.values(), *LATENCY_FIELDS.values()})}")
    return SLO(name, tuple(objectives), tier, **selectors)


def _target(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError(f"{where}: must be a fraction in (0, 1), e.g. 0.999, got {value!r}")
    return float(value)


def _bound(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not any(
            math.isclose(value, b) for b in sli.LATENCY_BUCKETS):
        raise ConfigError(f"{where}: must be one of the latency histograms' bucket bounds "
                          f"{list(sli.LATENCY_BUCKETS)} (seconds), got {value!r}")
    return next(b for b in sli.LATENCY_BUCKETS if math.isclose(value, b))
