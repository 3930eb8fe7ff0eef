"""The gpt-oss fixture as an MXFP4 checkpoint, written the way the released gpt-oss checkpoints
store their experts, and read back by HF transformers itself.

    /work/.venv-bench/bin/python tools/make_mxfp4_fixture.py

Each layer's expert weights (`mlp.experts.gate_up_proj` [E, H, 2I], `mlp.experts.down_proj`
[E, I, H]) become `*_blocks` uint8 [E, out, in / 32, 16] and `*_scales` uint8 [E, out, in / 32]
(jaxserve.weights.mxfp4.quantize: a power-of-two scale per 32 values, FP4 e2m1 codes two per
byte); their biases, attention, routers, embeddings and norms stay f32 (the releases keep them
bf16), and config.json gets the releases' quantization_config. transformers (bench venv) checks
the format: its own `convert_moe_packed_tensors` must dequantize every expert tensor to
jaxserve's values exactly, and its GptOss loading of the directory (dequantized on a CPU) must
hold those values; its outputs on the MXFP4 directory are the fixture: logits.npy over the first
prompt and expected.json's greedy tokens, plus `vs_original`: how far MXFP4 moved HF's logits.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_model_fixtures import PROMPTS, greedy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "fixtures" / "models" / "gpt_oss"
OUT = ROOT / "tests" / "fixtures" / "quantized" / "gpt_oss_mxfp4"
EXPERTS = ("gate_up_proj", "down_proj")
# As in the released gpt-oss config.json.
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def main() -> None:
    import torch
    import transformers as tf
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from jaxserve.weights import mxfp4

    tensors = load_file(str(SOURCE / "model.safetensors"))
    out, dequantized = {}, {}
    for name, t in tensors.items():
        if not name.endswith(tuple(f"experts.{e}" for e in EXPERTS)):
            out[name] = t
            continue
        blocks, scales = mxfp4.quantize(np.swapaxes(t, -1, -2))  # [E, out, in]: `in` in blocks
        out[name + mxfp4.BLOCKS], out[name + mxfp4.SCALES] = blocks, scales
        dequantized[name] = np.swapaxes(mxfp4.dequantize(blocks, scales), -1, -2)
        hf = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                        dtype=torch.float32).numpy()
        assert np.array_equal(hf, dequantized[name]), f"{name}: HF dequantizes it otherwise"
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    save_file(out, str(OUT / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((SOURCE / "config.json").read_text())
    (OUT / "config.json").write_text(json.dumps({**cfg, "quantization_config":
                                                 QUANTIZATION_CONFIG}, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(SOURCE / f, OUT / f)

    model = tf.AutoModelForCausalLM.from_pretrained(OUT, dtype=torch.float32).eval()
    loaded = dict(model.named_parameters())
    for name, want in dequantized.items():
        got = loaded[name].detach().float().numpy()
        assert np.array_equal(got, want), f"{name}: HF loaded other values"
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]])).logits[0].float().numpy()
    np.save(OUT / "logits.npy", logits)
    results = [greedy(model, p) for p in PROMPTS]
    expected = {"prompts": PROMPTS, "greedy": [r[0] for r in results],
                "min_top2_gap": min(r[1] for r in results),
                "vs_original": float(np.abs(logits - np.load(SOURCE / "logits.npy")).max()),
                "transformers": tf.__version__}
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1))
    print(f"gpt_oss_mxfp4: min top-2 gap {expected['min_top2_gap']:.4f}, logits moved "
          f"{expected['vs_original']:.3f} by MXFP4, "
          f"{sum(f.stat().st_size for f in OUT.iterdir()) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
