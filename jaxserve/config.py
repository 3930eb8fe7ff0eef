"""Frozen configuration dataclasses, validated once where they are built.

Everything that shapes compiled programs (model dimensions, page size, bucket limits) lives here so
that no dict of options travels deep into the code.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from jaxserve.errors import ConfigError

_DTYPES = ("float32", "bfloat16", "float16")
# Top logprobs per token: the sampler's compiled width (a static shape), so a request limit can
# lower it but never raise it.
MAX_LOGPROBS = 20


ROPE_TYPES = ("linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """How rope frequencies are stretched past the pretraining context, as HF names the types:
    "linear" (all frequencies / factor), "llama3" (Llama 3.1+: long wavelengths / factor, short
    ones kept, the band between blended) or "longrope" (Phi-3: each frequency / its own factor,
    `short_factor` for positions < original_max_position_embeddings, `long_factor` past them, and
    cos / sin scaled by `attention_factor`) or "yarn" (YaRN: frequencies / factor below the
    band that rotates between beta_slow and beta_fast times over the original context, kept
    above it, blended linearly within; cos / sin scaled by `attention_factor`)."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: the band's bounds rounded out to whole dims

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"unsupported rope scaling type {self.rope_type!r} (supported: "
                              f"{', '.join(ROPE_TYPES)})")
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.rope_type == "longrope" and (not self.short_factor
                                             or len(self.short_factor) != len(self.long_factor)):
            raise ConfigError("longrope scaling needs short_factor and long_factor of equal length")


# What ModelConfig.layer_types may say of a layer, in HF's words.
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; jaxserve.executor.models.mla), in
    HF's names. Queries come through a rank-q_lora_rank bottleneck (None: one projection); keys
    and values of all heads from one latent of kv_lora_rank per token, which the KV cache stores
    (normed) with the token's one rope key of qk_rope_head_dim shared by every head. Each head's
    key is qk_nope_head_dim from the latent plus the rope key; its value v_head_dim from the
    latent. `softmax_scale` multiplies the scores (qk head dim ** -0.5, times YaRN's mscale²)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    # The checkpoint's rope dims are interleaved pairs (HF's rope_interleave): the loader
    # de-interleaves the q / kv projections' rope columns, so the model rotates halves as usual.
    rope_interleave: bool = False

    def __post_init__(self):
        for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"MlaConfig.{f} must be > 0, got {getattr(self, f)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"q_lora_rank must be > 0 or None, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2 or not self.softmax_scale > 0:
            raise ConfigError(f"MLA needs an even qk_rope_head_dim and softmax_scale > 0, got "
                              f"{self.qk_rope_head_dim}, {self.softmax_scale}")

    @property
    def latent_dim(self) -> int:
        """What the cache stores per token and layer: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


MOE_SCORINGS = ("softmax", "sigmoid")
QUANTIZATIONS = (None, "int8", "gguf")
INT8_GROUP = 32  # contraction rows per int8 scale: a Q4_1 / Q4_0 block, so those load exactly
# GGUF block formats kept as they are (quantization "gguf"; jaxserve.kernels.matmul.FORMATS).
GGUF_FORMATS = ("q4_0", "q4_1", "q8_0")
# How the CPU kernel multiplies GGUF blocks at decode rows (ModelConfig.gguf_dot).
GGUF_DOTS = ("f32", "int8")
# What quantization "gguf" may keep as blocks: the layers' seven projections (all of them or none)
# and the embedding / LM head.
GGUF_TENSORS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "embed_tokens", "lm_head")
# The matmul weights the CPU kernels read in place (jaxserve.kernels.matmul's stacked matmul,
# jaxserve.kernels.grouped_matmul), per parameter group: what ModelConfig.weight_dtype stores.
KERNEL_WEIGHTS = {"layers": GGUF_TENSORS[:7], "moe": ("gate_proj", "up_proj", "down_proj")}
WEIGHT_DTYPES = (None, "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a dense decoder (jaxserve.executor.models.decoder). The defaults are the
    Llama shape; each family's differences are fields set by its entry in
    jaxserve.weights.architectures."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Rope on the first rotary_dim dims of each head only (Phi-4-mini); None: all of head_dim.
    rotary_dim: int | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    sliding_window: int | None = None  # Mistral; the window of the "sliding_attention" layers
    # Per layer, "full_attention" or "sliding_attention" (Gemma's alternation); () is every layer
    # sliding when sliding_window is set, else full.
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' rope base, unscaled
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm of each head's q and k before rope
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (norm_offset + weight)
    sandwich_norms: bool = False  # Gemma 2/3: attention and MLP outputs normed before the residual
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden_size)
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by this ** -0.5 (else D)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the LM head's logits
    dtype: str = "float32"  # activations and weights
    # Weight storage of the decoder layers' projections: None stores them in `dtype`; "int8"
    # stores uint8 codes with an f32 scale and minimum per INT8_GROUP contraction rows, in the
    # GGUF blocks' layout (see jaxserve.weights.quantize), read in place by the CPU kernel or
    # dequantized to `dtype` inside the step; "gguf" keeps the GGUF
    # file's blocks of the tensors in `gguf_formats` as they are (jaxserve.weights.gguf), read in
    # place by the CPU kernel or dequantized inside the step.
    quantization: str | None = None
    # quantization "gguf": (tensor, block format) for each tensor kept as blocks (GGUF_TENSORS,
    # GGUF_FORMATS), in GGUF_TENSORS' order.
    gguf_formats: tuple[tuple[str, str], ...] = ()
    # quantization "gguf", steps of up to jaxserve.kernels.matmul.INT8_DOT_MAX_ROWS rows through
    # the CPU kernel: "f32" multiplies x as it is; "int8" rounds x to int8 per block of 32 first
    # (llama.cpp's integer dot products: faster, moves the logits; docs/engine.md).
    gguf_dot: str = "f32"
    # The storage of KERNEL_WEIGHTS where it differs from `dtype` (see `param_dtype`): "bfloat16"
    # keeps a bf16 checkpoint's matmul weights as stored while the model computes in float32:
    # the CPU kernels widen them in registers, every other path where it uses them; widening is
    # exact, so the floats are a float32 load's, with half the bytes (jaxserve.weights.load_model
    # sets it).
    weight_dtype: str | None = None
    # Expert parallelism (--enable-expert-parallel): a mixture's experts sharded over the mesh's
    # model axis, tokens dispatched to their devices (jaxserve.executor.models.moe). A placement,
    # like dtype: set by the engine factory, never read from a checkpoint.
    expert_parallel: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    # Mixture of experts (Mixtral, Qwen3-MoE; jaxserve.executor.models.moe): num_experts > 0
    # replaces the MLP of every layer not in dense_layers by experts_per_token of num_experts
    # gated MLPs of moe_intermediate_size (the dense layers keep intermediate_size), weighted by
    # the router's softmax over the chosen experts, renormalized to sum 1 if norm_topk_prob.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    # DeepSeek-V3's router: "sigmoid" scores, experts chosen by score + a learnt correction bias
    # among the moe_topk_groups best of moe_num_groups groups (a group's score: its best two),
    # weighted by their scores (renormalized if norm_topk_prob) times routed_scaling_factor;
    # num_shared_experts gated MLPs of moe_intermediate_size each, run on every token.
    moe_scoring: str = "softmax"
    moe_num_groups: int = 1
    moe_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    mla: MlaConfig | None = None  # multi-head latent attention instead of q/k/v heads
    # gpt-oss: biases on the router's logits and on every expert projection, and the experts'
    # clamped SwiGLU, (clip(up, +-limit) + 1) * g * sigmoid(swiglu_alpha * g) with g = min(gate,
    # limit) (swiglu_limit None: hidden_act's gated MLP); o_proj's bias; a learned sink logit per
    # query head in the attention's softmax (jaxserve.kernels.attention).
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    o_proj_bias: bool = False
    attention_sinks: bool = False

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"ModelConfig.{f} must be > 0, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be > 0 or None, got {self.sliding_window}")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise ConfigError(f"layer_types must name one of {LAYER_TYPES} per layer "
                              f"({self.num_layers}), got {self.layer_types}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ConfigError("sliding_attention layers need a sliding_window")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.rotary_dim is not None and not 0 < self.rotary_dim <= self.head_dim \
                or (self.rotary_dim or 2) % 2:
            raise ConfigError(f"rotary_dim must be even and in (0, head_dim], got "
                              f"{self.rotary_dim}")
        rs = self.rope_scaling
        if rs is not None and rs.rope_type == "longrope" and \
                len(rs.short_factor) != (self.rotary_dim or self.head_dim) // 2:
            raise ConfigError(f"longrope factors must number rotary_dim / 2, got "
                              f"{len(rs.short_factor)}")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar",
                     "local_rope_theta"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 or None, got {getattr(self, name)}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got "
                              f"{self.quantization!r}")
        if self.gguf_dot not in GGUF_DOTS or self.gguf_dot != "f32" and not self.gguf_formats:
            raise ConfigError(f"gguf_dot must be one of {GGUF_DOTS} (int8 with quantization "
                              f"'gguf' only), got {self.gguf_dot!r}")
        formats = dict(self.gguf_formats)
        if ((self.quantization == "gguf") != bool(formats) or not set(formats) <= set(GGUF_TENSORS)
                or 0 < len(set(formats) & set(GGUF_TENSORS[:7])) < 7
                or not set(formats.values()) <= set(GGUF_FORMATS)):
            raise ConfigError(f"quantization 'gguf' needs gguf_formats: block formats "
                              f"({', '.join(GGUF_FORMATS)}) of the seven projections (all or "
                              f"none), embed_tokens, lm_head; got {self.gguf_formats}")
        if formats and self.dtype != "float32":
            raise ConfigError(f"GGUF blocks are read into float32, not {self.dtype}")
        if self.weight_dtype not in WEIGHT_DTYPES or self.weight_dtype is not None and (
                self.dtype != "float32" or self.quantization is not None):
            raise ConfigError(f"weight_dtype must be one of {WEIGHT_DTYPES} (bfloat16 with "
                              f"float32 and no quantization), got {self.weight_dtype!r}")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise ConfigError(f"a mixture of experts needs 0 < experts_per_token <= num_experts "
                              f"and moe_intermediate_size > 0, got {self.experts_per_token} of "
                              f"{self.num_experts}, {self.moe_intermediate_size}")
        if not set(self.dense_layers) <= set(range(self.num_layers if self.num_experts else 0)):
            raise ConfigError(f"dense_layers must be layers of a mixture of experts, got "
                              f"{self.dense_layers}")
        if self.moe_scoring not in MOE_SCORINGS:
            raise ConfigError(f"moe_scoring must be one of {MOE_SCORINGS}, got "
                              f"{self.moe_scoring!r}")
        if self.num_experts and not (
                self.num_experts % self.moe_num_groups == 0
                and 0 < self.moe_topk_groups <= self.moe_num_groups
                and self.experts_per_token <= self.moe_topk_groups * (self.num_experts
                                                                      // self.moe_num_groups)):
            raise ConfigError(f"expert groups must divide the {self.num_experts} experts and "
                              f"their top {self.moe_topk_groups} of {self.moe_num_groups} hold "
                              f"the {self.experts_per_token} chosen")
        if self.mla is not None and (self.quantization is not None
                                     or self.num_kv_heads != self.num_heads
                                     or self.head_dim != self.mla.qk_rope_head_dim):
            raise ConfigError("latent attention needs num_kv_heads == num_heads, head_dim == "
                              "qk_rope_head_dim (the rotated part) and no quantization")
        if self.mla is not None and not self.num_experts:
            raise ConfigError("latent attention is served with DeepSeek-V3's mixture of experts "
                              "only (a model whose every layer is dense is not)")
        if self.quantization is not None and self.num_experts:
            raise ConfigError(f"quantization {self.quantization!r} of a mixture of experts is "
                              f"not supported")
        contractions = (self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim)
        if self.quantization == "int8" and any(k % INT8_GROUP for k in contractions):
            raise ConfigError(f"int8 quantization needs hidden_size, intermediate_size and "
                              f"num_heads * head_dim divisible by {INT8_GROUP}, got "
                              f"{contractions}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def param_dtype(self, group: str, name: str) -> str:
        """The dtype parameter `name` of `group` ("layers", "moe", ...) is stored in:
        weight_dtype for KERNEL_WEIGHTS (not latent attention's own projections), else dtype."""
        kernel = KERNEL_WEIGHTS.get(group, ()) if group != "layers" or self.mla is None else ()
        return self.weight_dtype if self.weight_dtype and name in kernel else self.dtype

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts."""
        if not self.num_experts:
            return ()
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        types = self.layer_types or (("sliding_attention" if self.sliding_window else
                                      "full_attention"),) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in types)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: page size and how many pages the pool holds."""

    page_size: int = 16
    # Explicit pool size, the null page included; else from kv_cache_memory_fraction.
    num_pages: int | None = None
    kv_cache_memory_fraction: float = 0.5  # of the memory left after weights load
    enable_prefix_caching: bool = True
    dtype: str | None = None  # None: the model's dtype
    # GiB of host memory for the prefix cache's second tier (evicted pages copied there and
    # back on a hit: jaxserve.core.kv_offload); 0: off. Per engine replica.
    kv_offloading_size: float = 0.0
    # The optional third tier: pages the host tier overwrites go to files in this directory
    # (0700, emptied at start: jaxserve.core.kv_disk), at most kv_offloading_disk_size GiB.
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.kv_offloading_disk_size < float("inf"):
            raise ConfigError(f"kv_offloading_disk_size must be a number of GiB >= 0, got "
                              f"{self.kv_offloading_disk_size}")
        if bool(self.kv_offloading_disk_path) != bool(self.kv_offloading_disk_size):
            raise ConfigError("kv_offloading_disk_path and kv_offloading_disk_size go together "
                              "(the disk tier's directory and its size)")
        if self.kv_offloading_disk_size and not self.kv_offloading_size:
            raise ConfigError("kv_offloading_disk_size needs kv_offloading_size (the disk tier "
                              "holds the pages the host tier evicts)")
        if not 0.0 <= self.kv_offloading_size < float("inf"):
            raise ConfigError(f"kv_offloading_size must be a number of GiB >= 0, got "
                              f"{self.kv_offloading_size}")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ConfigError("kv_offloading_size needs the prefix cache (it holds the pages "
                              "the prefix cache evicts)")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(f"num_pages must be >= 2, got {self.num_pages}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ConfigError(f"cache dtype must be one of {_DTYPES}, got {self.dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step's ragged batch."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # The smallest token bucket (a power of two): a step of n tokens runs the forward over the
    # smallest power of two >= max(n, this). 1 suits a CPU, where a 1-row decode costs about half
    # a 16-row one; on an accelerator, whose small steps cost the same whatever their rows, 16
    # saves the extra programs' compile time.
    min_token_bucket: int = 1
    # Batch-invariant numerics (--deterministic): one token bucket, so every step has the shape
    # of a full one, and prefill chunks cut at fixed offsets of each prompt, so what a request
    # computes does not depend on what else runs (docs/engine.md, "Deterministic mode").
    deterministic: bool = False
    # Launch step N+1 before reading step N's tokens (they reach N+1's forward on the device),
    # so scheduling and output processing overlap the device's work (vLLM's --async-scheduling;
    # LLMEngine.step says which steps overlap).
    async_scheduling: bool = True

    def __post_init__(self):
        for f in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"SchedulerConfig.{f} must be > 0, got {getattr(self, f)}")
        if self.min_token_bucket <= 0 or self.min_token_bucket & (self.min_token_bucket - 1):
            raise ConfigError(
                f"min_token_bucket must be a power of two, got {self.min_token_bucket}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step")


@dataclass(frozen=True)
class RequestLimits:
    """What one API request may ask for. Every limit is a 400 naming the field when exceeded, and
    shows in GET /openapi.json (the request models are built from these values)."""

    max_n: int = 128  # choices per prompt (`n`, and `best_of`): OpenAI's own limit
    max_prompts: int = 128  # prompts in one completions request
    max_stop: int = 16  # stop strings per request
    max_stop_length: int = 256  # characters per stop string
    max_logprobs: int = MAX_LOGPROBS  # `top_logprobs` (chat), `logprobs` (completions)
    max_messages: int = 1024  # messages in one chat
    max_body_bytes: int = 16 * 1024 * 1024
    max_json_depth: int = 64  # nesting of arrays and objects in a body

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < (0 if f.name == "max_logprobs" else 1):
                raise ConfigError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")
        if self.max_logprobs > MAX_LOGPROBS:
            raise ConfigError(f"max_logprobs must be <= {MAX_LOGPROBS} (the sampler's compiled "
                              f"width), got {self.max_logprobs}")


METRICS_TENANT_LABELS = ("names", "hashed")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = None
    served_model_name: str | None = None
    keepalive_seconds: float = 5.0
    # A stream whose client stops reading is ended (request aborted, pages freed) once one
    # write has waited this long for the client; its snapshots are not queued meanwhile.
    stream_write_timeout_s: float = 30.0
    log_prompts: bool = False
    max_queued_requests: int | None = None  # None: no limit
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Not ready (/ready 503, gRPC NOT_SERVING) once no engine step has completed this long while
    # work is pending; the stall is logged with the engine thread's stack.
    engine_stall_timeout: float = 60.0
    # SIGTERM: in-flight requests get this long to finish, then are aborted.
    shutdown_timeout: float = 20.0
    # How chat output is read for tool calls (jaxserve.tool_calling.parsers) and for reasoning
    # (jaxserve.reasoning.parsers; or "none"); "auto": from each model's chat template.
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    tenants_file: str | None = None  # --tenants: None serves one open tenant, `default`
    idempotency_ttl_s: float = 24 * 3600.0  # how long an Idempotency-Key's response is kept
    # The response cache (gateway/response_cache.py): at most this many answers (0: no cache),
    # of at most response_cache_bytes in all, each kept response_cache_ttl_s.
    response_cache_size: int = 0
    response_cache_bytes: int = 64 << 20
    response_cache_ttl_s: float = 300.0
    # --data-dir: stored responses live here (responses.sqlite3); None: the default data dir.
    data_dir: str | None = None
    response_ttl_s: float = 7 * 24 * 3600.0  # --response-ttl: how long a stored response lives
    code_interpreter: bool = False  # --code-interpreter: run model-written code (a sandbox)
    # --mcp-allowed-hosts: the hosts (HOST or HOST:PORT) of remote MCP servers a request's `mcp`
    # tool may name; empty: the tool is not offered (agents/mcp_tools.py).
    mcp_allowed_hosts: tuple[str, ...] = ()
    policy_file: str | None = None  # --policy: content policy packs (TOML)
    audit_log_dir: str | None = None  # --audit-log: hash-chained JSONL, one record per request
    audit_key_file: str | None = None  # --audit-key-file: HMAC-keyed chain
    audit_max_bytes: int | None = None  # --audit-max-bytes: refuse calls past it (None: no cap)
    audit_min_free_bytes: int | None = None  # --audit-min-free-bytes (None: the log's default)
    # Failed authentications per client and minute before its calls are refused (429) unchecked.
    auth_failures_per_minute: int = 20
    # An open server (no tenants) answers only these Host names besides loopback names and IP
    # literals, and only browser Origins among them (DNS rebinding, CSRF); "*": any.
    allowed_hosts: tuple[str, ...] = ()
    # /metrics needs `Authorization: Bearer <this>` (--metrics-token-file); None: open, except
    # on a server with tenants, where it answers loopback clients only.
    metrics_token: str | None = field(default=None, repr=False)
    # The `tenant` label of /metrics: "names", or "hashed" (stable pseudonyms, t-<12 hex>).
    metrics_tenant_labels: str = "names"
    # --otlp-traces-endpoint: OTLP/HTTP URL spans are exported to; None: no tracing at all.
    otlp_traces_endpoint: str | None = None
    # --capacity-rates: `jaxserve capacity measure`'s file; with it /metrics has the capacity
    # model's jaxserve:desired_replicas (telemetry/capacity.py) at --capacity-headroom / -zones.
    capacity_rates_file: str | None = None
    capacity_headroom: float = 0.2
    capacity_zones: int = 1

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65536), got {self.port}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ConfigError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        for name in ("engine_stall_timeout", "shutdown_timeout", "idempotency_ttl_s",
                     "stream_write_timeout_s", "response_ttl_s", "response_cache_ttl_s",
                     "response_cache_bytes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.response_cache_size < 0:
            raise ConfigError(f"response_cache_size must be >= 0, got "
                              f"{self.response_cache_size}")
        if self.metrics_token is not None and not self.metrics_token:
            raise ConfigError("the metrics token is empty")
        if self.metrics_tenant_labels not in METRICS_TENANT_LABELS:
            raise ConfigError(f"metrics_tenant_labels must be one of {METRICS_TENANT_LABELS}, "
                              f"got {self.metrics_tenant_labels!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """Device mesh: data x model (tensor parallel)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # A mixture of experts' experts sharded over each replica's tensor_parallel_size devices
    # (expert parallelism) instead of each expert's MLP split across them.
    enable_expert_parallel: bool = False

    def __post_init__(self):
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ConfigError("parallel sizes must be >= 1")


@dataclass(frozen=True)
class DistributedConfig:
    """jax.distributed settings of a multi-host group. A field left None is auto-detected by JAX
    (TPU pod slices, SLURM, Open MPI, ...)."""

    coordinator_address: str | None = None  # HOST:PORT of process 0
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self):
        if self.coordinator_address is not None:
            host, _, port = self.coordinator_address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"coordinator address must be HOST:PORT, got "
                                  f"{self.coordinator_address!r}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ConfigError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and not (
                0 <= self.process_id < (self.num_processes or self.process_id + 1)):
            raise ConfigError(f"process_id must be in [0, num_processes), got {self.process_id}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `speculative_config` fields. Only n-gram (prompt lookup)
    drafting: up to `num_speculative_tokens` tokens copied from after the most recent earlier
    occurrence of the sequence's last n tokens, prompt_lookup_max >= n >= prompt_lookup_min.
    As in vLLM, one of the two lookup bounds given alone sets both."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    # (max, min) when neither is given. A match of 1-2 tokens is often chance: with min 3 the
    # grounded batch-1 workload gets 70-74% of its drafts accepted instead of 38-49%, at the same
    # or better speed (benchmarks/RESULTS.md, "Speculative decoding").
    DEFAULT_PROMPT_LOOKUP = (4, 3)
    MAX_SPECULATIVE_TOKENS = 15  # a batch-1 verify row still fits the smallest token bucket

    def __post_init__(self):
        if self.method != "ngram":
            raise ConfigError(f"speculative method must be 'ngram', got {self.method!r}")
        for f in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"speculative {f} must be an integer >= 1, got {v!r}")
        if self.num_speculative_tokens > self.MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be <= {self.MAX_SPECULATIVE_TOKENS}, "
                              f"got {self.num_speculative_tokens}")
        hi, lo = self.prompt_lookup_max, self.prompt_lookup_min
        if hi is None and lo is None:
            hi, lo = self.DEFAULT_PROMPT_LOOKUP
        object.__setattr__(self, "prompt_lookup_max", hi if hi is not None else lo)
        object.__setattr__(self, "prompt_lookup_min", lo if lo is not None else hi)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str") -> "SpeculativeConfig":
        """From vLLM's `speculative_config`: a dict of these fields or its JSON text."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be an object, got "
                              f"{type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        if set(value) - known:
            raise ConfigError(f"speculative_config: unknown fields {sorted(set(value) - known)} "
                              f"(known: {sorted(known)})")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None

    def __post_init__(self):
        if self.scheduler.deterministic and self.speculative is not None:
            raise ConfigError("deterministic mode and speculative decoding cannot be combined: "
                              "how many drafts a step verifies depends on what else runs in it")
        if self.scheduler.deterministic and self.cache.enable_prefix_caching:
            raise ConfigError("deterministic mode computes every prompt whole: turn prefix "
                              "caching off (its default in deterministic mode)")
