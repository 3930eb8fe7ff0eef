"""Tensor parallelism on 8 virtual CPU devices gives the same logits as one device.

XLA fixes the host device count when JAX starts, so the multi-device tests run in a child pytest
process started with XLA_FLAGS=--xla_force_host_platform_device_count=8; in the parent process they
are skipped and `test_tensor_parallel_in_8_device_subprocess` runs them.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve.executor import sharding
from jaxserve.executor.batch_plan import SeqChunk, make_plan
from jaxserve.config import ModelConfig, ParallelConfig
from jaxserve.errors import ConfigError
from jaxserve.executor.models import decoder

DEVICES = 8
_CHILD = "JAXSERVE_SHARDING_CHILD"
needs_8 = pytest.mark.skipif(jax.device_count() < DEVICES,
                             reason="runs in the 8-device child process")

TINY = ModelConfig(name="tiny", vocab_size=128, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16)
PAGE_SIZE, NUM_PAGES, PAGES_PER_SEQ = 4, 12, 4


@pytest.mark.skipif(os.environ.get(_CHILD) == "1", reason="already the child")
def test_tensor_parallel_in_8_device_subprocess():
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
               JAX_PLATFORMS="cpu", **{_CHILD: "1"})
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(Path(__file__).relative_to(root))],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # Only this launcher may be skipped in the child: every multi-device test must have run.
    assert "passed, 1 skipped" in proc.stdout, proc.stdout[-2000:]


def test_mesh_spec_replicates_what_the_model_axis_does_not_divide():
    mesh = jax.sharding.AbstractMesh((1, 4), (sharding.DATA, sharding.MODEL))
    assert sharding.mesh_spec(P("embed", "heads", "head_dim"), (64, 8, 16), mesh) == P(
        None, "model", None)
    assert sharding.mesh_spec(P("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh) == P(
        None, None, None)
    assert sharding.mesh_spec(P("vocab", "embed"), (49152, 576), mesh) == P("model", None)


def test_mesh_needs_enough_devices():
    with pytest.raises(ConfigError, match="exceeds the"):
        sharding.make_mesh(ParallelConfig(tensor_parallel_size=jax.device_count() + 1))


@functools.partial(jax.jit, static_argnums=1, donate_argnums=2)
def _step(params, config, kv_cache, batch):
    hidden, kv_cache = decoder.forward(params, config, kv_cache, batch)
    return decoder.compute_logits(params, config, hidden[batch.logits_indices]), kv_cache


def _logits(params, config, mesh, prompts) -> np.ndarray:
    """Prefill then one decode step for each prompt; logits of both steps."""
    cache = decoder.init_kv_cache(config, NUM_PAGES, PAGE_SIZE)
    if mesh is not None:
        cache = jax.device_put(cache, sharding.kv_cache_sharding(config, mesh, NUM_PAGES, PAGE_SIZE))
    tables = [list(range(1 + i * PAGES_PER_SEQ, 1 + (i + 1) * PAGES_PER_SEQ))
              for i in range(len(prompts))]
    steps = [[SeqChunk(p, 0, t) for p, t in zip(prompts, tables)],
             [SeqChunk([7], len(p), t) for p, t in zip(prompts, tables)]]
    out = []
    for chunks in steps:
        plan = make_plan(chunks, num_tokens_padded=64, num_seqs_padded=4,
                         pages_per_seq=PAGES_PER_SEQ, page_size=PAGE_SIZE)
        logits, cache = _step(params, config, cache, jax.tree.map(jnp.asarray, plan))
        out.append(np.asarray(logits[:len(prompts)]))
    return np.concatenate(out)


@needs_8
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tiny_model_tp_equals_tp1(tp):
    params = decoder.init_params(TINY, jax.random.key(0))
    prompts = [[3, 14, 15, 92, 65], list(range(20, 33))]
    expected = _logits(params, TINY, None, prompts)
    mesh = sharding.make_mesh(ParallelConfig(tensor_parallel_size=tp))
    shardings = decoder.param_shardings(TINY, mesh)
    sharded = jax.device_put(params, shardings)
    # Heads, MLP and vocab are split; 2 KV heads split only where TP divides them.
    assert sharded["layers"]["q_proj"].sharding.spec == P(None, None, "model", None)
    kv_spec = sharded["layers"]["k_proj"].sharding.spec
    assert kv_spec == (P(None, None, "model", None) if tp == 2 else P(None, None, None, None))
    assert len(sharded["layers"]["gate_proj"].addressable_shards) == tp
    got = _logits(sharded, TINY, mesh, prompts)
    # f32; only the order of the cross-device sums differs.
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


@needs_8
@pytest.mark.slow
def test_smollm2_tp3_equals_tp1(smollm2, smollm2_golden):
    from jaxserve.model_registry import resolve
    from jaxserve.weights import load_model

    config, params = smollm2
    prompts = [c["input_ids"][:13] for c in smollm2_golden["cases"][2:4]]
    expected = _logits(params, config, None, prompts)
    mesh = sharding.make_mesh(ParallelConfig(tensor_parallel_size=3))
    # On a mesh the file is dequantized at load (f32), where one device reads its blocks.
    sharded_config, sharded = load_model(resolve("smollm2-135m-instruct"), dtype="float32",
                                         mesh=mesh)
    assert sharded_config.quantization is None
    assert sharded["layers"]["k_proj"].sharding.spec == P(None, None, "model", None)
    assert sharded["embed_tokens"].sharding.spec == P("model", None)
    got = _logits(sharded, sharded_config, mesh, prompts)
    # Logits of magnitude ~25 through 30 layers in f32; reduction order alone moves them ~1e-5.
    np.testing.assert_allclose(got, expected, atol=2e-3, rtol=0)
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@needs_8
def test_orbax_checkpoint_restores_straight_into_the_mesh(tmp_path):
    from jaxserve.model_registry import ModelSpec
    from jaxserve.weights import load_model
    from jaxserve.weights.checkpoint import save_checkpoint

    params = jax.tree.map(np.asarray, decoder.init_params(TINY, jax.random.key(3)))
    save_checkpoint(tmp_path / "ckpt", TINY, params, tokenizer_source=None)
    mesh = sharding.make_mesh(ParallelConfig(tensor_parallel_size=4, data_parallel_size=2))
    _, restored = load_model(ModelSpec("tiny", "orbax", tmp_path / "ckpt"), mesh=mesh)
    expected = decoder.param_shardings(TINY, mesh)
    for leaf, want, ref in zip(jax.tree.leaves(restored), jax.tree.leaves(expected),
                               jax.tree.leaves(params)):
        assert leaf.sharding == want
        np.testing.assert_array_equal(np.asarray(leaf), ref)
    assert restored["layers"]["up_proj"].sharding.spec == P(None, None, "model")


@needs_8
@pytest.mark.parametrize("tp, kv_heads", [(2, 2), (4, 2)])
def test_sharded_step_never_gathers_the_kv_cache(tp, kv_heads):
    """The compiled forward moves activations (all-reduce, the logits' all-gather), never the
    cache: KV heads split, attention runs per device; not split, the cache is replicated."""
    import re

    from jaxserve.config import CacheConfig, SchedulerConfig
    from jaxserve.executor.runner import ModelRunner

    config = TINY.replace(num_kv_heads=kv_heads)
    mesh = sharding.replica_meshes(ParallelConfig(tensor_parallel_size=tp))[0]
    params = jax.device_put(decoder.init_params(config, jax.random.key(0)),
                            decoder.param_shardings(config, mesh))
    # A pool big enough that any gather of it would dwarf the step's activations.
    runner = ModelRunner(config, params, CacheConfig(page_size=PAGE_SIZE, num_pages=64),
                         SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                         max_model_len=16), eos_token_ids=[1], mesh=mesh)
    cache = runner.kv_cache
    if kv_heads % tp == 0:
        assert cache.sharding.spec == P(None, None, "model", None)
    else:
        assert cache.sharding.is_fully_replicated
    hlo = runner._compile(("forward", 16)).as_text()
    collectives = re.findall(r"= \w+\[([\d,]*)\][^=]*? (all-gather|all-reduce|all-to-all|"
                             r"collective-permute)\(", hlo)
    assert {op for _, op in collectives} >= {"all-reduce"}
    sizes = [np.prod([int(d) for d in shape.split(",") if d]) for shape, _ in collectives]
    assert max(sizes) < cache.size // tp, collectives  # smaller than one device's shard
    # Donated and updated in place: the cache comes back with its own sharding.
    plan = make_plan([SeqChunk([3, 4, 5], 0, [1])], num_tokens_padded=16, num_seqs_padded=4,
                     pages_per_seq=4, page_size=PAGE_SIZE)
    runner.forward(plan)
    assert cache.is_deleted() and runner.kv_cache.sharding == cache.sharding
