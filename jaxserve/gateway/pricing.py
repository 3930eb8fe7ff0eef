"""Per-model prices from the model's config TOML (configs/NAME.toml), read by the gateway (the
usage `cost`) and the fleet (a version's manifest and the canary gate's cost criterion):

    [pricing]
    prompt_per_1m = 0.15        # USD per million prompt tokens
    completion_per_1m = 0.60    # USD per million completion tokens
    cached_prompt_per_1m = 0.075  # optional: per million prompt tokens read from the prefix
                                  # cache (either tier); default: prompt_per_1m

A request's cached prompt tokens are those its usage reports (OpenAI's
`prompt_tokens_details.cached_tokens`, Anthropic's `cache_read_input_tokens`); the rest of its
prompt, tokens written under a new cache pin (`cache_creation_input_tokens`) included, is charged
at `prompt_per_1m`.

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
    cached_prompt_per_1m: float | None = None  # None: cached tokens cost prompt_per_1m

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
        """USD for a request; `cached_tokens` of its prompt tokens were read from the cache."""
        cached = min(max(cached_tokens, 0), prompt_tokens)
        cached_rate = (self.prompt_per_1m if self.cached_prompt_per_1m is None
                       else self.cached_prompt_per_1m)
        return ((prompt_tokens - cached) * self.prompt_per_1m + cached * cached_rate
                + completion_tokens * self.completion_per_1m) / 1e6

    def to_dict(self) -> dict:
        """The prices as configured (the optional cached rate only when it is set)."""
        d = {"prompt_per_1m": self.prompt_per_1m, "completion_per_1m": self.completion_per_1m}
        if self.cached_prompt_per_1m is not None:
            d["cached_prompt_per_1m"] = self.cached_prompt_per_1m
        return d


def pricing_for(model: str) -> Pricing | None:
    """The registered model's prices; None when it has none (or is a path, not a name)."""
    entry = registry().get(model)
    if entry is None or not entry.pricing:
        return None
    return parse_pricing(entry.pricing, f"{entry.config_path}: pricing")


def parse_pricing(table: dict, where: str) -> Pricing:
    fields = ("prompt_per_1m", "completion_per_1m", "cached_prompt_per_1m")
    unknown = set(table) - set(fields)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: {list(fields)}")
    values = {}
    for f in fields:
        v = table.get(f)
        if f == "cached_prompt_per_1m" and v is None:
            continue  # optional
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ConfigError(f"{where}.{f}: must be a number >= 0 (USD per million tokens), "
                              f"got {v!r}")
        values[f] = float(v)
    return Pricing(**values)
