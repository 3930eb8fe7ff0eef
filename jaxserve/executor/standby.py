"""Weights to host memory and back, for a sleeping engine (POST /sleep level 2, /wake_up).

Each device array is copied into the same devices' host memory ("pinned_host": on a GPU or TPU
that is page-locked host RAM the device copies from at full bandwidth; on a CPU backend it is the
same RAM, so only the bookkeeping moves) with the same sharding, and the device copy is deleted.
Waking puts every leaf back with the sharding it had, so the programs compiled for those
shardings take the arrays as they are: waking compiles nothing. Leaves that are not JAX arrays
(host-side tables) stay where they are.
"""

from __future__ import annotations

import jax

HOST_MEMORY = "pinned_host"


def to_host(tree) -> tuple[object, list]:
    """(the tree with its device arrays in host memory, each leaf's device sharding or None);
    the device copies are deleted once the host copies exist."""
    leaves, treedef = jax.tree.flatten(tree)
    shardings = [x.sharding if isinstance(x, jax.Array) else None for x in leaves]
    host = [jax.device_put(x, s.with_memory_kind(HOST_MEMORY)) if s is not None else x
            for x, s in zip(leaves, shardings)]
    jax.block_until_ready(host)
    for leaf, s in zip(leaves, shardings):
        if s is not None:
            leaf.delete()
    return treedef.unflatten(host), shardings


def to_device(host, shardings: list):
    """The tree `to_host` made, back on the devices with its former shardings; the host copies
    are deleted."""
    leaves, treedef = jax.tree.flatten(host)
    tree = [jax.device_put(x, s) if s is not None else x for x, s in zip(leaves, shardings)]
    jax.block_until_ready(tree)
    for leaf, s in zip(leaves, shardings):
        if s is not None:
            leaf.delete()
    return treedef.unflatten(tree)
