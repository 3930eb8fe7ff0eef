"""The declared engine interface: AsyncEngine and ReplicaSet each provide every member of
ServingEngine, as the same kind of member (property, method, coroutine, async generator) with the
same signature."""

from __future__ import annotations

import inspect

import pytest

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.replicas import ReplicaSet
from jaxserve.core.serving_engine import ServingEngine

MEMBERS = sorted(n for n in vars(ServingEngine) if not n.startswith("_"))


def _kind(member) -> str:
    if isinstance(member, property):
        return "property"
    if inspect.isasyncgenfunction(member):
        return "async generator"
    if inspect.iscoroutinefunction(member):
        return "coroutine"
    return "method"


def _declared(member) -> inspect.Signature:
    return inspect.signature(member.fget if isinstance(member, property) else member)


def test_the_protocol_declares_what_the_front_ends_use():
    assert {"prepare", "admit", "generate", "abort", "abort_sequence", "check_fits", "stats",
            "replica_stats", "num_queued", "is_running", "is_stalled", "tokenizer",
            "max_model_len", "engine_thread_stack", "shutdown", "close", "load_seconds",
            "compile_seconds", "sleep", "wake_up", "sleeping_tags"} == set(MEMBERS)


@pytest.mark.parametrize("cls", [AsyncEngine, ReplicaSet])
@pytest.mark.parametrize("name", MEMBERS)
def test_engine_provides_the_member_with_its_signature(cls, name):
    declared = inspect.getattr_static(ServingEngine, name)
    assert name in {n for c in cls.__mro__ if c is not object for n in vars(c)}, (
        f"{cls.__name__} lacks {name}")
    provided = inspect.getattr_static(cls, name)
    # generate is declared as a plain def returning an AsyncIterator: an async generator does.
    want = "async generator" if name == "generate" else _kind(declared)
    assert _kind(provided) == want, f"{cls.__name__}.{name} is a {_kind(provided)}"
    assert _declared(provided) == _declared(declared), (
        f"{cls.__name__}.{name}{_declared(provided)} != ServingEngine.{name}"
        f"{_declared(declared)}")
