"""The hook for a real moderation model: `Classifier` (text in, labels and scores out), loaded by
dotted path from the policy file and called on its own executor with a timeout.

A call that times out or raises is decided by the classifier's `on_error`: "block" (fail closed,
the default: a provider that promised moderation does not serve unmoderated text because the
moderator is slow) or "allow" (fail open). Either way it is recorded as an intervention of the
rule `classifier:NAME` (action block, or flag when allowed), so failures show in the metrics.
A timed-out call cannot be killed: it keeps its worker thread until it returns, and calls queued
behind it time out in turn; `workers` sets how many calls run at once.

So that one tenant cannot fill the workers and have every other tenant's calls time out (review
a70e490, M9), each tenant has at most `max_calls_per_tenant` calls queued or running at a time (a
timed-out call keeps its slot until it really returns): its next call waits for one of its own,
at most timeout_s, and is then refused with a 429 (RateLimitExceeded) rather than decided by
on_error. A text longer than `max_input_chars` is never sent: it is blocked, whatever on_error
says (a size no moderation call is made for is not let through).
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import logging
import math
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping

from jaxserve.errors import ConfigError, RateLimitExceeded

log = logging.getLogger(__name__)


class Classifier(abc.ABC):
    """Subclass this and name the class in the policy file:

        [classifier.tox]
        class = "mypackage.moderation.ToxicityClassifier"   # or "mypackage.moderation:Toxicity..."
        args = { model_dir = "/models/tox" }                # keyword arguments of __init__

    `classify` runs on a worker thread (it may block: a model call, an HTTP request). Return a
    score per label; rules compare them with their `threshold` (`score >= threshold` matches)."""

    @abc.abstractmethod
    def classify(self, text: str) -> Mapping[str, float]:
        ...

    def close(self) -> None:
        """Called once when the policy is closed (server shutdown)."""


@dataclass(frozen=True)
class ClassifierResult:
    scores: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None  # "timeout" or the exception, when the call failed
    oversized: bool = False  # longer than max_input_chars: not sent, always blocks


def load_class(path: str) -> type:
    """`pkg.module.Name` or `pkg.module:Name` -> the object (ConfigError naming what is missing)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"'{path}' is not a dotted path (package.module.Name)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import {module_name}: {e}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{module_name} has no attribute {attr!r}") from None


class ClassifierRunner:
    """One configured classifier: its instance, its executor and its failure policy."""

    def __init__(self, name: str, cls_path: str, args: Mapping[str, Any], timeout_s: float,
                 on_error: str, workers: int, max_calls_per_tenant: int = 1,
                 max_input_chars: int = 100_000):
        cls = load_class(cls_path)
        if not (isinstance(cls, type) and issubclass(cls, Classifier)):
            raise ConfigError(f"{cls_path} is not a subclass of jaxserve.safety.Classifier")
        try:
            self.instance = cls(**args)
        except Exception as e:  # noqa: BLE001 - a user's class: report what it raised
            raise ConfigError(f"{cls_path}(**args) raised {type(e).__name__}: {e}") from None
        self.name = name
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.max_calls_per_tenant = max_calls_per_tenant
        self.max_input_chars = max_input_chars
        self._executor = ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix=f"classifier-{name}")
        # Per event loop (asyncio semaphores belong to one), per tenant: its calls' slots.
        self._slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _slot(self, loop, tenant: str) -> asyncio.Semaphore:
        slots = self._slots.setdefault(loop, {})
        if tenant not in slots:
            slots[tenant] = asyncio.Semaphore(self.max_calls_per_tenant)
        return slots[tenant]

    async def classify(self, text: str, tenant: str = "") -> ClassifierResult:
        """Scores of `text` for one of `tenant`'s requests; RateLimitExceeded (429) when the
        tenant's calls stay at max_calls_per_tenant for timeout_s."""
        if len(text) > self.max_input_chars:
            return ClassifierResult(error=f"longer than {self.max_input_chars} characters",
                                    oversized=True)
        loop = asyncio.get_running_loop()
        slot = self._slot(loop, tenant)
        try:
            await asyncio.wait_for(slot.acquire(), self.timeout_s)
        except TimeoutError:
            raise RateLimitExceeded(
                f"too many calls of this tenant to the classifier {self.name!r} at once (at most "
                f"{self.max_calls_per_tenant}); retry later", retry_after=self.timeout_s) from None
        call = self._executor.submit(self.instance.classify, text)
        call.add_done_callback(lambda _: _release(loop, slot))  # when it really returns
        try:
            scores = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(call)),
                                            self.timeout_s)
            return ClassifierResult(_checked_scores(scores))
        except TimeoutError:
            call.cancel()  # still queued: it never runs
            log.warning("classifier %s timed out after %.3g s", self.name, self.timeout_s)
            return ClassifierResult(error="timeout")
        except Exception as e:  # noqa: BLE001 - a user's model failing decides by on_error
            log.warning("classifier %s failed: %s: %s", self.name, type(e).__name__, e)
            return ClassifierResult(error=f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.instance.close()


def _release(loop, slot: asyncio.Semaphore) -> None:
    try:
        loop.call_soon_threadsafe(slot.release)
    except RuntimeError:  # the loop is closed, and its semaphores with it
        pass


def _checked_scores(scores) -> dict[str, float]:
    if not isinstance(scores, Mapping):
        raise TypeError(f"classify() must return a mapping of label to score, got "
                        f"{type(scores).__name__}")
    out = {}
    for label, score in scores.items():
        if not isinstance(label, str) or isinstance(score, bool) \
                or not isinstance(score, (int, float)) or math.isnan(score):
            raise TypeError(f"classify() returned {label!r}: {score!r}; want str: number")
        out[label] = float(score)
    return out
