"""Device memory for several versions: each version's KV pool is its `kv_cache_memory_fraction`
of the fleet's memory budget (the free memory measured when the fleet was made), so fractions
split one budget instead of each taking a share of whatever the versions before it left. Before
anything is allocated, a version's weights + KV pool are checked against the memory free now: a
version that does not fit is an InsufficientMemory naming the numbers, not an out-of-memory crash
half-way through loading.

A version with data_parallel_size n is n replicas, each with its own copy of the weights and its
own pool: its KV share of the budget is split between them, and all n copies count against the
budget (on a CPU they all live in the host's memory; on accelerators the budget is the first
device's, which makes the count a conservative one).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config import EngineConfig
from jaxserve.errors import InsufficientMemory


@dataclass(frozen=True)
class MemoryPlan:
    weights_bytes: int
    kv_cache_bytes: int
    num_pages: int  # each replica's pool, the null page included (CacheConfig.num_pages)
    replicas: int = 1

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes

    def to_dict(self) -> dict:
        return {"weights_bytes": self.weights_bytes, "kv_cache_bytes": self.kv_cache_bytes,
                "num_pages": self.num_pages, "replicas": self.replicas}


def plan_memory(config: EngineConfig, budget_bytes: int) -> MemoryPlan:
    from jaxserve.executor.runner import kv_page_bytes, num_pages_for
    from jaxserve.weights import param_bytes

    replicas = config.parallel.data_parallel_size
    num_pages = num_pages_for(config.model, config.cache, config.scheduler,
                              memory_bytes=budget_bytes // replicas)
    page = kv_page_bytes(config.model, config.cache.page_size,
                         config.cache.dtype or config.model.dtype)
    return MemoryPlan(replicas * param_bytes(config.model), replicas * num_pages * page,
                      num_pages, replicas)


def check_fits(name: str, plan: MemoryPlan, free_bytes: int, reserved_bytes: int,
               headroom_bytes: int) -> None:
    """`reserved_bytes`: what versions still loading will take (planned, not yet allocated);
    `headroom_bytes`: kept free for activations and compilation."""
    available = free_bytes - reserved_bytes - headroom_bytes
    if plan.total_bytes > available:
        mib = 1 << 20
        raise InsufficientMemory(
            f"version {name} does not fit: it needs {plan.total_bytes / mib:.0f} MiB (weights "
            f"{plan.weights_bytes / mib:.0f} MiB + KV cache {plan.kv_cache_bytes / mib:.0f} MiB, "
            f"{plan.num_pages} pages) but {max(available, 0) / mib:.0f} MiB are free ("
            f"{free_bytes / mib:.0f} MiB free, {reserved_bytes / mib:.0f} MiB promised to versions "
            f"loading, {headroom_bytes / mib:.0f} MiB headroom); unload a version or lower its "
            f"kv_cache_memory_fraction / num_pages / max_model_len")
