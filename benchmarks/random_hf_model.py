"""A random-weight HF checkpoint of one family in SmolLM2-135M's shape (30 layers, hidden 576, 9 query
/ 3 KV heads of 64, MLP 1536, SmolLM2's vocabulary and tokenizer), built by transformers' own class
and saved with save_pretrained: a benchmark subject for a family whose real weights this machine
cannot download (issue 43: the throughput benchmark on a non-Llama family). Needs the bench extra.

    python benchmarks/random_hf_model.py --family qwen3 --out DIR
    python benchmarks/throughput.py --model DIR --compare hf
"""

from __future__ import annotations

import argparse
from pathlib import Path

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=100000.0,
             bos_token_id=1, eos_token_id=2)
FAMILIES = {"qwen3": "Qwen3Config", "llama": "LlamaConfig", "gemma3_text": "Gemma3TextConfig"}


def main() -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve.model_registry import fetch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    config = getattr(transformers, FAMILIES[args.family])(**SHAPE)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.out)
    gguf = fetch("smollm2-135m-instruct", quiet=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(args.out)
    params = sum(t.numel() for t in model.parameters())
    print(f"{args.family}: {params / 1e6:.1f}M parameters (random, seed {args.seed}) in {args.out}")


if __name__ == "__main__":
    main()
