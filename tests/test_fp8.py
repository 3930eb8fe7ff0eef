"""FP8 block-quantized checkpoints (jaxserve.weights.fp8) against HF transformers on the same file.

tests/fixtures/quantized/qwen3_moe_fp8 is the Qwen3-MoE fixture quantized by transformers' own
FineGrainedFP8 op and read back by transformers (tools/make_fp8_fixture.py): jaxserve must
dequantize to exactly HF's weights, and serve HF's logits (1e-4) and greedy tokens through the
same engine shape as tests/test_model_families.py. Against the f32 original, each weight is within
e4m3's rounding of its block."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxserve.errors import ConfigError, WeightsError
from jaxserve.weights import fp8
from jaxserve.weights.architectures import config_from_hf
from jaxserve.weights.safetensors import load_hf
from tests.test_model_families import _greedy, _prompt_logits, engine_args

FP8 = Path(__file__).resolve().parent / "fixtures" / "quantized" / "qwen3_moe_fp8"
ORIGINAL = Path(__file__).resolve().parent / "fixtures" / "models" / "qwen3_moe"


@pytest.fixture(scope="module")
def loaded():
    return load_hf(FP8)[1], load_hf(ORIGINAL)[1]


def test_dequantized_weights_are_hfs(loaded):
    params, _ = loaded
    hf = np.load(FP8 / "hf_dequantized.npz")
    q = params["layers"]["q_proj"][0]
    np.testing.assert_array_equal(q.reshape(q.shape[0], -1).T,
                                  hf["model.layers.0.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(params["dense_mlp"]["down_proj"][0].T,
                                  hf["model.layers.1.mlp.down_proj.weight"])
    # HF fuses an expert's gate and up rows ([E, 2I, H]); layer 2 is the second sparse layer.
    gate_up = hf["model.layers.2.mlp.experts.gate_up_proj"]
    inter = gate_up.shape[1] // 2
    np.testing.assert_array_equal(params["moe"]["gate_proj"][1].transpose(0, 2, 1),
                                  gate_up[:, :inter])
    np.testing.assert_array_equal(params["moe"]["up_proj"][1].transpose(0, 2, 1),
                                  gate_up[:, inter:])


def test_weights_within_e4m3_rounding_of_the_original(loaded):
    params, original = loaded
    block = json.loads((FP8 / "expected.json").read_text())["weight_block_size"]
    for group in ("layers", "moe", "dense_mlp"):
        for name, w in params[group].items():
            w0 = original[group][name]
            if name.endswith("_proj") and name != "router":
                # e4m3 keeps 3 mantissa bits: a half step is 2^-4 of the value; below 2^-6 of the
                # block's scale (subnormals) steps are 2^-9 of it. Scale: block's amax / 448.
                amax = np.abs(w0).max()
                bound = np.abs(w0) * 2.0 ** -4 + amax / 448 * 2.0 ** -10
                assert (np.abs(w - w0) <= bound).all(), (group, name)
                assert not np.array_equal(w, w0), (group, name)  # it was quantized
            else:
                np.testing.assert_array_equal(w, w0)  # norms and routers are not
    assert block == [16, 16]


def test_serves_hfs_logits_and_greedy_tokens():
    from jaxserve.entrypoints.llm import LLM

    exp = json.loads((FP8 / "expected.json").read_text())
    llm = LLM(str(FP8), **engine_args())
    np.testing.assert_allclose(_prompt_logits(llm.engine, exp["prompts"][0]),
                               np.load(FP8 / "logits.npy"), atol=1e-4, rtol=0)
    assert _greedy(llm, exp["prompts"]) == exp["greedy"]


def _config(**quantization) -> dict:
    cfg = json.loads((FP8 / "config.json").read_text())
    return {**cfg, "quantization_config": quantization}


@pytest.mark.parametrize("quantization, says", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8"}, "no weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme 'static'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size [128, 0]"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "kv_cache_scheme": "fp8"},
     "keys ['kv_cache_scheme']"),
])
def test_other_quantizations_are_refused_in_one_line(quantization, says):
    with pytest.raises(ConfigError, match="not supported") as e:
        config_from_hf(_config(**quantization), "m")
    assert says in str(e.value) and "\n" not in str(e.value)


def test_fp8_tensor_without_scales_is_refused():
    weight = np.ones((4, 4), np.float32).astype(ml_dtypes.float8_e4m3fn)
    read = fp8.dequantizing({"w.weight": weight}.__getitem__, {"w.weight"}, None)
    with pytest.raises(WeightsError, match="without a weight_scale_inv"):
        read("w.weight")


def test_partial_last_block_and_e8m0_scales():
    # DeepSeek-V3's kv_a_proj_with_mqa: 576 rows in blocks of 128 -> 5 row blocks, the last half.
    q = np.ones((6, 4), np.float32).astype(ml_dtypes.float8_e4m3fn)
    scales = np.array([[2.0], [3.0]], np.float32)
    out = fp8.dequantize(q, scales, (4, 4))
    np.testing.assert_array_equal(out[:, 0], [2, 2, 2, 2, 3, 3])
    np.testing.assert_array_equal(fp8.dequantize(q, np.array([[128], [126]], np.uint8),
                                                 (4, 4))[:, 0], [2, 2, 2, 2, 0.5, 0.5])
    with pytest.raises(WeightsError, match="want"):
        fp8.dequantize(q, np.ones((1, 1), np.float32), (4, 4))
