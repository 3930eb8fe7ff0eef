"""BERT encoder (all-MiniLM-L6-v2 and other HF `BertModel`s) for sentence embeddings.

`embed(params, config, input_ids, attention_mask)` is a pure function: token ids [B, L] and their
mask -> L2-normalised mean-pooled embeddings [B, H]; `token_vectors` returns the L2-normalised
per-token states instead. Callers jit them per (B, L) bucket with `config` static (see
jaxserve.rag.embedder).

Layout: one encoder block is a linen module; the blocks' parameters are stacked on a leading axis
and run with `jax.lax.scan`, as in jaxserve.executor.models.decoder, so compile time does not grow
with depth.
The tree:
    word_embeddings [V, H], position_embeddings [P, H], token_type_embeddings [T, H],
    embeddings_norm/{scale, bias} [H],
    layers/{query,key,value,attention_out}/{kernel [L, H, H], bias [L, H]},
    layers/attention_norm/{scale, bias} [L, H], layers/intermediate/{kernel [L, H, I], bias [L, I]},
    layers/output/{kernel [L, I, H], bias [L, H]}, layers/output_norm/{scale, bias} [L, H].
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.errors import ConfigError

# float32 means float32 (see jaxserve.executor.models.decoder): the golden cosine needs it on GPU/TPU.
_PRECISION = jax.lax.Precision.HIGHEST


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "max_position_embeddings", "type_vocab_size"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"BertConfig.{f} must be > 0, got {getattr(self, f)}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                              f"({self.num_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, cfg: dict) -> "BertConfig":
        if cfg.get("model_type") != "bert":
            raise ConfigError(f"expected an HF BERT config.json, got model_type "
                              f"{cfg.get('model_type')!r}")
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ConfigError(f"unsupported BERT hidden_act {cfg['hidden_act']!r} (gelu only)")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError("only absolute position embeddings are supported")
        return cls(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                   intermediate_size=cfg["intermediate_size"],
                   num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                   max_position_embeddings=cfg.get("max_position_embeddings", 512),
                   type_vocab_size=cfg.get("type_vocab_size", 2),
                   layer_norm_eps=cfg.get("layer_norm_eps", 1e-12))


class EncoderLayer(nn.Module):
    """Post-norm BERT block: self-attention, add & norm, GELU MLP, add & norm."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, key_bias: jax.Array) -> jax.Array:
        c = self.config
        dense = lambda n, name: nn.Dense(n, precision=_PRECISION, name=name)  # noqa: E731
        b, t, _ = x.shape
        heads = lambda y: y.reshape(b, t, c.num_heads, c.head_dim)  # noqa: E731
        q = heads(dense(c.hidden_size, "query")(x))
        k = heads(dense(c.hidden_size, "key")(x))
        v = heads(dense(c.hidden_size, "value")(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=_PRECISION) / c.head_dim ** 0.5
        probs = jax.nn.softmax(scores + key_bias[:, None, None, :], axis=-1)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=_PRECISION).reshape(b, t, -1)
        norm = lambda name: nn.LayerNorm(epsilon=c.layer_norm_eps, name=name)  # noqa: E731
        x = norm("attention_norm")(x + dense(c.hidden_size, "attention_out")(ctx))
        # BERT's "gelu" is the exact erf form, not the tanh approximation.
        h = jax.nn.gelu(dense(c.intermediate_size, "intermediate")(x), approximate=False)
        return norm("output_norm")(x + dense(c.hidden_size, "output")(h))


def _embed_tokens(params: dict, config: BertConfig, input_ids: jax.Array) -> jax.Array:
    t = input_ids.shape[1]
    x = (params["word_embeddings"][input_ids] + params["position_embeddings"][:t][None]
         + params["token_type_embeddings"][0])  # single-segment input: token type 0 everywhere
    norm = params["embeddings_norm"]
    return nn.LayerNorm(epsilon=config.layer_norm_eps).apply({"params": norm}, x)


def encode(params: dict, config: BertConfig, input_ids: jax.Array,
           attention_mask: jax.Array) -> jax.Array:
    """Last hidden states [B, L, H]; padded keys are masked out of attention."""
    x = _embed_tokens(params, config, input_ids)
    # A large finite negative rather than -inf: an all-padding row (batch padding) stays finite.
    key_bias = jnp.where(attention_mask > 0, 0.0, jnp.finfo(x.dtype).min / 2).astype(x.dtype)
    layer = EncoderLayer(config)

    def body(h, layer_params):
        return layer.apply({"params": layer_params}, h, key_bias), None

    x, _ = jax.lax.scan(body, x, params["layers"])
    return x


def embed(params: dict, config: BertConfig, input_ids: jax.Array,
          attention_mask: jax.Array) -> jax.Array:
    """Sentence embeddings [B, H]: mean over unmasked tokens, then L2 normalisation."""
    hidden = encode(params, config, input_ids, attention_mask)
    mask = attention_mask.astype(hidden.dtype)[..., None]
    pooled = (hidden * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1e-9)
    norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
    return pooled / jnp.maximum(norm, 1e-12)  # as torch.nn.functional.normalize


def token_vectors(params: dict, config: BertConfig, input_ids: jax.Array,
                  attention_mask: jax.Array) -> jax.Array:
    """L2-normalised last hidden states [B, L, H] (padding rows included: mask them after), the
    per-token vectors a late-interaction scorer compares."""
    hidden = encode(params, config, input_ids, attention_mask)
    norm = jnp.linalg.norm(hidden, axis=-1, keepdims=True)
    return hidden / jnp.maximum(norm, 1e-12)


def init_params(config: BertConfig, rng: jax.Array) -> dict:
    """Random parameters in the loader's tree (for tests of tiny models)."""
    k_emb, k_layers = jax.random.split(rng)
    k_word, k_pos, k_type = jax.random.split(k_emb, 3)
    h = config.hidden_size
    # BERT's initializer: normal with stddev 0.02.
    normal = lambda k, shape: 0.02 * jax.random.normal(k, shape, jnp.float32)  # noqa: E731
    x = jnp.zeros((1, 1, h), jnp.float32)
    bias = jnp.zeros((1, 1), jnp.float32)
    layer = EncoderLayer(config)
    layers = jax.vmap(lambda k: layer.init(k, x, bias)["params"])(
        jax.random.split(k_layers, config.num_layers))
    return {
        "word_embeddings": normal(k_word, (config.vocab_size, h)),
        "position_embeddings": normal(k_pos, (config.max_position_embeddings, h)),
        "token_type_embeddings": normal(k_type, (config.type_vocab_size, h)),
        "embeddings_norm": {"scale": jnp.ones((h,)), "bias": jnp.zeros((h,))},
        "layers": layers,
    }
