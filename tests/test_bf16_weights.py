"""bf16 checkpoints computed in float32 on the CPU keep their matmul weights bf16
(ModelConfig.weight_dtype, jaxserve.weights.load_model): the qwen3_moe fixture written in bf16, as
released models are, loads its attention projections and experts as bf16 (half their bytes) and
gives the float32 load's logits bit for bit and its greedy tokens: through the kernels (which
widen the weights in registers) in the engine's steps, and through XLA's paths (one-token steps,
the kernels switched off), which widen them where they use them. Under tensor and expert
parallelism: tests/test_moe_ep.py."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxserve import weights
from jaxserve.executor.batch_plan import SeqChunk, make_plan
from jaxserve.executor.models import decoder
from jaxserve.kernels import cpu as cpu_kernels
from jaxserve.model_registry import ModelSpec
from tests.test_model_families import _greedy, _prompt_logits, engine_args

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "models" / "qwen3_moe"
needs_kernels = pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_kernels.enabled(),
                                   reason="the CPU kernels' library")


def write_bf16_copy(out: Path) -> Path:
    """The fixture's model with every tensor rounded to bf16 and stored so, in `out`."""
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / f, out / f)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    with safe_open(str(FIXTURE / "model.safetensors"), framework="np") as st:
        tensors = {k: st.get_tensor(k).astype(ml_dtypes.bfloat16) for k in st.keys()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    return write_bf16_copy(tmp_path_factory.mktemp("qwen3_moe_bf16"))


def _f32_load(monkeypatch):
    """Loads from now on widen a bf16 checkpoint to float32 at load (as before weight_dtype)."""
    load_host = weights.load_host
    monkeypatch.setattr(weights, "load_host", lambda *a, **k: load_host(*a, **{
        **k, "keep_bf16": False}))


@needs_kernels
def test_bf16_load_keeps_the_matmul_weights_bf16_and_half_their_bytes(bf16_dir, monkeypatch):
    spec = ModelSpec(name="m", path=bf16_dir, format="hf")
    config, params = weights.load_model(spec)
    assert config.weight_dtype == "bfloat16"
    for group, names in (("layers", ("q_proj", "k_proj", "v_proj", "o_proj")),
                         ("moe", ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            assert params[group][name].dtype == jax.numpy.bfloat16, (group, name)
    # Norms, the router, the dense layer's MLP and the embedding stay float32.
    for leaf in (params["layers"]["input_norm"], params["moe"]["router"],
                 params["dense_mlp"]["gate_proj"], params["embed_tokens"]):
        assert leaf.dtype == jax.numpy.float32
    # The declared tree (what memory planning reads) is the loaded one.
    shapes = decoder.param_shapes(config)
    assert jax.tree.map(lambda s: s.dtype, shapes) == jax.tree.map(lambda p: p.dtype, params)
    _f32_load(monkeypatch)
    f32_config, f32_params = weights.load_model(spec)
    assert f32_config.weight_dtype is None
    half = sum(params["moe"][n].nbytes for n in ("gate_proj", "up_proj", "down_proj"))
    assert 2 * half == sum(f32_params["moe"][n].nbytes for n in ("gate_proj", "up_proj",
                                                                  "down_proj"))
    assert weights.param_bytes(config) < weights.param_bytes(f32_config)
    # Widened, the weights are the float32 load's.
    for group in ("layers", "moe"):
        for name, w in params[group].items():
            np.testing.assert_array_equal(np.asarray(w, np.float32), f32_params[group][name])


def check_engine_against_f32_load(path: Path, monkeypatch, **changes) -> None:
    """An engine on the bf16 copy at `path` (`changes` to engine_args: a mesh) gives the float32
    load's logits bit for bit and its greedy tokens, the experts and attention projections
    bf16 in its params."""
    from jaxserve.entrypoints.llm import LLM

    prompts = json.loads((FIXTURE / "expected.json").read_text())["prompts"]
    got = {}
    for load in ("bf16", "f32"):
        if load == "f32":
            _f32_load(monkeypatch)
        llm = LLM(str(path), **engine_args(**changes))
        assert llm.engine.runner.config.weight_dtype == ("bfloat16" if load == "bf16" else None)
        params = llm.engine.runner.params
        for w in (params["moe"]["gate_proj"], params["layers"]["q_proj"]):
            assert w.dtype == (jax.numpy.bfloat16 if load == "bf16" else jax.numpy.float32)
        got[load] = (_prompt_logits(llm.engine, prompts[0]), _greedy(llm, prompts))
    np.testing.assert_array_equal(got["bf16"][0], got["f32"][0])
    assert got["bf16"][1] == got["f32"][1]


@needs_kernels
def test_engine_gives_the_f32_loads_logits_bit_for_bit_and_its_greedy_tokens(bf16_dir,
                                                                              monkeypatch):
    check_engine_against_f32_load(bf16_dir, monkeypatch)


def _forward_logits(config, params, tokens: list[int]) -> np.ndarray:
    """Logits at every position of `tokens`, one step over all of them, on whatever paths the
    CPU kernels' switch gives now (traced afresh)."""
    page_size, pages = 4, list(range(1, 1 + -(-len(tokens) // 4)))
    plan = make_plan([SeqChunk(tokens, 0, pages)], num_tokens_padded=len(tokens),
                     num_seqs_padded=1, pages_per_seq=len(pages), page_size=page_size,
                     num_rows_padded=len(tokens))
    plan = plan._replace(logits_indices=np.arange(len(tokens), dtype=np.int32))
    cache = decoder.init_kv_cache(config, num_pages=1 + len(pages), page_size=page_size)

    @functools.partial(jax.jit, static_argnums=1)
    def run(params, config, cache, plan):
        hidden, _ = decoder.forward(params, config, cache, plan)
        return decoder.compute_logits(params, config, hidden[plan.logits_indices])

    return np.asarray(run(params, config, cache, plan))


@needs_kernels
@pytest.mark.parametrize("kernels", ["auto", "off"])
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_xla_paths_widen_to_the_same_floats(bf16_dir, monkeypatch, kernels, num_tokens):
    """One token: the projections on XLA's dots (the kernel takes 2 rows up), the experts on the
    kernel; kernels off: every projection and the experts' tiles on XLA."""
    spec = ModelSpec(name="m", path=bf16_dir, format="hf")
    config, params = weights.load_model(spec)
    assert config.weight_dtype == "bfloat16"
    f32_config, f32_params = weights.load_host(spec)
    monkeypatch.setenv(cpu_kernels.ENV, kernels)
    tokens = json.loads((FIXTURE / "expected.json").read_text())["prompts"][0][:num_tokens]
    np.testing.assert_array_equal(_forward_logits(config, params, tokens),
                                  _forward_logits(f32_config, jax.device_put(f32_params), tokens))
