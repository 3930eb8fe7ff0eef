"""Usage and cost: the `cost` (USD) a response's usage object carries when the model has prices
(`jaxserve.gateway.pricing`: the model config's [pricing] table)."""

from __future__ import annotations

from jaxserve.gateway.pricing import (Pricing, parse_pricing,  # noqa: F401 - the gateway's API
                                      pricing_for)  # noqa: F401


def with_cost(usage: dict, pricing: Pricing | None) -> dict:
    """An OpenAI usage object ({"prompt_tokens", "completion_tokens", ...}) with "cost" added
    when there are prices; its prompt_tokens_details.cached_tokens at the cached rate."""
    if pricing is None:
        return usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {**usage, "cost": pricing.cost(usage["prompt_tokens"], usage["completion_tokens"],
                                          cached)}
