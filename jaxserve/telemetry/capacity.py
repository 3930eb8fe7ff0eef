"""The capacity model: how many replicas a workload needs (`jaxserve capacity`, and the
`jaxserve:desired_replicas` gauge a KEDA ScaledObject scales on).

A replica's rates are measured on this engine and this hardware (`jaxserve capacity measure`):
prefill tokens per second at a full token budget, decode tokens per second at a full batch. A
workload asks for `rps` requests per second of `prompt_tokens` and `output_tokens` on average.
Each limit is taken on its own:

    prefill replicas = rps * prompt_tokens / (prefill_rate * (1 - headroom))
    decode replicas  = rps * output_tokens / (decode_rate  * (1 - headroom))

and the larger one binds (chunked prefill runs prompt chunks in the decode steps, so the two
overlap rather than add; their sum is printed as the bound for no overlap at all). `headroom` is
the share of every replica kept free for bursts and latency. Across `zones` zones, losing one
must leave enough: N replicas spread evenly keep N (z - 1) / z, so N = need * z / (z - 1),
rounded up per zone (z * ceil(need / (z - 1))); one zone has no such redundancy.

Host-side, no JAX: the metrics collector below reads the engines' token counters.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from prometheus_client.core import GaugeMetricFamily

from jaxserve.errors import ConfigError

MAX_WORKLOAD_LINES = 10_000_000  # a workload file is the operator's, still bounded
MAX_ZONES = 64


@dataclass(frozen=True)
class Rates:
    """One replica of one model on one machine, as measured."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    model: str | None = None  # what was measured (the version the gauge applies to)

    def __post_init__(self):
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class Workload:
    rps: float  # requests per second
    prompt_tokens: float  # per request, on average
    output_tokens: float
    requests: int | None = None  # how many requests the means come from (a JSONL file)

    def __post_init__(self):
        for name in ("rps", "prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")


@dataclass(frozen=True)
class Plan:
    prefill_replicas: float  # what each limit alone needs, with headroom, before zones
    decode_replicas: float
    zones: int

    @property
    def binding(self) -> str:
        return "prefill" if self.prefill_replicas >= self.decode_replicas else "decode"

    @property
    def need(self) -> float:
        return max(self.prefill_replicas, self.decode_replicas)

    @property
    def zone_factor(self) -> float:
        return self.zones / (self.zones - 1) if self.zones > 1 else 1.0

    @property
    def desired(self) -> float:
        """Unrounded, so that pods' gauges add up: need * z / (z - 1)."""
        return self.need * self.zone_factor

    @property
    def per_zone(self) -> int:
        """Replicas in each zone (all of them with one zone); at least one."""
        return max(1, math.ceil(self.need / max(self.zones - 1, 1) - 1e-9))

    @property
    def replicas(self) -> int:
        return self.per_zone * self.zones


def check_headroom(headroom: float) -> float:
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise ConfigError(f"headroom is a share of a replica in [0, 1), got {headroom!r}")
    return float(headroom)


def check_zones(zones: int) -> int:
    if not (isinstance(zones, int) and 1 <= zones <= MAX_ZONES):
        raise ConfigError(f"zones is a whole number in [1, {MAX_ZONES}], got {zones!r}")
    return zones


def plan(rates: Rates, workload: Workload, headroom: float, zones: int) -> Plan:
    usable = 1.0 - check_headroom(headroom)
    return Plan(workload.rps * workload.prompt_tokens / (rates.prefill_tokens_per_s * usable),
                workload.rps * workload.output_tokens / (rates.decode_tokens_per_s * usable),
                check_zones(zones))


def read_rates(path: Path) -> Rates:
    """A rates file as `jaxserve capacity measure` writes it (JSON)."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"{path}: not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a rates file is a JSON object")
    try:
        return Rates(data.get("prefill_tokens_per_s"), data.get("decode_tokens_per_s"),
                     data.get("model") if isinstance(data.get("model"), str) else None)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _tokens(line: dict, names: Sequence[str], where: str) -> int:
    for name in names:
        if name in line:
            value = line[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{where}: {name} must be a whole number >= 0")
            return value
    raise ConfigError(f"{where}: needs {' or '.join(names)}")


def read_workload(lines: Iterable[str], rps: float, source: str) -> Workload:
    """Means of a JSONL of requests: each line's prompt_tokens and completion_tokens (or
    output_tokens; the access log's lines have them), at `rps` requests per second."""
    count = prompt = output = 0
    for number, text in enumerate(lines, 1):
        if number > MAX_WORKLOAD_LINES:
            raise ConfigError(f"{source}: more than {MAX_WORKLOAD_LINES} lines")
        if not text.strip():
            continue
        where = f"{source}:{number}"
        try:
            line = json.loads(text)
        except ValueError:
            raise ConfigError(f"{where}: not JSON") from None
        if not isinstance(line, dict):
            raise ConfigError(f"{where}: a line is a JSON object")
        prompt += _tokens(line, ("prompt_tokens", "input_tokens"), where)
        output += _tokens(line, ("completion_tokens", "output_tokens"), where)
        count += 1
    if not count:
        raise ConfigError(f"{source}: no requests")
    return Workload(rps, prompt / count, output / count, count)


class CapacityCollector:
    """`jaxserve:desired_replicas{model_name}` and `jaxserve:capacity_replicas{model_name,
    limit}` (prefill, decode) from the same model, at the load each version served over the last
    `window_s` seconds (its prompt and generated tokens per second, summed over its replicas).
    The gauge is not rounded, so a fleet's pods add up: KEDA's query is their sum."""

    def __init__(self, stats: Callable[[], Mapping[str, Sequence[object]]], rates: Rates,
                 headroom: float, zones: int, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self._stats, self._rates, self._clock = stats, rates, clock
        self._headroom, self._zones = check_headroom(headroom), check_zones(zones)
        self._window_s = window_s
        self._samples: dict[str, deque] = {}  # version -> (time, prompt, generated) tokens

    def _applies(self, versions: Sequence[str]) -> list[str]:
        if self._rates.model in versions:
            return [self._rates.model]
        return list(versions) if len(versions) == 1 else []

    def _rates_of(self, version: str, prompt: int, generated: int) -> tuple[float, float]:
        now = self._clock()
        samples = self._samples.setdefault(version, deque())
        samples.append((now, prompt, generated))
        while len(samples) > 2 and now - samples[1][0] >= self._window_s:
            samples.popleft()  # keep one sample at least window_s old
        t0, p0, g0 = samples[0]
        seconds = now - t0
        return ((prompt - p0) / seconds, (generated - g0) / seconds) if seconds > 0 else (0, 0)

    def collect(self):
        desired = GaugeMetricFamily(
            "jaxserve:desired_replicas", "Replicas the capacity model asks for at the load this "
            "server served over the last minute (headroom and zones included; unrounded: sum "
            "it over the pods).", labels=["model_name"])
        limits = GaugeMetricFamily(
            "jaxserve:capacity_replicas", "Replicas each limit (prefill, decode) alone needs at "
            "that load, with headroom, before zones.", labels=["model_name", "limit"])
        stats = self._stats()
        for version in self._applies(sorted(stats)):
            per = stats[version]
            prompt_s, generated_s = self._rates_of(version, sum(s.prompt_tokens for s in per),
                                                   sum(s.generation_tokens for s in per))
            # rps 1 with the rates as the per-request sizes: the same formula, per second.
            p = plan(self._rates, Workload(1.0, prompt_s, generated_s), self._headroom,
                     self._zones)
            desired.add_metric([version], p.desired)
            limits.add_metric([version, "prefill"], p.prefill_replicas)
            limits.add_metric([version, "decode"], p.decode_replicas)
        yield from (desired, limits)
