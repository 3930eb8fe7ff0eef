"""gpt-oss: its experts (router bias, clamped SwiGLU, expert biases) against a per-token loop written
from HF's GptOssExperts; its MXFP4 checkpoint (tools/make_mxfp4_fixture.py) against HF
transformers on the same file, through an engine that chunks, hits the prefix cache and preempts.
The bf16/f32 fixture's HF comparison is tests/test_model_families.py's (gpt_oss is one of its
families); the attention sinks are tests/test_ragged_paged_attention.py's."""

from __future__ import annotations

import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError
from jaxserve.executor.models import moe
from jaxserve.model_registry import ModelSpec
from jaxserve.weights import mxfp4

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MXFP4 = FIXTURES / "quantized" / "gpt_oss_mxfp4"
ORIGINAL = FIXTURES / "models" / "gpt_oss"


def _config() -> ModelConfig:
    return ModelConfig(name="gpt-oss", vocab_size=16, hidden_size=8, intermediate_size=12,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, num_experts=5,
                       experts_per_token=2, moe_intermediate_size=6, moe_bias=True,
                       swiglu_limit=1.5, swiglu_alpha=1.702)


def test_experts_are_hf_s_gpt_oss_experts():
    """Router logits + bias, top-2 by logit, softmax over the two; each expert's clamped SwiGLU
    with its biases (HF's GptOssExperts._apply_gate); on the CPU's tiles and on ragged_dot."""
    c = _config()
    params = nn.unbox(moe.boxed_init(c, jax.random.key(0)))["moe"]
    p = {k: np.array(v[0]) * (10.0 if k.endswith("_bias") else 1.0) for k, v in params.items()}
    x = 2.0 * np.random.default_rng(0).normal(size=(23, c.hidden_size)).astype(np.float32)
    run = jax.jit(moe.experts_mlp, static_argnums=(2, 3, 4))
    got = np.asarray(run(jnp.asarray(x), p, c, jax.nn.silu, jax.lax.Precision.HIGHEST))

    want = np.zeros_like(x, np.float64)
    clamped = 0
    for t, row in enumerate(x.astype(np.float64)):
        logits = row @ p["router"] + p["router_bias"]
        top = np.argsort(-logits)[:2]
        weights = np.exp(logits[top] - logits[top].max())
        for e, w in zip(top, weights / weights.sum()):
            gate = row @ p["gate_proj"][e] + p["gate_bias"][e]
            up = row @ p["up_proj"][e] + p["up_bias"][e]
            clamped += int((gate > 1.5).sum() + (np.abs(up) > 1.5).sum())
            gate, up = np.minimum(gate, 1.5), np.clip(up, -1.5, 1.5)
            h = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
            want[t] += w * (h @ p["down_proj"][e] + p["down_bias"][e])
    assert clamped > 20  # the clamp binds
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    sizes = jnp.asarray([3, 0, 9, 1, 7], jnp.int32)
    args = (sizes, p, moe.gated(c, jax.nn.silu), jax.lax.Precision.HIGHEST)
    rows = jnp.asarray(x[:20])
    np.testing.assert_allclose(moe.tiled_grouped_mlp(rows, *args),
                               moe.ragged_grouped_mlp(rows, *args), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- MXFP4

def test_mxfp4_codes_and_scales_as_released():
    """Two FP4 e2m1 codes per byte, the low nibble first (transformers' convert_moe_packed_tensors
    reads them so: tools/make_mxfp4_fixture.py checks it on every expert tensor); a block of 32
    values scaled by 2 ** (scale - 127)."""
    blocks = np.zeros((1, 1, 16), np.uint8)
    blocks[0, 0, 0] = 0x2F  # codes 15 (-6.0) then 2 (1.0)
    blocks[0, 0, 1] = 0x97  # codes 7 (6.0) then 9 (-0.5)
    values = mxfp4.dequantize(blocks, np.full((1, 1), 128, np.uint8))  # x 2
    np.testing.assert_array_equal(values[0, :4], [-12.0, 2.0, 12.0, -1.0])
    assert values.shape == (1, 32) and not values[0, 4:].any()
    w = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32)
    w[0, :32] *= 1e-3
    packed, scales = mxfp4.quantize(w)
    back = mxfp4.dequantize(packed, scales)
    # Rounded to the nearest FP4 value: at most one unit of the block's scale off.
    step = np.repeat(np.ldexp(1.0, scales.astype(int) - 127), 32, axis=-1)
    assert (np.abs(back - w) <= step).all() and (np.abs(back - w) > 0).any()


@pytest.fixture(scope="module")
def loaded():
    from jaxserve.weights import load_host

    return (load_host(ModelSpec("mxfp4", "hf", MXFP4)),
            load_host(ModelSpec("gpt_oss", "hf", ORIGINAL)))


def test_mxfp4_loads_the_original_within_its_rounding(loaded):
    """Attention, routers, biases, embeddings and norms as in the original; each expert weight
    within one unit of its block's scale (FP4 rounding), and exactly the stored values."""
    from safetensors.numpy import load_file

    (config, params), (want_config, want) = loaded
    assert config == want_config.replace(name="gpt_oss_mxfp4")
    stored = load_file(str(MXFP4 / "model.safetensors"))
    for name in ("gate_proj", "up_proj", "down_proj"):
        w, w0 = params["moe"][name], want["moe"][name]
        assert not np.array_equal(w, w0)
        hf = "gate_up_proj" if name != "down_proj" else name
        scales = np.stack([stored[f"model.layers.{i}.mlp.experts.{hf}_scales"] for i in range(2)])
        step = np.swapaxes(np.repeat(np.ldexp(1.0, scales.astype(int) - 127), 32, axis=-1),
                           -1, -2)  # [S, E, in, out]
        if name != "down_proj":
            step = step[..., 0::2] if name == "gate_proj" else step[..., 1::2]
        assert (np.abs(w - w0) <= step).all(), name
    for group in ("layers", "embed_tokens", "norm", "lm_head"):
        for a, b in zip(jax.tree.leaves(params[group]), jax.tree.leaves(want[group])):
            np.testing.assert_array_equal(a, b)
    for name in ("router", "router_bias", "gate_bias", "up_bias", "down_bias"):
        np.testing.assert_array_equal(params["moe"][name], want["moe"][name])


def test_mxfp4_serves_hf_s_logits_and_greedy_tokens():
    """HF on the same MXFP4 file (which it dequantizes at load): logits within 1e-4, the same 32
    greedy tokens, under chunked prefill, prefix caching and preemption; MXFP4 itself moved HF's
    logits by far more than that (expected.json's vs_original)."""
    from tests.test_model_families import _check_engine

    assert json.loads((MXFP4 / "expected.json").read_text())["vs_original"] > 0.1
    _check_engine("gpt_oss", MXFP4)


@pytest.mark.parametrize("change, says", [
    ({"quant_method": "mxfp4", "weight_block_size": [16, 16]},
     "mxfp4 quantization_config keys jaxserve does not implement: weight_block_size"),
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
])
def test_other_quantization_configs_are_refused_in_one_line(tmp_path, change, says):
    import shutil

    from jaxserve.errors import WeightsError
    from jaxserve.weights import read_config

    path = tmp_path / "m"
    shutil.copytree(MXFP4, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": change}))
    with pytest.raises(WeightsError, match=says) as e:
        read_config(ModelSpec("m", "hf", path))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- Harmony

CALL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>'
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
        '<|call|>')
# The recipient before the channel, as the template renders earlier calls.
CALL_FIRST = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant '
              'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}')
ANSWER = ('<|channel|>analysis<|message|>Paris is\nmild.<|end|><|start|>assistant<|channel|>'
          'final<|message|>It is 18C in Paris.')


def _gpt_oss_template():
    from tests.test_chat_templates import _tokenizer

    return _tokenizer("gpt_oss", bos="<|startoftext|>", eos="<|return|>")


def test_harmony_template_renders_and_auto_picks_vllm_s_parsers():
    from tests.test_chat_templates import CHAT, WEATHER, _history, _parsers

    tok = _gpt_oss_template()
    assert tok.template_uses_tools and _parsers(tok) == ("openai", "openai_gptoss")
    text = tok.apply_chat_template(CHAT, tokenize=False, template_kwargs={
        "reasoning_effort": "high"})
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "Reasoning: high\n\n# Valid channels: analysis, commentary, final." in text
    assert text.endswith("<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
                         "<|start|>user<|message|>hi<|end|><|start|>assistant")
    text = tok.apply_chat_template(_history("call_1"), tokenize=False, tools=WEATHER)
    assert ("namespace functions {\n\n// Current weather\ntype get_weather = (_: {\ncity: string"
            ",\n}) => any;\n\n} // namespace functions") in text
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant<|channel|>'
            'commentary<|message|>"18C"<|end|><|start|>assistant') in text


@pytest.mark.parametrize("text, finish, reasoning, content, calls", [
    (CALL, "stop", "Need the weather.", None, [("get_weather", '{"city": "Paris"}')]),
    (CALL_FIRST, "stop", "Need the weather.", None, [("get_weather", '{"city": "Paris"}')]),
    (ANSWER, "stop", "Paris is\nmild.", "It is 18C in Paris.", []),
    # A preamble to the user in the commentary channel, then the call.
    ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather<|message|>{"city": "Oslo"}', "stop", None, "Checking.",
     [("get_weather", '{"city": "Oslo"}')]),
    # Cut by max_tokens inside the call: its arguments as far as they were written.
    (CALL[:-len('"}<|call|>')], "length", "Need the weather.", None,
     [("get_weather", '{"city": "Paris')]),
    # Cut inside the reasoning: all of it reasoning, no content.
    ("<|channel|>analysis<|message|>Hmm, the", "length", "Hmm, the", None, []),
    # No Harmony at all: content as it is.
    ("Plain words.", "stop", None, "Plain words.", []),
    # JSON a constraint made the model write after its analysis (no final header).
    ('<|channel|>analysis<|message|>Short.<|end|>{"a": 1}', "stop", "Short.", '{"a": 1}', []),
])
def test_harmony_output_is_reasoning_content_and_tool_calls_whole_and_streamed(
        text, finish, reasoning, content, calls):
    from jaxserve.entrypoints.serving.tool_output import ParserChoice, ToolCallOutput

    parsers = ParserChoice().for_tokenizer(_gpt_oss_template())
    assert parsers.tool.needs_special_tokens  # the markers stay in the text
    output = ToolCallOutput(parsers.tool, parsers.reasoning)
    message, got_finish = output.message(text, finish)
    assert message.get("reasoning_content") == reasoning
    assert message["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])] == calls
    assert got_finish == ("tool_calls" if calls and finish == "stop" else finish)
    # Streamed in uneven pieces: the deltas join to the same message.
    stream = ToolCallOutput(parsers.tool, parsers.reasoning)
    rng = np.random.default_rng(len(text))
    cuts = sorted(set(rng.integers(0, len(text), 12).tolist()) | {0, len(text)})
    joined = {"reasoning_content": "", "content": "", "calls": {}}
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        delta, _ = stream.delta(0, text[a:b], finish if b == len(text) else None)
        joined["reasoning_content"] += delta.get("reasoning_content", "")
        joined["content"] += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            fn = joined["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            fn["name"] += call.get("function", {}).get("name", "")
            fn["arguments"] += call.get("function", {}).get("arguments", "")
    assert (joined["reasoning_content"] or None) == reasoning
    assert (joined["content"] or None) == content
    assert [(c["name"], c["arguments"]) for c in joined["calls"].values()] == calls


def test_the_released_gpt_oss_20b_config_reads():
    """gpt-oss-20b's config.json as released (transformers 4.55 spelling: rope_scaling, the MXFP4
    quantization_config, experts_per_token, initial_context_length)."""
    from jaxserve.weights.architectures import config_from_hf

    cfg = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
        "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_scaling": {
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0",
        "use_cache": True, "vocab_size": 201088}
    c = config_from_hf(cfg, "gpt-oss-20b")
    assert (c.num_experts, c.experts_per_token, c.moe_intermediate_size) == (32, 4, 2880)
    assert c.layer_windows[:2] == (128, None) and c.attention_sinks and c.moe_bias
    assert c.rope_scaling.rope_type == "yarn" and not c.rope_scaling.truncate
    assert c.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(32.0) + 1)
    assert (c.swiglu_limit, c.swiglu_alpha, c.rope_theta) == (7.0, 1.702, 150000.0)
    with pytest.raises(ConfigError, match="experts_per_token=2 differs"):
        config_from_hf({**cfg, "experts_per_token": 2}, "gpt-oss-20b")
