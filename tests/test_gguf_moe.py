"""Mixtures of experts from GGUF files as llama.cpp's converter writes them (Qwen3-MoE's `qwen3moe`,
Mixtral's `llama` with experts, `gpt-oss`, DeepSeek-V3's `deepseek2`), against HF transformers on
the same weights.

tests/fixtures/gguf/<arch>/ holds model.gguf (F16, each layer's experts stacked in one tensor per
projection; gpt-oss's experts MXFP4) written by tools/make_gguf_moe_fixtures.py or
tools/make_gguf_gpt_oss_deepseek_fixtures.py from a tiny random HF model, with HF's logits and
greedy tokens on it. jaxserve loads the file as a user would: logits within 1e-4 and HF's 32
greedy tokens through one engine with chunked prefill, prefix caching and preemption.
Quantized expert tensors (Q8_0, Q4_0, MXFP4) dequantize at load to gguf's own dequantization,
and so do gpt-oss's and deepseek2's other matrices in Q4_K / Q8_0 (a widened copy of the fixture,
written at test time); the file's chat template is the one used. Under expert parallelism:
tests/test_moe_ep.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from jaxserve.errors import WeightsError
from jaxserve.model_registry import ModelSpec
from tests.test_model_families import _check_engine

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gguf"
TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
ARCHS = ["qwen3moe", "mixtral", "gpt-oss", "deepseek2"]
# Per file: (model_type, experts, top-k, top-k renormalized, dense layers).
CONFIGS = {"qwen3moe": ("qwen3_moe", 4, 2, True, ()), "mixtral": ("mixtral", 4, 2, True, ()),
           "gpt-oss": ("gpt_oss", 4, 2, True, ()), "deepseek2": ("deepseek_v3", 8, 2, True, (0,))}


def _expected(arch: str) -> dict:
    return json.loads((FIXTURES / arch / "expected.json").read_text())


def test_fixtures_bind():
    for arch in ARCHS:
        exp = _expected(arch)
        assert all(diff > 1e-2 for diff in exp["binding"].values()), exp["binding"]
        assert exp["min_route_gap"] > 1e-3 and exp["min_top2_gap"] > 1e-3


def check_gguf(arch: str, **changes):  # -> the LLM, for more
    """The file's engine (`changes` to tests.test_model_families.engine_args) gives HF's logits
    and greedy tokens through chunked prefill, prefix caching and preemption."""
    llm = _check_engine(arch, FIXTURES / arch, FIXTURES / arch / "model.gguf", **changes)
    config = llm.engine.runner.config
    assert (config.architecture, config.num_experts, config.experts_per_token,
            config.norm_topk_prob, config.dense_layers) == CONFIGS[arch]
    return llm


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_mixture_gives_hf_logits_and_greedy_tokens(arch):
    check_gguf(arch)


def _rewrite(src: Path, dst: Path, fields: dict | None = None, tensors=None) -> None:
    """The same file with metadata `fields` changed (None: dropped; a value: that value of the
    key's type, or of `type(value)`'s for a new key) and its tensors through `tensors(reader)`
    (name, array, raw type or None) (default: every tensor dequantized, as is)."""
    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = GGUFWriter(str(dst), arch)
    changes = {k.format(arch=arch): v for k, v in (fields or {}).items()}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        if key not in changes:
            w.add_key_value(key, field.contents(), field.types[0], sub)
        elif changes[key] is not None:
            w.add_key_value(key, changes.pop(key), field.types[0], sub)
    for key, value in changes.items():
        if value is not None:
            w.add_key_value(key, value, GGUFValueType.get_type(value))
    for name, data, raw in (tensors or _dequantized)(reader):
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _dequantized(reader):
    for t in reader.tensors:
        yield t.name, quants.dequantize(t.data, t.tensor_type), None


def _requantize_experts(src: Path, dst: Path, qtype: GGMLQuantizationType) -> None:
    """The same file with its stacked expert tensors quantized (llama-quantize's result)."""
    def tensors(reader):
        for name, data, _ in _dequantized(reader):
            if "_exps" in name:
                yield name, quants.quantize(data, qtype), qtype
            else:
                yield name, data, None

    _rewrite(src, dst, tensors=tensors)


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


def _same_tree(want: dict, got: dict) -> None:
    assert want.keys() == got.keys()
    for k in want:
        if isinstance(want[k], dict):
            _same_tree(want[k], got[k])
        else:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_gpt_oss_mxfp4_experts_dequantize_to_ggufs_values():
    """ffn_{gate,up,down}_exps in MXFP4 (GGML type 39): each expert's weights are gguf's
    dequantization of the file's blocks, in the tree's [S, E, in, out]."""
    from jaxserve.weights import load_host

    path = FIXTURES / "gpt-oss" / "model.gguf"
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    config, params = load_host(ModelSpec("g", "gguf", path))
    assert (config.swiglu_limit, config.attention_sinks, config.layer_types) == (
        7.0, True, ("sliding_attention", "full_attention"))
    for proj in ("gate", "up", "down"):
        t = tensors[f"blk.1.ffn_{proj}_exps.weight"]
        assert t.tensor_type == GGMLQuantizationType.MXFP4
        want = quants.dequantize(t.data, t.tensor_type).swapaxes(-1, -2)
        np.testing.assert_array_equal(params["moe"][f"{proj}_proj"][1], want)


def test_gpt_oss_fused_gate_up_experts_load_the_same_weights(tmp_path):
    """convert_hf_to_gguf.py --fuse-gate-up-exps: one ffn_gate_up_exps per layer (gate rows, then
    up rows; MXFP4 rows as they were, the biases likewise) loads the same weights."""
    from jaxserve.weights import load_host

    src = FIXTURES / "gpt-oss" / "model.gguf"

    def fused(reader):
        tensors = {t.name: t for t in reader.tensors}
        for name, t in tensors.items():
            if "ffn_up_exps" in name:
                continue
            if "ffn_gate_exps" not in name:
                yield name, quants.dequantize(t.data, t.tensor_type), None
                continue
            up = tensors[name.replace("gate", "up")]
            raw = t.tensor_type if name.endswith(".weight") else None
            parts = [(x.data if raw else quants.dequantize(x.data, x.tensor_type)) for x in (t, up)]
            yield name.replace("ffn_gate_exps", "ffn_gate_up_exps"), np.concatenate(parts, 1), raw

    dst = tmp_path / "fused.gguf"
    _rewrite(src, dst, tensors=fused)
    names = {t.name for t in GGUFReader(str(dst)).tensors}
    assert "blk.0.ffn_gate_up_exps.weight" in names and "blk.0.ffn_up_exps.weight" not in names
    _same_tree(load_host(ModelSpec("split", "gguf", src))[1],
               load_host(ModelSpec("fused", "gguf", dst))[1])


def test_older_deepseek2_files_load_the_same_weights(tmp_path):
    """Files from before llama.cpp split kv_b (one attn_kv_b) and wrote MLA as MQA (key_length /
    value_length the real head sizes, head_count_kv the heads) load the same weights."""
    from jaxserve.weights import load_host

    src = FIXTURES / "deepseek2" / "model.gguf"
    config, want = load_host(ModelSpec("new", "gguf", src))
    m = config.mla
    heads, nope = config.num_heads, m.qk_nope_head_dim

    def merged_kv_b(reader):
        parts = {t.name: quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
        for name, data in parts.items():
            if ".attn_v_b." in name:
                continue
            if ".attn_k_b." in name:  # [H, rank, nope] + [H, v, rank] -> [H * (nope + v), rank]
                v_b = parts[name.replace("attn_k_b", "attn_v_b")]
                data = np.concatenate([data.swapaxes(1, 2), v_b], 1).reshape(-1, data.shape[1])
                name = name.replace("attn_k_b", "attn_kv_b")
            yield name, data, None

    old = tmp_path / "old.gguf"
    _rewrite(src, old, {"{arch}.attention.key_length": nope + m.qk_rope_head_dim,
                        "{arch}.attention.value_length": m.v_head_dim,
                        "{arch}.attention.head_count_kv": heads,
                        "{arch}.attention.key_length_mla": None,
                        "{arch}.attention.value_length_mla": None}, merged_kv_b)
    assert "blk.1.attn_kv_b.weight" in {t.name for t in GGUFReader(str(old)).tensors}
    old_config, got = load_host(ModelSpec("old", "gguf", old))
    assert old_config == config.replace(name=old_config.name)
    _same_tree(want, got)


@pytest.mark.parametrize("fields, match", [
    # llama.cpp reads a deepseek2 file without a gating function as DeepSeek-V2's softmax.
    ({"{arch}.expert_gating_func": None}, "expert_gating_func None"),
    ({"{arch}.expert_gating_func": 1}, "expert_gating_func 1"),
    ({"{arch}.rope.scaling.type": "linear"}, "rope.scaling.type 'linear'"),
    ({"{arch}.rope.scaling.attn_factor": 2.0}, "rope.scaling.attn_factor=2.0"),
])
def test_deepseek2_metadata_jaxserve_does_not_serve_is_refused(tmp_path, fields, match):
    from jaxserve.weights.gguf import read_gguf_config

    path = tmp_path / "m.gguf"
    _rewrite(FIXTURES / "deepseek2" / "model.gguf", path, fields)
    with pytest.raises(WeightsError, match=match):
        read_gguf_config(path)


@pytest.mark.parametrize("arch, template, parsers, markers", [
    ("gpt-oss", "gpt_oss", ("openai", "openai_gptoss"), ("<|start|>", "<|message|>")),
    ("deepseek2", "deepseek_v3", ("deepseek_v3", None),
     ("<｜User｜>", "<｜tool▁calls▁begin｜>")),
])
def test_the_files_chat_template_is_used(arch, template, parsers, markers):
    """tokenizer.chat_template (the family's own, tests/chat_templates/) renders the chat and
    picks the family's tool-call and reasoning parsers; its markers are one token each."""
    from jaxserve.entrypoints.serving.tool_output import ParserChoice
    from jaxserve.tokenizer import load_tokenizer

    tok = load_tokenizer(ModelSpec(arch, "gguf", FIXTURES / arch / "model.gguf"))
    assert tok.chat_template == (TEMPLATES / f"{template}.jinja").read_text()
    chosen = ParserChoice().for_tokenizer(tok)
    assert (chosen.tool.name, chosen.reasoning and chosen.reasoning.name) == parsers
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert markers[0] + ("user" if arch == "gpt-oss" else "") in text
    for marker in markers:
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, marker


# ------------------------------------------- Q4_K / Q8_0 beside the experts (llama-quantize's)

def _q4_k(rows: np.ndarray) -> np.ndarray:
    """GGML's Q4_K blocks of `rows` (last axis a multiple of 256; the gguf package decodes Q4_K
    but does not encode it): per 256 values, float16 d and dmin, eight 6-bit scales and mins
    (one per 32 values) packed in 12 bytes, then 4-bit q with value = d sc q - dmin m. A plain
    min/max fit, not llama.cpp's search: a valid file of the format, rounding a little coarser."""
    x = rows.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(-1), 0.0)
    step = (x.max(-1) - lo) / 15
    d = (step.max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(np.divide(step, d, out=np.zeros_like(step), where=d > 0)), 0, 63)
    m = np.clip(np.rint(np.divide(-lo, dmin, out=np.zeros_like(lo), where=dmin > 0)), 0, 63)
    scale, offset = (d * sc)[..., None], (dmin * m)[..., None]
    q = np.clip(np.rint(np.divide(x + offset, scale, out=np.zeros_like(x), where=scale > 0)),
                0, 15).astype(np.uint8)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    packed = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], -1)
    qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)  # sub-blocks 2j, 2j+1 share 32 bytes
    out = np.concatenate([d.astype(np.float16).view(np.uint8), dmin.astype(np.float16)
                          .view(np.uint8), packed, qs], -1)
    return out.reshape(*rows.shape[:-1], rows.shape[-1] // 256 * 144)


# Where the hidden size is each tensor's input (last axis: tiled, divided by the copies), its
# output (tiled along that axis) or the vector itself (tiled).
_HIDDEN_IN = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_a.weight",
              "attn_kv_a_mqa.weight", "ffn_gate_inp.weight", "ffn_gate.weight", "ffn_up.weight",
              "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_gate_exps.weight",
              "ffn_up_exps.weight", "output.weight")
_HIDDEN_OUT = ("attn_output.weight", "ffn_down.weight", "ffn_down_shexp.weight",
               "ffn_down_exps.weight")
_HIDDEN = ("attn_output.bias", "ffn_down_exps.bias", "token_embd.weight", "attn_norm.weight",
           "post_attention_norm.weight", "ffn_norm.weight", "output_norm.weight")


def _widened(copies: int):
    """The tensors of the same model with its hidden size `copies` times larger: every hidden
    vector the original's tiled (embeddings, norms, what each layer adds), inputs divided by the
    copies (a power of two: exact). RMSNorm's mean over the tiles is the original's, so the
    logits are (f32 sums aside); rows become wide enough for Q4_K's 256-value blocks."""
    def tensors(reader):
        for name, data, _ in _dequantized(reader):
            role = name.split(".", 2)[2] if name.startswith("blk.") else name
            if role in _HIDDEN_IN:
                data = np.concatenate([data / copies] * copies, -1)
            elif role in _HIDDEN_OUT:
                data = np.concatenate([data] * copies, -2)
            elif role in _HIDDEN:
                data = np.concatenate([data] * copies, -1)
            yield name, data.astype(np.float32), None
    return tensors


def _llama_quantize(reader):
    """The non-expert matrices as llama-quantize's Q4_K_M leaves a small model: Q4_K where a row
    holds 256-value blocks, else Q8_0 where it holds 32-value ones, else as they were; norms,
    biases, routers, sinks and the experts unchanged."""
    for name, data, _ in _dequantized(reader):
        quantize = data.ndim == 2 and "_exps" not in name and "ffn_gate_inp" not in name
        if quantize and data.shape[-1] % 256 == 0:
            yield name, _q4_k(data), GGMLQuantizationType.Q4_K
        elif quantize and data.shape[-1] % 32 == 0:
            yield name, quants.quantize(data, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
        else:
            yield name, data, None


def _q_bound(original: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The largest error per weight of `qtype` for `original`'s rows, per 32-value block: Q8_0
    half a step (amax / 127) plus the float16 scale's rounding; Q4_K half a step (range / 15)
    plus the rounding of the 6-bit scale and min (half a unit of d and dmin each, the scale's
    times the 15 levels; d, dmin = the super-block's largest step, offset / 63) and of float16."""
    blocks = original.reshape(-1, 32)
    if qtype == GGMLQuantizationType.Q8_0:
        return np.abs(blocks).max(-1, keepdims=True) * (0.5 / 127 + 2.0 ** -11)
    lo = np.minimum(blocks.min(-1), 0.0)
    step = (blocks.max(-1) - lo) / 15
    d = step.reshape(-1, 8).max(-1).repeat(8) / 63
    dmin = -lo.reshape(-1, 8).min(-1).repeat(8) / 63
    return ((step / 2 + 7.5 * d + dmin / 2) * (1 + 2.0 ** -8))[:, None]


# The logits are not compared with the F32 file's: these fixtures' features each move HF's
# logits by > 3 (test_fixtures_bind), and rounding moves them far past any tolerance too: Q8_0
# on the original's matrices alone moved gpt-oss's by 1.63, deepseek2's by 0.73.
@pytest.mark.parametrize("arch", ["gpt-oss", "deepseek2"])
def test_q4_k_and_q8_0_beside_the_experts_load_within_their_rounding(tmp_path, arch):
    """The fixture 8 times wider (the same model: HF's 32 greedy tokens, logits 1.05e-4 / 5.3e-5
    from HF's for gpt-oss / deepseek2 over 8 times longer f32 sums, last measured), its
    attention, shared-expert, dense, embedding and LM-head matrices quantized as
    llama-quantize's Q4_K_M leaves them: the loaded weights are gguf's dequantization of the
    blocks (deepseek2's kv_b rebuilt from them), each within its format's rounding of the F32
    file's. (An engine loads a GGUF through the same load_host.)"""
    from jaxserve.weights import load_host

    wide, quantized, plain = (tmp_path / f"{n}.gguf" for n in ("wide", "q", "plain"))
    _rewrite(FIXTURES / arch / "model.gguf", wide, {"{arch}.embedding_length": 256},
             _widened(8))
    _rewrite(wide, quantized, tensors=_llama_quantize)
    originals = {t.name: t.data for t in GGUFReader(str(wide)).tensors}
    types = {}
    for t in GGUFReader(str(quantized)).tensors:
        types[t.name] = t.tensor_type
        if t.tensor_type in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0):
            got = quants.dequantize(t.data, t.tensor_type).reshape(-1, 32)
            err = np.abs(got - originals[t.name].reshape(-1, 32))
            assert (err <= _q_bound(originals[t.name], t.tensor_type)).all(), t.name
    q4_k = "attn_q_a" if arch == "deepseek2" else "attn_q"
    assert types["token_embd.weight"] == types[f"blk.1.{q4_k}.weight"] == GGMLQuantizationType.Q4_K
    q8_0 = "ffn_down" if arch == "deepseek2" else "attn_output"
    assert types[f"blk.0.{q8_0}.weight"] == GGMLQuantizationType.Q8_0
    _rewrite(quantized, plain)  # every tensor as gguf dequantizes it
    _same_tree(load_host(ModelSpec("plain", "gguf", plain))[1],
               load_host(ModelSpec("q", "gguf", quantized))[1])
