"""Tiny random-weight models of each family, built and run by HF transformers itself.

    /work/.venv-bench/bin/python tools/make_model_fixtures.py [--out tests/fixtures/models]

For each family: the model from transformers' own class (`from_config`, fixed seed, an initializer
range wide enough that greedy decoding is decisive), saved with `save_pretrained` (config.json as
the installed transformers writes it: rope_parameters, layer_types) beside a tiny word-level
tokenizer.json, plus expected.json: the prompts (token ids), HF's 32 greedy tokens for each
(decoded step by step with HF's KV cache, as HF's generate does) and the smallest top-1 / top-2
logit gap met on the way; and logits.npy, HF's f32 logits over the first prompt. The shapes make
each family's distinctive math bind: windows shorter than the prompts, soft caps below the
scores, rope scaling whose original context the prompt or the generation passes; the mixtures of
experts route each token to 2 of 4 experts whose router weights are wide enough that no choice is
close (expected.json's min_route_gap: the smallest gap between a k-th and (k+1)-th router logit
met), and Qwen3-MoE keeps one dense layer (mlp_only_layers).
tests/test_model_families.py compares jaxserve with these; the suite needs no torch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

VOCAB, STEPS = 128, 32
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Prompt 1 shares prompt 0's first 16 tokens (prefix caching); all pass the 8-token windows.
_rng = np.random.default_rng(0)
_P0 = _rng.integers(3, VOCAB, 20).tolist()
PROMPTS = [_P0, _P0[:16] + _rng.integers(3, VOCAB, 5).tolist(), _rng.integers(3, VOCAB, 13).tolist()]
# gpt-oss's queries (weights and biases) at 0.3 of the other weights' width (here and in
# make_gguf_gpt_oss_deepseek_fixtures): at full width the first layer's attention scores reached
# 45, so sharp that one ulp more or less in its queries or keys (another summation order) moved
# the logits by up to 1.6e-4, past the 1e-4 they are checked to (HF's own f32 run, one ulp of
# perturbation at each op's output, 30 draws: the GGUF fixture's logits moved 1.2e-4 in the median
# draw, 19 draws past 1e-4; the safetensors one's 6.3e-5, 4 past). At 0.3 the scores stay near 14
# and the same perturbation moves them 3.1e-5 / 2.7e-5 in the median, 7.8e-5 / 7.0e-5 at most
# (0.25 left a routing choice 6.9e-4 from a tie).
GPT_OSS_QUERY_SCALE = 0.3


def families():
    import transformers as tf

    window = dict(sliding_window=8)
    return {
        # Llama 3.1 rope scaling, its original context (16) passed by every prompt.
        "llama": (tf.LlamaConfig, dict(rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=16))),
        "mistral": (tf.MistralConfig, dict(**window)),
        "qwen2": (tf.Qwen2Config, dict(rope_parameters=dict(rope_type="default", rope_theta=1e6),
                                       tie_word_embeddings=True)),
        "qwen3": (tf.Qwen3Config, dict(rope_parameters=dict(rope_type="default", rope_theta=1e6),
                                       tie_word_embeddings=True)),
        # Soft caps well below the scores and logits of these weights, so both bind.
        "gemma2": (tf.Gemma2Config, dict(**window, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=4.0)),
        # Six layers: the 5 local : 1 global pattern; the global layers' rope linearly scaled.
        "gemma3_text": (tf.Gemma3TextConfig, dict(
            **window, num_hidden_layers=6, query_pre_attn_scalar=16, rope_parameters={
                "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})),
        # Phi-4-mini's shape: longrope past an original context of 24 (the generation crosses
        # it), rope on 3/4 of each head.
        # (Phi-3 derives head_dim from hidden_size / heads: 64 / 4.)
        "phi3": (tf.Phi3Config, dict(
            hidden_size=64, max_position_embeddings=96, original_max_position_embeddings=24,
            rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                 partial_rotary_factor=0.75,
                                 short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                 long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0]))),
        "mixtral": (tf.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2,
                                           **window)),
        # Three layers: the middle one dense; top-k weights not renormalized (the HF default).
        "qwen3_moe": (tf.Qwen3MoeConfig, dict(
            num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e6))),
        # gpt-oss: sliding (window 8) and full layers alternating, YaRN past an original context
        # of 16 untruncated as gpt-oss sets it, 4 experts top-2 with router and expert biases,
        # a SwiGLU clamp the activations reach, attention sinks and biases.
        "gpt_oss": (tf.GptOssConfig, dict(
            num_local_experts=4, num_experts_per_tok=2, swiglu_limit=2.0, **window,
            rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                 original_max_position_embeddings=16, beta_fast=32.0,
                                 beta_slow=1.0, truncate=False))),
        # DeepSeek-V3: multi-head latent attention (q and kv low-rank, v_head_dim != the qk
        # head's, rope on interleaved pairs), YaRN past an original context of 16 with both
        # mscales, one dense layer then two of 8 routed experts in 4 groups (top-2 groups, top-2
        # experts, sigmoid scores, a correction bias) plus a shared expert.
        "deepseek_v3": (tf.DeepseekV3Config, dict(
            num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_group=4,
            topk_group=2, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            rope_interleave=True, num_nextn_predict_layers=0,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                 original_max_position_embeddings=16, beta_fast=32, beta_slow=1,
                                 mscale=1.0, mscale_all_dim=0.7))),
    }


# Per family, HF config changes that switch its distinctive features off: the fixture records how
# far each moves HF's logits over prompt 0 and its greedy tokens (the test wants > 1e-2), so the
# comparison is known to exercise them.
BINDING = {
    "llama": {"llama3 rope scaling": dict(rope_parameters=dict(rope_type="default",
                                                               rope_theta=500000.0))},
    "mistral": {"sliding window": dict(sliding_window=None)},
    "qwen2": {"rope theta 1e6": dict(rope_parameters=dict(rope_type="default",
                                                          rope_theta=10000.0))},
    "qwen3": {"rope theta 1e6": dict(rope_parameters=dict(rope_type="default",
                                                          rope_theta=10000.0))},
    "mixtral": {"sliding window": dict(sliding_window=None),
                "top-2 routing": dict(num_experts_per_tok=1)},
    "qwen3_moe": {"norm_topk_prob off": dict(norm_topk_prob=True),
                  "top-2 routing": dict(num_experts_per_tok=1)},
    "gpt_oss": {"sliding window": dict(sliding_window=64),
                "yarn rope": dict(rope_parameters=dict(rope_type="default", rope_theta=150000.0)),
                "swiglu clamp": dict(swiglu_limit=1e6)},
    "deepseek_v3": {"yarn rope": dict(rope_parameters=dict(rope_type="default",
                                                          rope_theta=10000.0)),
                    "softmax mscale": dict(rope_parameters=dict(
                        rope_type="yarn", rope_theta=10000.0, factor=4.0,
                        original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0)),
                    "rope interleave": dict(rope_interleave=False),
                    "group-limited routing": dict(topk_group=4),
                    "routed scaling": dict(routed_scaling_factor=1.0),
                    "top-k renormalization": dict(norm_topk_prob=False)},
    "gemma2": {"attention soft cap": dict(attn_logit_softcapping=None),
               "final soft cap": dict(final_logit_softcapping=None),
               "sliding window": dict(sliding_window=64)},
    "gemma3_text": {"sliding window": dict(sliding_window=64),
                    "local rope base": dict(rope_parameters={
                        "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                        "sliding_attention": dict(rope_type="default", rope_theta=1e6)}),
                    "global rope scaling": dict(rope_parameters={
                        "full_attention": dict(rope_type="default", rope_theta=1e6),
                        "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})},
}


def write_tokenizer(path: Path) -> None:
    """A word-level tokenizer over names t0..t127 (ids as prompts; text only for the server)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab.update({"<pad>": 0, "<s>": 1, "</s>": 2})
    del vocab["t0"], vocab["t1"], vocab["t2"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))


def greedy(model, prompt: list[int]) -> tuple[list[int], float]:
    """32 greedy tokens decoded with HF's cache, and the smallest top-1 / top-2 gap."""
    import torch

    ids = torch.tensor([prompt])
    out, past, gap = [], None, np.inf
    with torch.no_grad():
        for _ in range(STEPS):
            res = model(ids, past_key_values=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[0, -1].double().numpy()
            top = np.sort(logits)[-2:]
            gap = min(gap, float(top[1] - top[0]))
            out.append(int(logits.argmax()))
            ids = torch.tensor([[out[-1]]])
    return out, gap


def _watch_routers(model) -> list[float]:
    """For a mixture of experts, a list that collects, per router call while the model runs,
    the smallest gap between a token's k-th and (k+1)-th router logits: how far from a tie every
    routing decision was (the top-k of the softmax is that of the logits)."""
    gaps = []

    def hook(module, inputs, output):
        logits = output[0].double().sort(dim=-1, descending=True).values
        gaps.append(float((logits[:, module.top_k - 1] - logits[:, module.top_k]).min()))

    def grouped_hook(module, inputs, output):
        # DeepSeek-V3: experts chosen by sigmoid score + correction bias within the topk_group
        # best groups (a group's score: its best two): both choices' gaps count.
        scores = output[0].double().sigmoid() + module.e_score_correction_bias.double()
        groups = scores.view(scores.shape[0], module.num_group, -1).topk(2).values.sum(-1)
        ranked = groups.sort(dim=-1, descending=True).values
        k = module.topk_group
        if k < module.num_group:
            gaps.append(float((ranked[:, k - 1] - ranked[:, k]).min()))
        keep = groups >= ranked[:, k - 1:k]
        masked = scores.masked_fill(~keep.repeat_interleave(scores.shape[1] // module.num_group,
                                                            dim=1), float("-inf"))
        top = masked.sort(dim=-1, descending=True).values
        gaps.append(float((top[:, module.top_k - 1] - top[:, module.top_k]).min()))

    for n, module in model.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(hook)
        elif type(module).__name__ == "DeepseekV3TopkRouter":
            module.register_forward_hook(grouped_hook)
    return gaps


def feature_binding(model, make_config, offs: dict, ids) -> dict[str, float]:
    """How far HF's logits over `ids` move with each feature of `offs` (name -> config changes)
    switched off, the same weights loaded: make_config(**changes) builds the other config."""
    import torch
    import transformers as tf

    moved = {}
    for feature, off in offs.items():
        other = tf.AutoModelForCausalLM.from_config(make_config(**off), dtype=torch.float32).eval()
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            moved[feature] = float((other(ids).logits - model(ids).logits).abs().max())
    return moved


def _sinks_binding(model, ids) -> float:
    """How far gpt-oss's logits move with its attention sinks at -inf (no sink)."""
    import torch

    with torch.no_grad():
        want = model(ids).logits
        saved = {n: p.clone() for n, p in model.named_parameters() if n.endswith("sinks")}
        for n, p in model.named_parameters():
            if n in saved:
                p.fill_(-1e9)
        moved = float((model(ids).logits - want).abs().max())
        for n, p in model.named_parameters():
            if n in saved:
                p.copy_(saved[n])
    return moved


def build(name: str, config_cls, changes: dict, out: Path, init_range: float) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    # (Phi-3 derives head_dim from hidden_size / heads, DeepSeek-V3 from qk_rope_head_dim.)
    shape = {k: v for k, v in SMALL.items()
             if not (name in ("phi3", "deepseek_v3") and k == "head_dim")}
    config = config_cls(**{**shape, **changes}, initializer_range=init_range)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if name.startswith("gemma"):
        # HF starts Gemma's (1 + w) norms at w = 0; random w makes a dropped offset visible.
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.normal_(0.0, 0.3)
    if "moe" in name or name in ("mixtral", "deepseek_v3", "gpt_oss"):
        # Routers wide enough that each token's top-2 is clear (HF starts Qwen3-MoE's at 0).
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("gate.weight") and p.shape[0] == changes.get(
                        "num_experts", changes.get("num_local_experts",
                                                   changes.get("n_routed_experts"))):
                    p.normal_(0.0, 1.0)
            # gpt-oss: its router wide, its biases and sinks random (HF starts biases at 0).
            for n, p in model.named_parameters():
                if name == "gpt_oss" and n.endswith(("router.weight", "bias", "sinks")):
                    p.normal_(0.0, 1.0)
            for n, p in model.named_parameters():
                if name == "gpt_oss" and ".q_proj." in n:
                    p.mul_(GPT_OSS_QUERY_SCALE)
            # DeepSeek-V3's score correction bias (HF starts it at 0): random, so it binds.
            for n, b in model.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.3)
    path = out / name
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]])).logits[0].float().numpy()
    np.save(path / "logits.npy", logits)
    route_gaps = _watch_routers(model)
    results = [greedy(model, p) for p in PROMPTS]
    full = torch.tensor([PROMPTS[0] + results[0][0]])
    changes_off = dict(BINDING.get(name, {}))
    if name == "phi3":
        rope = dict(changes["rope_parameters"], long_factor=changes["rope_parameters"]["short_factor"])
        changes_off["longrope long factors"] = dict(rope_parameters=rope)
    binding = feature_binding(model, lambda **off: config_cls(
        **{**shape, **changes, **off}, initializer_range=init_range), changes_off, full)
    if name == "gpt_oss":
        binding["attention sinks"] = _sinks_binding(model, full)
    expected = {"prompts": PROMPTS, "greedy": [r[0] for r in results], "binding": binding,
                "min_top2_gap": min(r[1] for r in results),
                **({"min_route_gap": min(route_gaps)} if route_gaps else {}),
                "transformers": tf.__version__, "initializer_range": init_range}
    (path / "expected.json").write_text(json.dumps(expected, indent=1))
    print(f"{name}: min top-2 gap {expected['min_top2_gap']:.4f}, "
          f"{sum(f.stat().st_size for f in path.iterdir()) / 1024:.0f} KiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"
                                        / "models"))
    p.add_argument("--families", default=None, help="comma-separated subset")
    p.add_argument("--init-range", type=float, default=0.5)
    args = p.parse_args()
    chosen = families()
    if args.families:
        chosen = {k: chosen[k] for k in args.families.split(",")}
    for name, (cls, changes) in chosen.items():
        build(name, cls, changes, Path(args.out), args.init_range)


if __name__ == "__main__":
    main()
