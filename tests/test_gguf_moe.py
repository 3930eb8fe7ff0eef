"""Mixtures of experts from GGUF files as llama.cpp's converter writes them (Qwen3-MoE's `qwen3moe`,
Mixtral's `llama` with experts), against HF transformers on the same weights.

tests/fixtures/gguf/<arch>/ holds model.gguf (F16, each layer's experts stacked in one tensor per
projection) written by tools/make_gguf_moe_fixtures.py from a tiny random HF model, with HF's
logits and greedy tokens on it. jaxserve loads the file as a user would: logits within 1e-4 and
HF's 32 greedy tokens through one engine with chunked prefill, prefix caching and preemption.
Quantized expert tensors (Q8_0, Q4_0) dequantize at load to gguf's own dequantization.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from jaxserve.model_registry import ModelSpec
from tests.test_model_families import _greedy, _prompt_logits, engine_args

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gguf"
ARCHS = ["qwen3moe", "mixtral"]


def _expected(arch: str) -> dict:
    return json.loads((FIXTURES / arch / "expected.json").read_text())


def test_fixtures_bind():
    for arch in ARCHS:
        exp = _expected(arch)
        assert all(diff > 1e-2 for diff in exp["binding"].values()), exp["binding"]
        assert exp["min_route_gap"] > 1e-3 and exp["min_top2_gap"] > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_mixture_gives_hf_logits_and_greedy_tokens(arch):
    from jaxserve.entrypoints.llm import LLM

    exp = _expected(arch)
    llm = LLM(str(FIXTURES / arch / "model.gguf"), **engine_args())
    config = llm.engine.runner.config
    assert (config.architecture, config.num_experts, config.experts_per_token,
            config.norm_topk_prob, config.dense_layers) == (
        {"qwen3moe": "qwen3_moe", "mixtral": "mixtral"}[arch], 4, 2, True, ())
    np.testing.assert_allclose(_prompt_logits(llm.engine, exp["prompts"][0]),
                               np.load(FIXTURES / arch / "logits.npy"), atol=1e-4, rtol=0)
    got = _greedy(llm, exp["prompts"][:1]) + _greedy(llm, exp["prompts"][1:])
    assert got == exp["greedy"]
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 16 and stats.num_preemptions > 0, stats


def _requantize_experts(src: Path, dst: Path, qtype: GGMLQuantizationType) -> None:
    """The same file with its stacked expert tensors quantized (llama-quantize's result)."""
    reader = GGUFReader(str(src))
    w = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        data = quants.dequantize(t.data, t.tensor_type)
        if "_exps" in t.name:
            w.add_tensor(t.name, quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# The largest error per weight, as a fraction of its block's largest magnitude: half of Q8_0's
# step (amax / 127); Q4_0's 16 levels from -8 d to 7 d (d = amax / 8) clip +amax by a whole step;
# both plus the scale's own float16 rounding (2^-11 of amax at most).
@pytest.mark.parametrize("qtype, bound", [(GGMLQuantizationType.Q8_0, 0.5 / 127),
                                          (GGMLQuantizationType.Q4_0, 1 / 8)])
def test_quantized_expert_tensors_dequantize_at_load(tmp_path, qtype, bound):
    from jaxserve.weights import load_host

    src = FIXTURES / "qwen3moe" / "model.gguf"
    dst = tmp_path / f"{qtype.name}.gguf"
    _requantize_experts(src, dst, qtype)
    assert {t.tensor_type for t in GGUFReader(str(dst)).tensors if "_exps" in t.name} == {qtype}
    _, want = load_host(ModelSpec("f16", "gguf", src))
    config, got = load_host(ModelSpec("q", "gguf", dst))
    assert config.num_experts == 4
    for proj in ("gate_proj", "up_proj", "down_proj"):
        original = want["moe"][proj]  # [S, E, in, out]
        # gguf's own round trip of the [E, out, in] rows, back in the tree's layout.
        rows = original.swapaxes(-1, -2)
        ref = quants.dequantize(quants.quantize(rows, qtype), qtype).swapaxes(-1, -2)
        np.testing.assert_array_equal(got["moe"][proj], ref)
        # And within the format's step of the original: a block of 32 along `in`.
        blocks = np.abs(rows).reshape(*rows.shape[:-1], -1, 32).max(-1, keepdims=True)
        err = np.abs(ref - original).swapaxes(-1, -2).reshape(blocks.shape[:-1] + (32,))
        assert (err <= blocks * (bound + 2.0 ** -11)).all(), proj
    np.testing.assert_array_equal(got["layers"]["q_proj"], want["layers"]["q_proj"])
