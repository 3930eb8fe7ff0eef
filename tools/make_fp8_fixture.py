"""The Qwen3-MoE fixture as an FP8 block-quantized checkpoint, written the way the FP8 releases
(Qwen3-*-FP8, DeepSeek-V3/R1) store theirs, and read back by HF transformers itself.

    /work/.venv-bench/bin/python tools/make_fp8_fixture.py [--block 16,16]
    /work/.venv-bench/bin/python tools/make_fp8_fixture.py --source tests/fixtures/models/deepseek_v3 \
        --out tests/fixtures/quantized/deepseek_v3_fp8      # DeepSeek-V3's release format

Every Linear weight of attention and the MLPs (the experts', the dense layer's) is quantized by
transformers' own FineGrainedFP8 quantizer op (Fp8Quantize: a float8_e4m3fn `weight` and an f32
`weight_scale_inv` per block); the embeddings, norms and routers (`mlp.gate`) stay f32, as in the
releases. config.json gets quantization_config {"quant_method": "fp8", "weight_block_size": ...}.
The tiny model's widths (32, 64) are multiples of 16, not 128: the format allows any block size
and transformers reads it. transformers then loads the directory (on a CPU it dequantizes FP8
checkpoints at load, as jaxserve does) and its outputs are the fixture: logits.npy over the first
prompt and expected.json's greedy tokens, plus hf_dequantized.npz, a few weights as transformers
dequantized them, and expected.json's `vs_original`: how far quantization moved HF's logits.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_model_fixtures import PROMPTS, greedy  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "models"
# Tensors compared weight for weight in the test (HF's names after loading).
CHECKED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
           "model.layers.2.mlp.experts.gate_up_proj",
           # DeepSeek-V3 (--source tests/fixtures/models/deepseek_v3):
           "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
           "model.layers.0.self_attn.q_b_proj.weight", "model.layers.0.mlp.down_proj.weight",
           "model.layers.1.mlp.shared_experts.up_proj.weight")


def quantized(name: str) -> bool:
    """A Linear weight of attention or an MLP (not embeddings, norms, routers, the LM head)."""
    # (DeepSeek-V3's releases quantize kv_a_proj_with_mqa too.)
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and ".layers." in name


def main() -> None:
    import torch
    import transformers as tf
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, default=FIXTURES / "qwen3_moe")
    p.add_argument("--out", type=Path, default=FIXTURES.parent / "quantized" / "qwen3_moe_fp8")
    p.add_argument("--block", default="16,16", help="weight_block_size, rows,cols")
    args = p.parse_args()
    block = [int(b) for b in args.block.split(",")]

    qconfig = tf.FineGrainedFP8Config(weight_block_size=block)
    quantize = Fp8Quantize(type("Quantizer", (), {"quantization_config": qconfig})())
    tensors = {}
    for name, t in load_file(args.source / "model.safetensors").items():
        tensors.update(quantize._quantize_one(name, t) if quantized(name) else {name: t})
    assert sum(t.dtype == torch.float8_e4m3fn for t in tensors.values()) > 0
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, args.out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((args.source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic", "weight_block_size": block}
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(args.source / f, args.out / f)

    model = tf.AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    state = model.state_dict()
    assert all(v.dtype == torch.float32 for v in state.values()), "HF kept FP8 weights"
    np.savez(args.out / "hf_dequantized.npz",
             **{n: state[n].numpy() for n in CHECKED if n in state})
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]])).logits[0].float().numpy()
    np.save(args.out / "logits.npy", logits)
    results = [greedy(model, prompt) for prompt in PROMPTS]
    original = np.load(args.source / "logits.npy")
    original_greedy = json.loads((args.source / "expected.json").read_text())["greedy"]
    expected = {"prompts": PROMPTS, "greedy": [r[0] for r in results],
                "min_top2_gap": min(r[1] for r in results), "weight_block_size": block,
                "vs_original": {"max_logit_diff": float(np.abs(logits - original).max()),
                                "max_logit": float(np.abs(original).max()),
                                "same_greedy_steps": [
                                    next((i for i, (a, b) in enumerate(zip(r[0], o)) if a != b),
                                         len(o)) for r, o in zip(results, original_greedy)]},
                "transformers": tf.__version__}
    (args.out / "expected.json").write_text(json.dumps(expected, indent=1))
    print(f"{args.out.name}: vs the original: {expected['vs_original']}, "
          f"{sum(f.stat().st_size for f in args.out.iterdir()) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
