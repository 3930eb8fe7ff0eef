"""Per-model prices from the model's config TOML (configs/NAME.toml), read by the gateway (the
usage `cost`) and the fleet (a version's manifest and the canary gate's cost criterion):

    [pricing]
    prompt_per_1m = 0.15        # USD per million prompt tokens
    completion_per_1m = 0.60    # USD per million completion tokens

Host-side: no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.errors import ConfigError
from jaxserve.model_registry import registry


@dataclass(frozen=True)
class Pricing:
    prompt_per_1m: float
    completion_per_1m: float

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.prompt_per_1m
                + completion_tokens * self.completion_per_1m) / 1e6


def pricing_for(model: str) -> Pricing | None:
    """The registered model's prices; None when it has none (or is a path, not a name)."""
    entry = registry().get(model)
    if entry is None or not entry.pricing:
        return None
    return parse_pricing(entry.pricing, f"{entry.config_path}: pricing")


def parse_pricing(table: dict, where: str) -> Pricing:
    fields = ("prompt_per_1m", "completion_per_1m")
    unknown = set(table) - set(fields)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: {list(fields)}")
    values = {}
    for f in fields:
        v = table.get(f)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ConfigError(f"{where}.{f}: must be a number >= 0 (USD per million tokens), "
                              f"got {v!r}")
        values[f] = float(v)
    return Pricing(**values)
