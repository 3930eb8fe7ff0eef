"""Policy filters: packs of rules on prompts and streamed outputs, PII detectors, and the hook for
a moderation model. Host-side: no JAX."""

from jaxserve.safety.classifier import Classifier
from jaxserve.safety.policy import InputDecision, Pack, PolicySet, load_policy
from jaxserve.safety.rules import Intervention, Rule
from jaxserve.safety.text_filter import FilterResult, TextFilter

__all__ = ["Classifier", "FilterResult", "InputDecision", "Intervention", "Pack", "PolicySet",
           "Rule", "TextFilter", "load_policy"]
