"""SamplingParams validation (the device sampler is tests/test_sampler.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve.errors import InvalidRequest
from jaxserve.core.sampling_params import SamplingParams

# ---------------------------------------------------------------------------------------------
# SamplingParams validation

BAD_PARAMS = [
    ("n", 0), ("n", 1.0), ("n", "2"), ("n", True),
    ("temperature", -0.1), ("temperature", True), ("temperature", "1"),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1), ("top_p", None),
    ("top_k", -2), ("top_k", 1.5), ("top_k", False),
    ("min_p", -0.01), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 3),
    ("frequency_penalty", "0"),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("seed", 1.5), ("seed", "7"), ("seed", True), ("seed", 2**64),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", "5"), ("max_tokens", 5.0),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", None),
    ("stop", 3), ("stop", ["a", 1]), ("stop", [""]), ("stop", {"a": 1}),
    ("stop_token_ids", 5), ("stop_token_ids", [1, -1]), ("stop_token_ids", ["1"]),
    ("stop_token_ids", list(range(65))),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", True),
    ("skip_special_tokens", None), ("include_stop_str_in_output", 0),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS)
def test_bad_value_is_rejected_naming_the_field(field, value):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    assert field in str(err.value)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.logprobs) == (1, 1.0, 1.0, 0, 16,
                                                                                  None)
    assert not p.is_greedy and not p.uses_penalties and not p.uses_top_filters
    q = SamplingParams(temperature=0, stop="###", stop_token_ids=[2, 3], max_tokens=None,
                       min_tokens=100, seed=-1, top_k=-1)
    assert q.is_greedy and isinstance(q.temperature, float)
    assert q.stop == ("###",) and q.stop_token_ids == (2, 3)
    assert not q.uses_top_filters  # greedy: filters never change the argmax
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(repetition_penalty=1.2).uses_penalties
    assert SamplingParams(top_p=0.9).uses_top_filters
    assert hash(q) == hash(q.replace())


def test_replace_validates_again():
    p = SamplingParams(max_tokens=8, min_tokens=4)
    assert p.replace(max_tokens=100).max_tokens == 100
    with pytest.raises(InvalidRequest) as err:
        p.replace(max_tokens=2)
    assert err.value.param == "min_tokens"


def test_sequence_seeds():
    p = SamplingParams(seed=2**64 - 1)
    assert [p.sequence_seed(i) for i in range(3)] == [2**64 - 1, 0, 1]
    assert SamplingParams(seed=-1).sequence_seed() == 2**64 - 1
    unseeded = SamplingParams()
    assert 0 <= unseeded.sequence_seed() < 2**64


def test_parsing_a_request_imports_no_jax():
    code = ("import sys, jaxserve.core.sampling_params, jaxserve.entrypoints.serving.protocol, "
            "jaxserve.structured; "
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
