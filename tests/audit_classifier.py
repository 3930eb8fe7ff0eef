"""A `jaxserve.safety.Classifier` for tests/test_audit_server.py, loaded by dotted path from its
policy file: it scores a word's presence, and is slow on another, so the server's hook (the
executor, the timeout, the decision as a rule's action) runs end to end without a real
moderation model."""

from __future__ import annotations

import time

from jaxserve.safety import Classifier


class WordClassifier(Classifier):
    def __init__(self, block: str, flag: str, slow: str, delay_s: float):
        self.words = {"block": block, "flag": flag}
        self.slow, self.delay_s = slow, delay_s

    def classify(self, text: str) -> dict[str, float]:
        if self.slow in text:
            time.sleep(self.delay_s)
        return {label: float(word in text.lower()) for label, word in self.words.items()}
