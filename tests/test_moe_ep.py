"""Expert parallelism (--enable-expert-parallel): a mixture's experts sharded over the mesh, tokens
dispatched to their devices and combined (jaxserve.executor.models.moe.expert_parallel).

The MoE layer on 2 and 4 virtual CPU devices equals one device's under skewed routing (one device's
experts taking most copies, one expert none), and the Qwen3-MoE fixture serves HF's logits (1e-4)
and 32 greedy tokens with EP over 2 and 4 devices (attention tensor parallel beside it; on 4, its
2 KV heads do not split, so attention runs whole on each device: expert parallelism alone) — the
tokens tests/test_model_families.py checks on one device; so do llama.cpp's GGUF files of Mixtral,
gpt-oss and DeepSeek-V3 (tests/test_gguf_moe.py's, on 2 or 4). A bf16 checkpoint's weights kept
bf16 (tests/test_bf16_weights.py) give the float32 load's logits bit for bit and its greedy tokens
with EP=2. XLA fixes the device count at start, so those run in a child pytest with 4
devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.config import ModelConfig, ParallelConfig
from jaxserve.errors import ConfigError
from jaxserve.executor import sharding
from jaxserve.executor.models import moe

DEVICES = 4
_CHILD = "JAXSERVE_EP_CHILD"
needs_4 = pytest.mark.skipif(jax.device_count() < DEVICES, reason="runs in the 4-device child")

_ENGINES = {}  # devices -> the LLM its HF test built (the load test reuses it)
MOE = ModelConfig(name="moe", vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=4, num_experts=8, experts_per_token=2,
                  moe_intermediate_size=6)


@pytest.mark.skipif(os.environ.get(_CHILD) == "1", reason="already the child")
def test_expert_parallel_in_4_device_subprocess():
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
               JAX_PLATFORMS="cpu", **{_CHILD: "1"})
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(Path(__file__).relative_to(root)), "-k", "on_devices"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "9 passed" in proc.stdout, proc.stdout[-2000:]


@needs_4
@pytest.mark.parametrize("n", [2, 4])
def test_moe_layer_on_devices_equals_one_device(n):
    p = {k: np.array(v[0]) for k, v in nn.unbox(moe.boxed_init(MOE, jax.random.key(0)))["moe"].items()}
    x = np.random.default_rng(0).normal(size=(23, MOE.hidden_size)).astype(np.float32)
    x[:, 0] = 3.0
    p["router"][0, 1] += 20.0  # expert 1 (device 0's) first for every token
    p["router"][0, 7] -= 20.0  # expert 7 never
    args = (MOE, jax.nn.silu, jax.lax.Precision.HIGHEST)
    want = jax.jit(moe.experts_mlp, static_argnums=(2, 3, 4))(jnp.asarray(x), p, *args)

    mesh = sharding.make_mesh(ParallelConfig(tensor_parallel_size=n))
    ep = MOE.replace(expert_parallel=True)
    placed = {name: jax.device_put(w, NamedSharding(mesh, sharding.mesh_spec(
        P(*moe.AXES["moe"][name][1:]), w.shape, mesh, sharding.axis_rules(ep))))
        for name, w in p.items()}
    assert placed["gate_proj"].sharding.spec == P(sharding.MODEL, None, None)
    assert placed["router"].sharding.spec == P(None, None)
    got = jax.jit(moe.expert_parallel(ep, mesh, *args[1:]))(jnp.asarray(x), placed)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@needs_4
@pytest.mark.parametrize("n", [2, 4])
def test_qwen3_moe_on_devices_gives_hfs_logits_and_greedy_tokens(n):
    from tests.test_model_families import _check_engine

    llm = _ENGINES[n] = _check_engine("qwen3_moe", tensor_parallel_size=n,
                                      enable_expert_parallel=True)
    params = llm.engine.runner.params
    assert params["moe"]["gate_proj"].sharding.spec == P(None, sharding.MODEL, None, None)
    assert params["moe"]["router"].sharding.spec == P(None, None, None)
    assert params["dense_mlp"]["gate_proj"].sharding.spec == P(None, None, sharding.MODEL)


# llama.cpp's files (tests/test_gguf_moe.py checks each on one device): HF's logits and tokens
# with the experts split, as on one device. Mixtral's on 2 (no other test runs Mixtral with EP),
# gpt-oss's on 4 (one of its 4 experts each; sinks, sliding layers, MXFP4 experts; <= 3.4e-5 from
# HF's on 1, 2 and 4 devices) and DeepSeek-V3's on 4 (two of its 8 experts and one of its 4
# heads each; latent attention, the grouped router, a shared expert, a dense layer). Not
# Qwen3-MoE's: its safetensors fixture runs above, and its GGUF loads the same tree
# (test_gguf_moe) that the same shardings place.
@needs_4
@pytest.mark.parametrize("arch, n", [("mixtral", 2), ("gpt-oss", 4), ("deepseek2", 4)])
def test_gguf_mixture_on_devices_gives_hfs_logits_and_greedy_tokens(arch, n):
    from tests.test_gguf_moe import check_gguf

    llm = check_gguf(arch, tensor_parallel_size=n, enable_expert_parallel=True)
    moe_params = llm.engine.runner.params["moe"]
    assert moe_params["gate_proj"].sharding.spec == P(None, sharding.MODEL, None, None)
    assert moe_params["router"].sharding.spec == P(None, None, None)


# bf16 weights (config.weight_dtype) on a mesh, EP=2 with attention tensor parallel beside it:
# the attention projections widen their sharded bf16 weights where XLA uses them, and each
# device's grouped-matmul kernel reads its experts in bf16. The widening is exact and each path
# sums as the float32 load's does: the same floats. (TP=2 alone, the experts' tiles on XLA, also
# gives them bit for bit; not run here, as it costs another two engines.)
@needs_4
def test_bf16_weights_on_devices_give_the_f32_loads_logits_and_tokens(tmp_path, monkeypatch):
    from tests.test_bf16_weights import check_engine_against_f32_load, write_bf16_copy

    check_engine_against_f32_load(write_bf16_copy(tmp_path), monkeypatch, tensor_parallel_size=2,
                                  enable_expert_parallel=True)


def _count_one_forward(llm) -> tuple[int, ...]:
    """The expert counts of one forward over 5 tokens padded to 8 (the engine's own bucket)."""
    from jaxserve.executor.batch_plan import SeqChunk, make_plan

    runner, shapes = llm.engine.runner, llm.engine.runner.shapes
    runner.expert_load.fold()
    before = np.array(runner.expert_load.totals()[0])
    plan = make_plan([SeqChunk([5, 9, 77, 3, 120], 0, [1, 2])], num_tokens_padded=8,
                     num_seqs_padded=shapes.seq_bucket(8), pages_per_seq=shapes.pages_per_seq,
                     page_size=shapes.page_size, num_rows_padded=8)
    runner.run_forward(plan)
    runner.expert_load.fold()
    return tuple(np.array(runner.expert_load.totals()[0]) - before)


def test_expert_load_is_counted_and_exported():
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.telemetry.metrics import ServerMetrics
    from tests.test_model_families import FIXTURES, engine_args

    llm = LLM(str(FIXTURES / "qwen3_moe"), **engine_args())
    counts = _count_one_forward(llm)
    # 5 tokens (not the 3 padding rows) x top-2 x the 2 sparse layers of 3.
    assert len(counts) == 4 and sum(counts) == 5 * 2 * 2
    stats = llm.engine.stats()
    assert stats.expert_tokens == counts and stats.expert_steps == 1
    text = ServerMetrics(lambda: {"m": [stats]}).render().decode()
    for e, count in enumerate(counts):
        assert f'jaxserve:moe_expert_tokens_total{{expert="{e}",model_name="m",replica="0",' \
               f'route=""}} {float(count)}' in text
    assert 'jaxserve:moe_steps_total{model_name="m",replica="0",route=""} 1.0' in text
    assert 'jaxserve:moe_device_imbalance{model_name="m",replica="0",route=""} 1.0' in text


@needs_4
def test_expert_load_on_devices_is_counted_alike():
    """The engines of the test above (2 and 4 devices) count the same forward alike, and the
    metrics spread it over the devices."""
    from jaxserve.telemetry.metrics import ServerMetrics

    counts = {n: _count_one_forward(_ENGINES[n]) for n in (2, 4)}
    assert counts[2] == counts[4] and sum(counts[2]) == 5 * 2 * 2
    stats = _ENGINES[2].engine.stats()
    assert stats.expert_parallel_size == 2
    text = ServerMetrics(lambda: {"m": [stats]}).render().decode()
    per_device = [sum(stats.expert_tokens[:2]), sum(stats.expert_tokens[2:])]
    assert f'jaxserve:moe_device_tokens_total{{device="1",model_name="m",replica="0",' \
           f'route=""}} {float(per_device[1])}' in text
    imbalance = max(per_device) / (sum(per_device) / 2)
    assert f'jaxserve:moe_device_imbalance{{model_name="m",replica="0",route=""}} {imbalance}' \
        in text


def test_experts_not_divisible_by_the_ep_size_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"the 8 experts of moe are not divisible by 3 "
                                          r"\(sizes that fit these devices: \[1, 2, 4\]\)"):
        sharding.check_parallel(MOE, ParallelConfig(3, enable_expert_parallel=True), 4)
    dense = MOE.replace(num_experts=0, experts_per_token=0, moe_intermediate_size=0)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        sharding.check_parallel(dense, ParallelConfig(2, enable_expert_parallel=True), 4)
    # Heads that do not split are fine with EP (attention runs whole on each device).
    sharding.check_parallel(MOE.replace(num_heads=3, num_kv_heads=3, intermediate_size=9),
                            ParallelConfig(4, enable_expert_parallel=True), 4)


def test_flag_is_off_unless_given():
    import argparse

    from jaxserve.entrypoints.engine_flags import add_engine_flags, engine_args

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert "enable_expert_parallel" not in engine_args(parser.parse_args([]))
    assert engine_args(parser.parse_args(["--enable-expert-parallel", "-tp", "2"])) == {
        "enable_expert_parallel": True, "tensor_parallel_size": 2}
