"""Tiny random gpt-oss and DeepSeek-V3 models as llama.cpp's converter writes them to GGUF
(its `gpt-oss` and `deepseek2` architectures), beside HF's outputs on the same weights.

    /work/.venv-bench/bin/python tools/make_gguf_gpt_oss_deepseek_fixtures.py [--arch A] [--out D]

Each model comes from transformers' own class (fixed seed), its weights set to what the GGUF
holds: matrices rounded to float16 (F16, as `--outtype f16` writes them; norms, biases, sinks,
routers and the correction bias F32), gpt-oss's experts quantized to MXFP4 (GGML type 39, as
ggml-org's gpt-oss GGUFs keep the release's MXFP4 experts). The file follows llama.cpp's
convert_hf_to_gguf.py (read, not copied): gguf's own name table; gpt-oss's interleaved gate_up
split into ffn_gate_exps / ffn_up_exps, down transposed, MXFP4 blocks repacked to GGML's layout
(the E8M0 scale byte, then element j in the low nibble of byte j and element j + 16 in its high
nibble); DeepSeek's experts stacked per layer, kv_b split into attn_k_b (transposed) / attn_v_b,
the correction bias as exp_probs_b, MLA written as MQA (head_count_kv 1, key_length
kv_lora_rank + rope dims, the real sizes in key_length_mla / value_length_mla), YaRN's
mscale_all_dim as yarn_log_multiplier 0.1 * mscale_all_dim, the sigmoid gating and expert groups
in metadata. Each file carries its family's chat template (tests/chat_templates/) and its
markers as control tokens.

The shapes are what a GGUF can say: gpt-oss's SwiGLU clamp at 7.0 (llama.cpp's fixed value; the
weights are wide enough that it binds), DeepSeek's mscale equal to mscale_all_dim (0.7). Written
files are checked twice here: gguf's dequantization of every MXFP4 expert equals
jaxserve.weights.mxfp4's of the HF blocks, and jaxserve's load of the GGUF equals its load of
the same model saved by save_pretrained, tensor for tensor. Beside each model.gguf:
expected.json (prompts, HF's 32 greedy tokens, gaps, how far each feature moves HF's logits) and
logits.npy; tests/test_gguf_moe.py compares jaxserve with them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_gguf_moe_fixtures import add_vocab, finish_writer, open_writer, record  # noqa: E402
from make_model_fixtures import (GPT_OSS_QUERY_SCALE, SMALL, _sinks_binding,  # noqa: E402
                                 write_tokenizer)

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "tests" / "chat_templates"
HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
           "<|call|>")
DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
            beta_slow=1.0)


def families():
    """The safetensors fixtures' models (tools/make_model_fixtures.py) with what a GGUF can say:
    gpt-oss's clamp at llama.cpp's fixed 7.0 (sliding and full layers alternating, YaRN past 16
    untruncated, 4 experts top-2), DeepSeek's mscale equal to mscale_all_dim (what llama.cpp's
    deepseek2 computes)."""
    from make_model_fixtures import families as model_families

    models = model_families()
    gpt_oss, deepseek = models["gpt_oss"], models["deepseek_v3"]
    return {
        "gpt-oss": (gpt_oss[0], {**gpt_oss[1], "swiglu_limit": 7.0}),
        "deepseek2": (deepseek[0], {**deepseek[1], "rope_parameters": {
            **deepseek[1]["rope_parameters"], "mscale": 0.7, "mscale_all_dim": 0.7}}),
    }


# Wide weights (gpt-oss's clamp at 7 binds), each routing choice and greedy token clear of a tie.
INIT_RANGE = {"gpt-oss": 0.5, "deepseek2": 0.45}
BINDING = {
    "gpt-oss": {"sliding window": dict(sliding_window=64),
                "yarn rope": dict(rope_parameters=dict(rope_type="default", rope_theta=150000.0)),
                "swiglu clamp 7": dict(swiglu_limit=1e6)},
    "deepseek2": {"yarn rope": dict(rope_parameters=dict(rope_type="default", rope_theta=1e4)),
                  "mscale_all_dim": dict(rope_parameters=dict(YARN, rope_theta=1e4, mscale=1.0,
                                                              mscale_all_dim=1.0)),
                  "group-limited routing": dict(topk_group=4),
                  "routed scaling": dict(routed_scaling_factor=1.0),
                  "top-k renormalization": dict(norm_topk_prob=False)},
}


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF's MXFP4 (blocks [..., G, 16]: element 2k in byte k's low nibble, 2k + 1 in its high;
    scales [..., G]) -> GGML's MXFP4 rows [..., G * 17]: per block the scale byte, then element
    j in byte j's low nibble and element j + 16 in its high (llama.cpp's repack)."""
    codes = np.empty((*blocks.shape[:-1], 32), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = blocks & 0x0F, blocks >> 4
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    packed = np.concatenate([scales[..., None], qs], axis=-1)
    return np.ascontiguousarray(packed.reshape(*packed.shape[:-2], -1))


def _gpt_oss_tensors(state: dict, config) -> dict:
    """HF's gpt-oss tensors -> (GGUF name, array, raw GGML type or None), experts in MXFP4."""
    import gguf

    from jaxserve.weights import mxfp4

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, config.num_hidden_layers)
    out = {}
    for name, t in state.items():
        if ".mlp.experts." not in name:
            hf = name + ".weight" if name.endswith("sinks") else name
            out[names.get_name(hf, try_suffixes=(".weight", ".bias"))] = (t, None)
            continue
        pre = name.rsplit(".", 1)[0] + "."
        kind = name.rsplit(".", 1)[1]
        if kind == "gate_up_proj_bias":
            for proj, part in (("gate_proj", t[..., 0::2]), ("up_proj", t[..., 1::2])):
                out[names.get_name(pre + proj + ".bias", try_suffixes=(".bias",))] = (part, None)
        elif kind == "down_proj_bias":
            out[names.get_name(pre + "down_proj.bias", try_suffixes=(".bias",))] = (t, None)
        else:  # [E, in, out] weights: [E, out, in] rows quantized along `in`
            parts = ({"gate_proj": t[..., 0::2], "up_proj": t[..., 1::2]}
                     if kind == "gate_up_proj" else {"down_proj": t})
            for proj, w in parts.items():
                blocks, scales = mxfp4.quantize(np.swapaxes(w, -1, -2))
                new = names.get_name(pre + proj + ".weight", try_suffixes=(".weight",))
                out[new] = (ggml_mxfp4(blocks, scales), gguf.GGMLQuantizationType.MXFP4)
    return out


def _deepseek_tensors(state: dict, config) -> dict:
    import gguf

    c = config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, c.num_hidden_layers)
    out = {}
    for name, t in state.items():
        if ".mlp.experts." in name:
            continue
        if name.endswith("kv_b_proj.weight"):
            kv_b = t.reshape(c.num_key_value_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
            k_b, v_b = kv_b[:, :c.qk_nope_head_dim], kv_b[:, c.qk_nope_head_dim:]
            for n, w in (("k_b_proj", k_b.swapaxes(1, 2)), ("v_b_proj", v_b)):
                new = names.get_name(name.replace("kv_b_proj", n), try_suffixes=(".weight",))
                out[new] = (w, None)
            continue
        hf = name.replace("e_score_correction_bias", "e_score_correction.bias")
        out[names.get_name(hf, try_suffixes=(".weight", ".bias"))] = (t, None)
    for i in range(c.first_k_dense_replace, c.num_hidden_layers):  # experts: one [E, out, in]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = np.stack([state[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"]
                                for e in range(c.n_routed_experts)])
            new = names.get_name(f"model.layers.{i}.mlp.experts.{proj}.weight",
                                 try_suffixes=(".weight",))
            out[new] = (stacked, None)
    return out


def write_gguf(path: Path, arch: str, config, state: dict) -> None:
    import gguf

    c = config
    w = open_writer(path, arch, c)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_used_count(c.num_experts_per_tok)
    rope = c.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if arch == "gpt-oss":
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_expert_count(c.num_local_experts)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_sliding_window(c.sliding_window)
        w.add_expert_feed_forward_length(c.intermediate_size)
        add_vocab(w, c.bos_token_id, c.eos_token_id, HARMONY,
                  (TEMPLATES / "gpt_oss.jinja").read_text())
        tensors = _gpt_oss_tensors(state, c)
    else:
        w.add_head_count_kv(1)  # MLA as MQA over the latent
        w.add_expert_count(c.n_routed_experts)
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_leading_dense_block_count(c.first_k_dense_replace)
        w.add_vocab_size(c.vocab_size)
        w.add_q_lora_rank(c.q_lora_rank)
        w.add_kv_lora_rank(c.kv_lora_rank)
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length_mla(c.v_head_dim)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        w.add_expert_weights_norm(c.norm_topk_prob)
        w.add_rope_dimension_count(c.qk_rope_head_dim)
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
        add_vocab(w, c.bos_token_id, c.eos_token_id, DEEPSEEK[2:],
                  (TEMPLATES / "deepseek_v3.jinja").read_text(), ("<pad>", *DEEPSEEK[:2]))
        tensors = _deepseek_tensors(state, c)
    finish_writer(w, tensors)


def _set_to_file_values(model, arch: str) -> None:
    """The HF model's weights -> what the GGUF holds: f16 matrices (f32 where the converter keeps
    f32), gpt-oss's experts MXFP4-rounded (checked against gguf's dequantization later)."""
    import torch

    from jaxserve.weights import mxfp4

    with torch.no_grad():
        for n, p in model.named_parameters():
            if arch == "gpt-oss" and n.endswith(("experts.gate_up_proj", "experts.down_proj")):
                w = p.detach().numpy()
                q = mxfp4.dequantize(*mxfp4.quantize(np.swapaxes(w, -1, -2)))
                p.copy_(torch.from_numpy(np.swapaxes(q, -1, -2)))
            elif p.ndim >= 2 and not n.endswith(("router.weight", "mlp.gate.weight")):
                p.copy_(p.half().float())


def _randomize(model, arch: str, experts: int) -> None:
    """Routers wide (every top-k clear), gpt-oss's biases and sinks and DeepSeek's correction
    bias random (HF starts them at 0)."""
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            if (n.endswith("gate.weight") and p.shape[0] == experts) or (
                    arch == "gpt-oss" and n.endswith(("router.weight", "bias", "sinks"))):
                p.normal_(0.0, 1.0)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
        if arch == "gpt-oss":
            for n, p in model.named_parameters():
                if ".q_proj." in n:
                    p.mul_(GPT_OSS_QUERY_SCALE)


def _check_file(path: Path, hf_dir: Path, state: dict) -> None:
    """gguf's MXFP4 dequantization = jaxserve.weights.mxfp4's; jaxserve's load of the GGUF =
    its load of the safetensors directory, tensor for tensor."""
    from gguf import GGUFReader, GGMLQuantizationType, quants

    from jaxserve.model_registry import ModelSpec
    from jaxserve.weights import load_host

    for t in GGUFReader(str(path)).tensors:
        if t.tensor_type == GGMLQuantizationType.MXFP4:
            layer, proj = t.name.split(".")[1], t.name.split(".")[2].split("_")[1]
            experts = f"model.layers.{layer}.mlp.experts."
            if proj == "down":
                hf = state[experts + "down_proj"]
            else:  # HF's gate / up columns interleaved: gate's even, up's odd
                first = 0 if proj == "gate" else 1
                hf = state[experts + "gate_up_proj"][..., first::2]
            assert np.array_equal(quants.dequantize(t.data, t.tensor_type),
                                  np.swapaxes(hf, -1, -2)), t.name
    _, want = load_host(ModelSpec("hf", "hf", hf_dir))
    _, got = load_host(ModelSpec("gguf", "gguf", path))

    def same(a: dict, b: dict, where: str = "") -> None:
        assert a.keys() == b.keys(), (where, a.keys() ^ b.keys())
        for k in a:
            if isinstance(a[k], dict):
                same(a[k], b[k], f"{where}{k}.")
            else:
                np.testing.assert_array_equal(a[k], b[k], err_msg=f"{where}{k}")

    same(want, got)


def build(arch: str, config_cls, changes: dict, out: Path, init_range: float) -> None:
    import torch
    import transformers as tf
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    shape = {k: v for k, v in SMALL.items() if not (arch == "deepseek2" and k == "head_dim")}
    config = config_cls(**{**shape, **changes}, initializer_range=init_range)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    experts = changes.get("num_local_experts", changes.get("n_routed_experts"))
    _randomize(model, arch, experts)
    _set_to_file_values(model, arch)
    path = out / arch
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:  # the released layout, f32
        model.save_pretrained(tmp, safe_serialization=True)
        write_tokenizer(Path(tmp))
        state = load_file(str(Path(tmp) / "model.safetensors"))
        write_gguf(path / "model.gguf", arch, config, state)
        _check_file(path / "model.gguf", Path(tmp), state)

    def sinks(m, ids) -> dict:  # gpt-oss's logits with its sinks at -inf
        return {"attention sinks": _sinks_binding(m, ids)}

    record(model, path, lambda **off: config_cls(
        **{**shape, **changes, **off}, initializer_range=init_range), BINDING[arch], init_range,
        sinks if arch == "gpt-oss" else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "gguf"))
    p.add_argument("--arch", choices=list(INIT_RANGE), action="append")
    args = p.parse_args()
    for arch, (cls, changes) in families().items():
        if arch in (args.arch or INIT_RANGE):
            build(arch, cls, changes, Path(args.out), INIT_RANGE[arch])


if __name__ == "__main__":
    main()
