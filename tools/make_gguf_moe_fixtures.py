"""Tiny random mixtures of experts as llama.cpp's converter writes them to GGUF, beside HF's outputs.

    /work/.venv-bench/bin/python tools/make_gguf_moe_fixtures.py [--out tests/fixtures/gguf]

For Qwen3-MoE (llama.cpp's `qwen3moe`) and Mixtral (`llama` with `llama.expert_count`): the model
from transformers' own class (fixed seed, routers wide enough that no routing choice is close),
its weights rounded to float16 so that the GGUF (`--outtype f16`, as convert_hf_to_gguf.py writes:
matrices F16; norms, 1-D tensors and the router `ffn_gate_inp` F32) holds exactly HF's weights.
The GGUF follows llama.cpp's converter (convert_hf_to_gguf.py, read, not copied): each layer's
experts stacked into one [E, out, in] tensor named by gguf's own table (`ffn_{gate,up,down}_exps`),
the router `ffn_gate_inp`, Llama's Q/K rows permuted to interleaved rope pairs, its metadata keys
(expert_count, expert_used_count, expert_feed_forward_length), and a byte-level token list.
The shapes are llama.cpp's: every Qwen3-MoE layer sparse with top-k renormalized (llama.cpp
always renormalizes for qwen3moe), Mixtral without a window (llama.cpp's `llama` has none).
Beside each model.gguf: expected.json (prompts, HF's 32 greedy tokens for each, gaps, how far each
feature moves HF's logits) and logits.npy (HF's logits over the first prompt), as
tools/make_model_fixtures.py records them. tests/test_gguf_moe.py compares jaxserve with them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
from make_model_fixtures import (PROMPTS, SMALL, VOCAB, _watch_routers, feature_binding,
                                 greedy)


def families():
    import transformers as tf

    return {
        "qwen3moe": (tf.Qwen3MoeConfig, dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            tie_word_embeddings=False, rope_parameters=dict(rope_type="default",
                                                            rope_theta=1e6))),
        "mixtral": (tf.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=None)),
    }


BINDING = {
    "qwen3moe": {"top-k renormalization": dict(norm_topk_prob=False),
                 "top-2 routing": dict(num_experts_per_tok=1)},
    "mixtral": {"top-2 routing": dict(num_experts_per_tok=1)},
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for `llama`: each head's two halves interleaved pair by pair."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def _stack_experts(state: dict, arch: str, layers: int, experts: int) -> dict:
    """HF's per-expert tensors -> the converter's merged [E, out, in] names (gguf maps those)."""
    block, names = (("mlp", ("gate_proj", "up_proj", "down_proj")) if arch == "qwen3moe"
                    else ("block_sparse_moe", ("w1", "w3", "w2")))
    out = {k: v for k, v in state.items() if ".experts." not in k}
    for i in range(layers):
        for n in names:
            out[f"model.layers.{i}.{block}.experts.{n}.weight"] = np.stack([
                state[f"model.layers.{i}.{block}.experts.{e}.{n}.weight"]
                for e in range(experts)])
    return out


def add_vocab(w, bos: int, eos: int, specials: tuple[str, ...] = (),
              chat_template: str | None = None,
              first: tuple[str, str, str] = ("<pad>", "<s>", "</s>")) -> None:
    """A byte-level (gpt2) token list of VOCAB names: `first` (pad, bos, eos), then `specials` (a
    chat format's markers, control tokens as llama.cpp's converter marks them), then t{i}."""
    import gguf

    control = [*first, *specials]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(control + [f"t{i}" for i in range(len(control), VOCAB)])
    w.add_token_types([gguf.TokenType.CONTROL] * len(control)
                      + [gguf.TokenType.NORMAL] * (VOCAB - len(control)))
    w.add_token_merges([])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def open_writer(path: Path, arch: str, c):
    """A GGUFWriter holding the keys every converter writes first (the model's shape)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.parent.name)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    return w


def finish_writer(w, tensors: dict) -> None:
    """Write `tensors` (GGUF name -> (array, raw GGML type or None)) as `--outtype f16` does:
    raw ones as they are, 1-D tensors, norms and the router F32, other matrices F16."""
    for name, (t, raw) in tensors.items():
        if raw is not None:
            w.add_tensor(name, t, raw_dtype=raw)
            continue
        f32 = t.ndim <= 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight"))
        w.add_tensor(name, t.astype(np.float32 if f32 else np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(path: Path, arch: str, config, state: dict) -> None:
    import gguf

    c = config
    w = open_writer(path, arch, c)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_experts if arch == "qwen3moe" else c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    else:  # LlamaModel's own keys
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(c.head_dim)
    add_vocab(w, c.bos_token_id, c.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    experts = c.num_experts if arch == "qwen3moe" else c.num_local_experts
    tensors = {}
    for name, t in _stack_experts(state, arch, c.num_hidden_layers, experts).items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, c.num_attention_heads if "q_proj" in name
                         else c.num_key_value_heads)
        tensors[names.get_name(name, try_suffixes=(".weight",))] = (t, None)
    finish_writer(w, tensors)


def build(arch: str, config_cls, changes: dict, out: Path, init_range: float) -> None:
    import torch
    import transformers as tf
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    config = config_cls(**{**SMALL, **changes}, initializer_range=init_range)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    experts = changes.get("num_experts", changes.get("num_local_experts"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("gate.weight") and p.shape[0] == experts:
                p.normal_(0.0, 1.0)  # routers wide: each token's top-2 is clear
            p.copy_(p.half().float())  # what an F16 GGUF holds
    path = out / arch
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:  # the released layout: an expert per tensor
        model.save_pretrained(tmp, safe_serialization=True)
        state = load_file(str(Path(tmp) / "model.safetensors"))
    write_gguf(path / "model.gguf", "llama" if arch == "mixtral" else arch, config, state)
    record(model, path, lambda **off: config_cls(
        **{**SMALL, **changes, **off}, initializer_range=init_range), BINDING[arch], init_range)


def record(model, path: Path, make_config, offs: dict, init_range: float,
           more_binding=None) -> None:
    """HF's outputs beside the file: logits.npy over prompt 0 and expected.json (the prompts, HF's
    32 greedy tokens for each, the smallest top-2 and routing gaps, how far switching off each
    feature of `offs` moves HF's logits, plus `more_binding(model, ids)`'s)."""
    import torch
    import transformers as tf

    with torch.no_grad():
        np.save(path / "logits.npy", model(torch.tensor([PROMPTS[0]])).logits[0].float().numpy())
    route_gaps = _watch_routers(model)
    results = [greedy(model, p) for p in PROMPTS]
    full = torch.tensor([PROMPTS[0] + results[0][0]])
    binding = feature_binding(model, make_config, offs, full)
    binding.update(more_binding(model, full) if more_binding else {})
    expected = {"prompts": PROMPTS, "greedy": [r[0] for r in results], "binding": binding,
                "min_top2_gap": min(r[1] for r in results), "min_route_gap": min(route_gaps),
                "transformers": tf.__version__, "initializer_range": init_range}
    (path / "expected.json").write_text(json.dumps(expected, indent=1))
    print(f"{path.name}: min top-2 gap {expected['min_top2_gap']:.4f}, route gap "
          f"{expected['min_route_gap']:.4f}, binding {binding}, "
          f"{sum(f.stat().st_size for f in path.iterdir()) / 1024:.0f} KiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"
                                        / "gguf"))
    p.add_argument("--init-range", type=float, default=0.6)  # clearest routing, top-2 gaps
    args = p.parse_args()
    for arch, (cls, changes) in families().items():
        build(arch, cls, changes, Path(args.out), args.init_range)


if __name__ == "__main__":
    main()
