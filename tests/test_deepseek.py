"""DeepSeek-V3 (multi-head latent attention, its compressed paged cache, its router) beyond the HF
comparison every family gets in tests/test_model_families.py (logits within 1e-4 and 32 greedy
tokens under chunked prefill, prefix caching and preemption, through the latent cache):
- the latent attention's XLA path against its float64 reference (mla_reference.py) on ragged
  batches of prefill chunks, decodes and padding;
- the pool's MLA layout: what a page holds and how many pages the memory left buys;
- the router (sigmoid scores, group-limited top-k with the correction bias, scaling) against a
  per-token loop;
- DeepSeek's FP8 release format (weights/fp8.py): HF's dequantized weights and HF's outputs;
- HF's logits and greedy tokens with the heads and the experts split over 2 virtual devices
  (tensor and expert parallel; a child process, as XLA fixes the device count at start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.kernels.attention import mla as mla_kernel
from jaxserve.kernels.attention.mla_reference import mla_ragged_paged_attention as reference
from jaxserve.shapes import cdiv
from tests.test_model_families import FIXTURES

FAMILY = "deepseek_v3"


def _batch(q_lens, kv_lens, page_size, num_pages, rng, S=6, pages_per_seq=33):
    """A ragged batch padded to S sequences: each sequence's pages drawn at random from the pool
    (page 0 excluded). Every case has the same shapes, so one compile serves them all."""
    free = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((S, pages_per_seq), np.int32)
    used = 0
    for s, k in enumerate(kv_lens):
        n = cdiv(k, page_size)
        table[s, :n] = free[used:used + n]
        used += n
    cu = np.zeros(S + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    lens = np.zeros(S, np.int32)
    lens[:len(kv_lens)] = kv_lens
    return lens, table, cu, np.asarray([len(q_lens)], np.int32)


_RUN = jax.jit(mla_kernel.mla_ragged_paged_attention, static_argnames=("kv_lora_rank", "sm_scale"))


@pytest.mark.parametrize("q_lens, kv_lens", [
    ([1, 1, 1], [5, 40, 1]),  # decodes only
    ([37, 1, 9, 1, 2], [37, 70, 20, 3, 2]),  # prefill chunks, decodes, a short query
    ([1], [130]),  # one decode over many KV blocks
])
def test_latent_attention_matches_the_float64_reference(q_lens, kv_lens):
    rng = np.random.default_rng(0)
    H, R, Dr, page_size, num_pages = 3, 16, 8, 4, 80
    kv_lens_a, table, cu, num_seqs = _batch(q_lens, kv_lens, page_size, num_pages, rng)
    T = 64  # padding rows past the last sequence
    q = rng.standard_normal((T, H, R + Dr)).astype(np.float32)
    cache = rng.standard_normal((num_pages, page_size, R + Dr)).astype(np.float32)
    args = (q, cache, kv_lens_a, table, cu, num_seqs)
    want = reference(*args, kv_lora_rank=R, sm_scale=0.3)
    got = np.asarray(_RUN(*map(jnp.asarray, args), kv_lora_rank=R, sm_scale=0.3))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    assert not got[int(sum(q_lens)):].any()


def test_latent_attention_refuses_mismatched_shapes():
    z = np.zeros
    with pytest.raises(ValueError, match="latent width differs"):
        mla_kernel.mla_ragged_paged_attention(
            z((2, 1, 24)), z((4, 4, 20)), z(1, np.int32), z((1, 1), np.int32),
            z(2, np.int32), z(1, np.int32), kv_lora_rank=16, sm_scale=1.0)


def _fixture_config():
    from jaxserve.weights.architectures import config_from_hf

    return config_from_hf(json.loads((FIXTURES / FAMILY / "config.json").read_text()), FAMILY)


def test_the_pool_stores_latents_and_sizes_its_pages_by_them():
    from jaxserve.executor.runner import kv_page_bytes, num_pages_for

    c = _fixture_config()
    m = c.mla
    # One row per token and layer: the latent and the rope key, nothing per head.
    assert kv_page_bytes(c, 16, "bfloat16") == c.num_layers * 16 * (m.kv_lora_rank
                                                                     + m.qk_rope_head_dim) * 2
    standard = kv_page_bytes(c.replace(mla=None, head_dim=m.qk_nope_head_dim
                                       + m.qk_rope_head_dim), 16, "bfloat16")
    assert standard == 2 * c.num_layers * 16 * c.num_heads * 16 * 2  # 128 values a token here
    budget = 1 << 20
    pages = num_pages_for(c, CacheConfig(page_size=16, dtype="bfloat16",
                                         kv_cache_memory_fraction=0.5),
                          SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=1024,
                                          max_model_len=4096), memory_bytes=budget)
    assert pages == budget // 2 // kv_page_bytes(c, 16, "bfloat16")


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_grouped_sigmoid_routing_matches_a_per_token_loop(norm_topk_prob):
    from jaxserve.executor.models import moe

    c = _fixture_config().replace(norm_topk_prob=norm_topk_prob)
    rng = np.random.default_rng(1)
    router = rng.normal(size=(c.hidden_size, c.num_experts)).astype(np.float32)
    bias = rng.normal(0, 0.3, c.num_experts).astype(np.float32)
    x = rng.normal(0, 0.3, size=(50, c.hidden_size)).astype(np.float32)
    experts, weights = map(np.asarray, jax.jit(moe.grouped_route, static_argnums=3)(
        jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), c))
    size = c.num_experts // c.moe_num_groups
    for t, row in enumerate(x.astype(np.float64)):
        scores = 1 / (1 + np.exp(-(row @ router)))
        choice = scores + bias
        groups = [sorted(choice[g * size:(g + 1) * size])[-2:] for g in range(c.moe_num_groups)]
        best = np.argsort([-sum(g) for g in groups])[:c.moe_topk_groups]
        allowed = [e for e in range(c.num_experts) if e // size in best]
        top = sorted(allowed, key=lambda e: -choice[e])[:c.experts_per_token]
        w = scores[top] / (scores[top].sum() if norm_topk_prob else 1.0)
        assert sorted(experts[t].tolist()) == sorted(top)
        got = dict(zip(experts[t].tolist(), weights[t].tolist()))
        np.testing.assert_allclose([got[e] for e in top], w * c.routed_scaling_factor,
                                   rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
    ({"num_key_value_heads": 2}, "latent attention needs num_kv_heads == num_heads"),
    ({"n_group": 3}, "expert groups must divide the 8 experts"),
])
def test_deepseek_configs_it_cannot_serve_are_refused(change, message):
    from jaxserve.errors import ConfigError
    from jaxserve.weights.architectures import config_from_hf

    cfg = json.loads((FIXTURES / FAMILY / "config.json").read_text())
    with pytest.raises(ConfigError, match=message):
        config_from_hf({**cfg, **change}, FAMILY)


def test_fp8_checkpoint_dequantizes_to_hfs_weights_and_serves_hfs_tokens():
    """DeepSeek's release format: every layer's Linear weights (kv_a_proj_with_mqa too) FP8 with a
    weight_scale_inv per block (tests/fixtures/quantized/deepseek_v3_fp8, written by
    tools/make_fp8_fixture.py from this fixture, read back by HF), dequantized at load by
    jaxserve.weights.fp8: HF's dequantized weights exactly, HF's logits on the file within 1e-4
    and its 32 greedy tokens."""
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.weights.safetensors import load_hf
    from tests.test_model_families import _greedy, _prompt_logits, engine_args

    path = FIXTURES.parent / "quantized" / "deepseek_v3_fp8"
    config, params = load_hf(path)
    hf = np.load(path / "hf_dequantized.npz")
    m, H = config.mla, config.hidden_size
    attn = "model.layers.0.self_attn."

    def deinterleaved(w):  # [..., rope] pairs -> evens, odds (weights/mla_layout.py)
        rope = w[..., -m.qk_rope_head_dim:]
        return np.concatenate([w[..., :-m.qk_rope_head_dim], rope[..., 0::2], rope[..., 1::2]], -1)

    np.testing.assert_array_equal(params["layers"]["kv_a_proj"][0],
                                  deinterleaved(hf[attn + "kv_a_proj_with_mqa.weight"].T))
    np.testing.assert_array_equal(params["layers"]["q_b_proj"][0], deinterleaved(
        hf[attn + "q_b_proj.weight"].T.reshape(m.q_lora_rank, config.num_heads, -1)))
    np.testing.assert_array_equal(params["dense_mlp"]["down_proj"][0],
                                  hf["model.layers.0.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(params["shared_mlp"]["up_proj"][0],
                                  hf["model.layers.1.mlp.shared_experts.up_proj.weight"].T)
    gate_up = hf["model.layers.2.mlp.experts.gate_up_proj"]  # HF's fused [E, 2I, H]
    np.testing.assert_array_equal(params["moe"]["up_proj"][1].transpose(0, 2, 1),
                                  gate_up[:, config.moe_intermediate_size:])
    assert params["layers"]["kv_a_proj"].shape[1:] == (H, m.latent_dim)

    exp = json.loads((path / "expected.json").read_text())
    llm = LLM(str(path), **engine_args())
    np.testing.assert_allclose(_prompt_logits(llm.engine, exp["prompts"][0]),
                               np.load(path / "logits.npy"), atol=1e-4, rtol=0)
    assert _greedy(llm, exp["prompts"]) == exp["greedy"]


_CHILD = "JAXSERVE_DEEPSEEK_CHILD"


@pytest.mark.skipif(os.environ.get(_CHILD) == "1", reason="already the child")
def test_tensor_and_expert_parallel_in_2_device_subprocess():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", **{_CHILD: "1"})
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(Path(__file__).relative_to(root)), "-k", "on_2_devices"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.skipif(jax.device_count() < 2, reason="runs in the 2-device child process")
def test_hf_logits_and_greedy_tokens_on_2_devices():
    """Heads split (latent attention per device over the replicated latent cache) and the experts
    split (the grouped router on every device): HF's logits and tokens, as on one device."""
    from jax.sharding import PartitionSpec as P

    from jaxserve.executor import sharding
    from tests.test_model_families import _check_engine

    llm = _check_engine(FAMILY, tensor_parallel_size=2, enable_expert_parallel=True)
    runner = llm.engine.runner
    assert runner.kv_cache.sharding.spec == P()
    assert runner.params["layers"]["kv_b_proj"].sharding.spec == P(None, None, sharding.MODEL,
                                                                   None)
    assert runner.params["moe"]["gate_proj"].sharding.spec == P(None, sharding.MODEL, None, None)


# DeepSeek's tool-call format, as its chat templates write a call.
def _ds_call(name: str, arguments: str) -> str:
    return (f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```"
            f"<｜tool▁call▁end｜>")


_DS_OUTPUT = ("Let me check.<｜tool▁calls▁begin｜>" + _ds_call("get_weather", '{"city": "Paris"}')
              + "\n" + _ds_call("get_time", '{"tz": "CET", "at": [1, {"h": 2}]}')
              + "<｜tool▁calls▁end｜>")


def test_deepseek_tool_calls_parse_whole_and_streamed_alike():
    from jaxserve.tool_calling.parsers import detect, get_tool_parser

    parser = get_tool_parser("deepseek_v3")
    assert detect("{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}") == "deepseek_v3"
    whole = parser.parse(_DS_OUTPUT)
    assert whole.content == "Let me check."
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET", "at": [1, {"h": 2}]}')]
    stream, content, names, arguments = parser.stream(), "", {}, {}
    for delta in [*(stream.feed(ch) for ch in _DS_OUTPUT), stream.finish()]:
        content += delta.content
        for d in delta.tool_calls:
            f = d.get("function", {})
            names.setdefault(d["index"], f.get("name"))
            arguments[d["index"]] = arguments.get(d["index"], "") + f.get("arguments", "")
    assert content == whole.content and list(names.values()) == ["get_weather", "get_time"]
    assert list(arguments.values()) == [c.arguments for c in whole.tool_calls]
    # Malformed: the whole text is content; cut by max_tokens: the call so far.
    bad = "<｜tool▁calls▁begin｜>" + _ds_call("f", "[1]")
    assert parser.parse(bad).tool_calls == [] and parser.parse(bad).content == bad
    cut = parser.parse(_DS_OUTPUT[:_DS_OUTPUT.index("Paris") + 3], cut=True)
    assert [(c.name, c.arguments) for c in cut.tool_calls] == [("get_weather", '{"city": "Par')]
    assert parser.parse("no calls").content == "no calls"


def test_r1_reasoning_then_deepseek_tool_calls_make_one_message():
    """DeepSeek-R1's output starts inside its think block (its template opens it in the prompt):
    the deepseek_r1 reasoning parser takes the block, the deepseek_v3 parser the calls after."""
    from jaxserve.entrypoints.serving.tool_output import ToolCallOutput
    from jaxserve.reasoning.parsers import get_reasoning_parser
    from jaxserve.tool_calling.parsers import get_tool_parser

    output = ToolCallOutput(get_tool_parser("deepseek_v3"), get_reasoning_parser("deepseek_r1"))
    message, finish = output.message("I need the weather.\n</think>\n\n" + _DS_OUTPUT, "stop")
    assert finish == "tool_calls" and message["reasoning_content"] == "I need the weather."
    assert message["content"] == "Let me check."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
