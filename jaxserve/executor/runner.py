"""ModelRunner: the paged KV cache on the device, the jitted step, its buckets and warmup.

One step is two compiled programs: the model forward over the plan's flat tokens, returning the
donated KV cache and the logits of the rows that sample (the LM head runs on `logits_indices`
only), then the sampler on those rows. They are compiled separately because their variants are
independent: the forward varies with the token bucket, the sampler with the row count, the
penalty-history width (0 unless a row uses penalties) and the top-logprobs width (0 or 20), so
two small tables replace one product of both. Steps with a structured-output row run a third,
small program between them (per row count): the token bitmask applied to the logits; other steps
never run it.

Prompt logprobs (a request's `prompt_logprobs`, completions' `echo` with `logprobs`): the forward
also returns the final hidden state of every flat token, which stays on the device; only a step
holding a prompt chunk to score runs a fourth program on it (`score`, one per token bucket,
compiled at warmup): the LM head over the step's rows, in chunks of SCORE_CHUNK_ROWS, with the
log-softmax on the device; back to the host come only, per row, the logprob of the token given
(the next prompt token), its rank and the top MAX_LOGPROBS. Steps that score nothing never run
it, and the forward's own LM head stays on `logits_indices`.

`forward` and `sample` are separate calls: the forward is only enqueued (JAX dispatches
asynchronously), so what the host does before `sample` (the sampler metadata, the grammar
bitmasks of constrained rows) overlaps the device's work.

Every program is compiled ahead of time at warmup into a table keyed by its shapes. Serving only
looks programs up, so a shape that was not warmed cannot compile silently: with `strict` it raises
`CompileDuringServing`; otherwise it is compiled, logged and counted (`num_serving_compiles`).

Tensor parallel (a mesh): every program is jitted with explicit in/out shardings. Params and the
KV cache keep their sharding (jaxserve.executor.sharding) in and out, the cache is donated, and
plans, sampler inputs and logits are replicated, so a step moves no weights and never gathers the
cache. The shapes every program is compiled for come from `StepShapes`, which the scheduler pads to.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.executor import sampler, standby
from jaxserve.executor.batch_plan import BatchPlan, StepShapes, pages_for
from jaxserve.executor.expert_load import ExpertLoad
from jaxserve.executor.kv_offload import HostKVPool, num_host_slots
from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.errors import ConfigError
from jaxserve.executor.models import decoder
from jaxserve.kernels import paths

log = logging.getLogger(__name__)


class CompileDuringServing(RuntimeError):
    """A step needed a program that warmup did not compile."""


class StepOutput(NamedTuple):
    """Host arrays, one row per scheduled sequence of the plan (padding rows included)."""

    token_ids: np.ndarray  # i32[S]
    logprobs: np.ndarray  # f32[S]: of the sampled token
    top_token_ids: np.ndarray  # i32[S, K], K = 0 or MAX_LOGPROBS
    top_logprobs: np.ndarray  # f32[S, K]


class ScoreOutput(NamedTuple):
    """Host arrays, one row per flat token of the plan: the log-probability of the target token
    given at that row (the next prompt token) under the logits of that row."""

    logprobs: np.ndarray  # f32[T]
    ranks: np.ndarray  # i32[T]: 1 + the tokens of strictly higher logit
    top_token_ids: np.ndarray  # i32[T, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # f32[T, MAX_LOGPROBS]


class ScoreInputs(NamedTuple):
    """What `score` takes (and a multi-host leader publishes): the target token of each flat
    token row of the last forward's plan (0 where nothing is scored)."""

    target_token_ids: np.ndarray  # i32[T]


# Rows of one LM-head chunk when scoring prompts: bounds the f32 [rows, vocab] logits a score
# program holds at once (256 x 152k x 4 B = 156 MB for the largest vocabularies here).
SCORE_CHUNK_ROWS = 256


def kv_page_bytes(config: ModelConfig, page_size: int, dtype: str) -> int:
    """Bytes of one page across all layers (the pool is allocated in such pages): of the
    standard layout, or of latent attention's (decoder.cache_shape)."""
    page = decoder.cache_shape(config, 1, page_size)
    return math.prod(page) * jnp.dtype(dtype).itemsize


def _host_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ConfigError("cannot read the available memory; set CacheConfig.num_pages")


def free_memory_bytes(device: jax.Device) -> int:
    """What the device can still allocate (a CPU's is the host's available memory)."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return _host_available_bytes()


def num_pages_for(config: ModelConfig, cache: CacheConfig, scheduler: SchedulerConfig,
                  mesh: jax.sharding.Mesh | None = None, memory_bytes: int | None = None) -> int:
    """KV pool size (null page included), the same on every device: the explicit `num_pages`, or
    `kv_cache_memory_fraction` of `memory_bytes` over what a page takes on one device (its share
    of the KV heads). `memory_bytes` defaults to what the fullest of this process's devices has
    left after the weights loaded; a fleet passes the budget its versions split.

    On a CPU the "device memory" is the host's, shared with everything else in the process (every
    local device's share of a page included), so the pool is capped at what max_num_seqs sequences
    of max_model_len tokens can use at once."""
    from jaxserve.executor import sharding

    if cache.num_pages is not None:
        return cache.num_pages
    page_bytes = kv_page_bytes(config, cache.page_size, cache.dtype or config.dtype)
    if mesh is None:
        devices, device_page_bytes = [jax.devices()[0]], page_bytes
    else:
        devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        device_page_bytes = page_bytes // sharding.kv_head_shards(config, mesh)
    if memory_bytes is None:
        memory_bytes = min(free_memory_bytes(d) for d in devices)
    on_host = "bytes_limit" not in (devices[0].memory_stats() or {})
    per_page = device_page_bytes * (len(devices) if on_host else 1)
    num_pages = int(memory_bytes * cache.kv_cache_memory_fraction) // per_page
    if on_host:
        num_pages = min(num_pages, scheduler.max_num_seqs
                        * pages_for(scheduler.max_model_len, cache.page_size) + 1)
    if num_pages < 2:
        raise ConfigError(
            f"no room for the KV cache: a page needs {device_page_bytes} bytes per device; lower "
            f"max_model_len, use a smaller dtype, more tensor parallelism or raise "
            f"kv_cache_memory_fraction")
    return num_pages


class SampleInputs(NamedTuple):
    """The sampler's inputs for one step as host arrays: with the plan (the forward's input),
    what a multi-host leader sends the other processes."""

    metadata: sampler.SamplingMetadata
    top_width: int  # 0 or sampler.MAX_LOGPROBS
    token_bitmask: np.ndarray | None  # i32[S, bitmask_width] when a row is constrained


def _forward(params: dict, kv_cache: jax.Array, plan: BatchPlan, last_tokens: jax.Array, *,
             config: ModelConfig, mesh: jax.sharding.Mesh | None) -> tuple[jax.Array, ...]:
    """(kv_cache, logits of the sampling rows, hidden, a mixture's expert counts i32 [E] or
    [0]: jaxserve.executor.expert_load). A token id -(r + 1) in the plan is a placeholder for
    the token the last sampler drew on its row r (`last_tokens`, still on the device): what
    lets the host launch a step before it has read the previous one's tokens."""
    placeholder = plan.token_ids < 0
    plan = plan._replace(token_ids=jnp.where(
        placeholder, last_tokens[jnp.where(placeholder, -plan.token_ids - 1, 0)], plan.token_ids))
    expert_tokens = jnp.zeros((0,), jnp.int32)
    if config.num_experts:
        hidden, kv_cache, expert_tokens = decoder.forward_with_expert_tokens(
            params, config, kv_cache, plan, mesh)
    else:
        hidden, kv_cache = decoder.forward(params, config, kv_cache, plan, mesh)
    logits = decoder.compute_logits(params, config, hidden[plan.logits_indices])
    return kv_cache, logits, hidden, expert_tokens


def _score(params: dict, hidden: jax.Array, targets: jax.Array, *,
           config: ModelConfig) -> tuple[jax.Array, ...]:
    """Each row's log-softmax at its target token, that token's rank and the top MAX_LOGPROBS,
    the LM head run SCORE_CHUNK_ROWS rows at a time (the log-softmax never leaves the device)."""
    num_rows = hidden.shape[0]
    chunk = min(num_rows, SCORE_CHUNK_ROWS)

    def one(args):
        h, t = args
        logits = decoder.compute_logits(params, config, h)
        lse = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        rank = 1 + jnp.sum(logits > target[:, None], axis=-1, dtype=jnp.int32)
        top, top_ids = jax.lax.top_k(logits, sampler.MAX_LOGPROBS)
        return target - lse, rank, top_ids.astype(jnp.int32), top - lse[:, None]

    out = jax.lax.map(one, (hidden.reshape(num_rows // chunk, chunk, -1),
                            targets.reshape(num_rows // chunk, chunk)))
    return tuple(x.reshape(num_rows, *x.shape[2:]) for x in out)


def _sample_and_keep(logits: jax.Array, md: sampler.SamplingMetadata, *, num_top_logprobs: int,
                     all_greedy: bool, keep_rows: int) -> tuple:
    """The sampler's outputs, and its token ids padded to keep_rows (the most logits rows of any
    step): the next forward's `last_tokens`, one shape whatever this step's rows."""
    out = sampler.sample(logits, md, num_top_logprobs=num_top_logprobs, all_greedy=all_greedy)
    return out, jnp.zeros((keep_rows,), jnp.int32).at[:out.token_ids.shape[0]].set(out.token_ids)


class PendingStep:
    """A launched step's sampled tokens, on the device until `result()` waits for them and brings
    them to the host (once). The host side holds this between launching a step and processing
    its tokens without touching JAX."""

    def __init__(self, arrays: tuple[jax.Array, ...]):
        self._arrays: tuple[jax.Array, ...] | None = arrays
        self._host: StepOutput | None = None

    def done(self) -> bool:
        """Whether the device has finished it (never waits)."""
        return self._host is not None or all(a.is_ready() for a in self._arrays)

    def result(self) -> StepOutput:
        if self._host is None:
            # np.asarray per array: a few times cheaper than jax.device_get's batched path for
            # these few small arrays (RESULTS.md, "Host gap between steps").
            self._host = StepOutput(*(np.asarray(a) for a in self._arrays))
            self._arrays = None
        return self._host


class ModelRunner:
    """Owns the params, the KV cache and the compiled programs of one model replica."""

    def __init__(self, config: ModelConfig, params: dict, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, *, eos_token_ids: Sequence[int],
                 mesh: jax.sharding.Mesh | None = None, strict: bool = False,
                 publish: Callable[[BatchPlan | SampleInputs], None] | None = None,
                 num_speculative_tokens: int = 0):
        """mesh: the devices of this replica, params already sharded on it (tensor parallel).
        publish: called with the plan before each forward and the SampleInputs before each
        sample (a multi-host leader's followers run the same programs).
        num_speculative_tokens: the drafts one decode may verify (sizes the logits rows)."""
        from jaxserve.executor import sharding

        self.config = config
        self.params = params
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.strict = strict
        self.publish = publish
        self.shapes = StepShapes.of(scheduler_config, cache_config.page_size,
                                    num_pages_for(config, cache_config, scheduler_config, mesh),
                                    num_speculative_tokens)
        cache_dtype = jnp.dtype(cache_config.dtype or config.dtype)
        shape = decoder.cache_shape(config, self.num_pages, self.page_size)
        forward = functools.partial(_forward, config=config, mesh=mesh)
        score = functools.partial(_score, config=config)
        if mesh is None:
            self._replicated = None
            self._new_kv_cache = lambda: jnp.zeros(shape, cache_dtype)
            self._forward_jit = jax.jit(forward, donate_argnums=1)
            self._score_jit = jax.jit(score)
            self._sample_shardings = {}
        else:
            # Plans, sampler inputs and logits are replicated; params and the cache keep their
            # tensor-parallel sharding, in and out, so a step never moves them.
            self._replicated = sharding.replicated(mesh)
            kv_sharding = sharding.kv_cache_sharding(config, mesh, self.num_pages, self.page_size)
            self._new_kv_cache = jax.jit(lambda: jnp.zeros(shape, cache_dtype),
                                         out_shardings=kv_sharding)
            self._forward_jit = jax.jit(
                forward, donate_argnums=1,
                in_shardings=(decoder.param_shardings(config, mesh), kv_sharding,
                              self._replicated, self._replicated),
                out_shardings=(kv_sharding, self._replicated, self._replicated,
                               self._replicated))
            self._score_jit = jax.jit(
                score, in_shardings=(decoder.param_shardings(config, mesh), self._replicated,
                                     self._replicated), out_shardings=self._replicated)
            self._sample_shardings = dict(in_shardings=self._replicated,
                                          out_shardings=self._replicated)
        self.kv_cache = self._new_kv_cache()
        self._param_shardings: list | None = None  # set while the weights sleep in host memory
        self.bitmask_width = sampler.bitmask_width(config.vocab_size)
        # The last sampler's tokens, padded to the most rows: what plan placeholders read.
        self._last_tokens = jax.device_put(np.zeros(self.shapes.row_buckets[-1], np.int32),
                                           self._replicated)
        self._programs: dict[tuple, Callable] = {}
        self.program_compile_seconds: dict[tuple, float] = {}  # per program key, filled by warmup
        self.num_serving_compiles = 0
        self._warm = False
        self._hidden: jax.Array | None = None  # of the last forward: what `score` reads
        self.expert_load = (ExpertLoad(config.num_experts, (
            mesh.shape[sharding.MODEL] if config.expert_parallel and mesh is not None else 1))
            if config.num_experts else None)
        self.host_pool = self._host_pool(mesh) if cache_config.kv_offloading_size else None
        log.info("%s", paths.summary(matmul_off=decoder.why_matmul_off(config, mesh)))

    def _host_pool(self, mesh) -> HostKVPool:
        """The prefix cache's host tier (--kv-offloading-size): its slots and copy programs."""
        if self.publish is not None:
            raise ConfigError("--kv-offloading-size is not supported across hosts")
        page_bytes = kv_page_bytes(self.config, self.page_size, self.kv_cache.dtype)
        slots = num_host_slots(self.cache_config.kv_offloading_size, page_bytes,
                               _host_available_bytes())
        return HostKVPool(slots, self.kv_cache.shape, self.kv_cache.dtype, self.num_pages,
                          self.shapes.pages_per_seq,
                          kv_sharding=self.kv_cache.sharding if mesh is not None else None,
                          replicated=self._replicated)

    @property
    def num_host_pages(self) -> int:
        """Slots of the host tier (0: no host tier)."""
        return 0 if self.host_pool is None else self.host_pool.num_slots

    @property
    def num_pages(self) -> int:
        return self.shapes.num_pages

    @property
    def page_size(self) -> int:
        return self.shapes.page_size

    # ---- programs ----------------------------------------------------------------------------

    def _spec(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)

    def _plan_spec(self, num_tokens: int) -> BatchPlan:
        S = self.shapes.seq_bucket(num_tokens)
        i32 = lambda *shape: self._spec(shape, jnp.int32)  # noqa: E731
        return BatchPlan(token_ids=i32(num_tokens), positions=i32(num_tokens),
                         slot_mapping=i32(num_tokens), cu_q_lens=i32(S + 1), kv_lens=i32(S),
                         page_indices=i32(S, self.shapes.pages_per_seq), num_seqs=i32(1),
                         logits_indices=i32(self.shapes.logits_bucket(num_tokens)))

    def _compile(self, key: tuple) -> Callable:
        if key[0] == "forward":
            lowered = self._forward_jit.lower(self.params, self.kv_cache, self._plan_spec(key[1]),
                                              self._last_tokens)
        elif key[0] == "score":
            # The hidden states as that bucket's forward returns them (shape and dtype).
            hidden = jax.eval_shape(self._forward_jit, self.params, self.kv_cache,
                                    self._plan_spec(key[1]), self._last_tokens)[2]
            lowered = self._score_jit.lower(self.params, self._spec(hidden.shape, hidden.dtype),
                                            self._spec((key[1],), jnp.int32))
        elif key[0] in HostKVPool.PROGRAMS:
            lowered = self.host_pool.lower(key, self.kv_cache)
        elif key[0] == "bitmask":
            lowered = jax.jit(sampler.apply_token_bitmask, **self._sample_shardings).lower(
                self._spec((key[1], self.config.vocab_size), jnp.float32),
                self._spec((key[1], self.bitmask_width), jnp.int32))
        else:
            _, rows, history_width, top_width, all_greedy = key
            md = sampler.make_sampling_metadata([], rows, eos_token_ids=self.eos_token_ids)
            md = md._replace(history_token_ids=np.zeros((rows, history_width), np.int32))
            logits = self._spec((rows, self.config.vocab_size), jnp.float32)
            sample = jax.jit(functools.partial(_sample_and_keep, num_top_logprobs=top_width,
                                               all_greedy=all_greedy,
                                               keep_rows=self.shapes.row_buckets[-1]),
                             **self._sample_shardings)
            lowered = sample.lower(logits, jax.tree.map(lambda x: self._spec(x.shape, x.dtype), md))
        return lowered.compile()

    def _program(self, key: tuple) -> Callable:
        program = self._programs.get(key)
        if program is None:
            if self._warm:
                if self.strict:
                    raise CompileDuringServing(f"no program for {key} was compiled at warmup")
                self.num_serving_compiles += 1
                log.warning("compiling %s while serving: warmup missed this shape", key)
            program = self._programs[key] = self._compile(key)
        return program

    def program_keys(self) -> list[tuple]:
        """Every program serving can need: one forward per token bucket, and per logits row
        count the sampler with and without penalties, top logprobs and sampled rows, and the
        token-bitmask step; per token bucket the prompt scorer."""
        keys = [("forward", t) for t in self.shapes.token_buckets]
        keys += [("score", t) for t in self.shapes.token_buckets]
        keys += [("sample", s, h, k, g) for s in self.shapes.row_buckets
                 for h in (0, self.shapes.history_width) for k in (0, sampler.MAX_LOGPROBS)
                 for g in (False, True)]
        keys += [("bitmask", s) for s in self.shapes.row_buckets]
        if self.host_pool is not None:
            keys += self.host_pool.program_keys()
        return keys

    def warmup(self, progress: bool = True) -> None:
        from tqdm import tqdm

        keys = self.program_keys()
        for key in tqdm(keys, desc="compiling", unit="program", file=sys.stderr,
                        disable=not progress):
            started = time.perf_counter()
            self._program(key)
            self.program_compile_seconds[key] = time.perf_counter() - started
        self._warm = True

    def close(self) -> None:
        """Free the device memory now (params, KV cache, programs) rather than when the garbage
        collector finds the last reference; the runner is unusable afterwards."""
        for leaf in jax.tree.leaves((self.params, self.kv_cache)):
            leaf.delete()
        self._programs.clear()

    # ---- sleep (POST /sleep, /wake_up): the compiled programs stay, so waking compiles nothing

    @property
    def sleeping_tags(self) -> frozenset[str]:
        """What sleeps: "kv_cache" (the pool is freed), "weights" (they are in host memory)."""
        return frozenset(tag for tag, asleep in (("kv_cache", self.kv_cache is None),
                                                 ("weights", self._param_shardings is not None))
                         if asleep)

    def sleep_kv_cache(self) -> None:
        """Free the KV pool; its contents are gone (the caller forgets its prefix cache)."""
        if self.kv_cache is not None:
            self.kv_cache.delete()
            self.kv_cache, self._hidden = None, None

    def wake_kv_cache(self) -> None:
        if self.kv_cache is None:
            self.kv_cache = self._new_kv_cache()

    def sleep_weights(self) -> None:
        """Move the weights to host memory (jaxserve.executor.standby)."""
        if self._param_shardings is None:
            self.params, self._param_shardings = standby.to_host(self.params)

    def wake_weights(self) -> None:
        if self._param_shardings is not None:
            self.params = standby.to_device(self.params, self._param_shardings)
            self._param_shardings = None

    # ---- one step ----------------------------------------------------------------------------

    def _put(self, tree):
        """A step's host inputs, for a compiled program. On one device they go as they are:
        the program's call moves numpy arguments itself, in C++, where jax.device_put costs a
        Python dispatch per array (about 20 arrays a step: RESULTS.md, "Host gap between
        steps"); over a mesh they are replicated here."""
        return tree if self._replicated is None else jax.device_put(tree, self._replicated)

    def forward(self, plan: BatchPlan) -> jax.Array:
        """Enqueue the model over the plan; the logits of its sampling rows, f32[S, V] on the
        device (still being computed when this returns)."""
        if self.publish is not None:
            self.publish(plan)
        return self.run_forward(plan)

    def sample(self, logits: jax.Array, rows: Sequence[sampler.SamplingRow | None],
               token_bitmask: np.ndarray | None = None) -> StepOutput:
        """Draw a token for each row that is not None (row i is the plan's logits row i) and
        wait for them. token_bitmask: i32[S, bitmask_width] for the S rows of `logits` (all bits
        set on the unconstrained ones), or None when no row is constrained."""
        return self.sample_async(logits, rows, token_bitmask).result()

    def sample_async(self, logits: jax.Array, rows: Sequence[sampler.SamplingRow | None],
                     token_bitmask: np.ndarray | None = None) -> PendingStep:
        """`sample`, only launched: the next forward may be launched before its tokens are read
        (its plan's placeholders take them on the device)."""
        num_rows = logits.shape[0]
        inputs = SampleInputs(
            sampler.make_sampling_metadata(rows, num_rows, eos_token_ids=self.eos_token_ids,
                                           history_buckets=(self.shapes.history_width,)),
            sampler.top_logprobs_width(rows), token_bitmask)
        if self.publish is not None:
            self.publish(inputs)
        return self.run_sample(logits, inputs)

    def run_forward(self, plan: BatchPlan) -> jax.Array:
        """`forward` without publishing (what a multi-host follower runs)."""
        forward = self._program(("forward", plan.token_ids.shape[0]))
        self.kv_cache, logits, self._hidden, expert_tokens = forward(
            self.params, self.kv_cache, self._put(plan), self._last_tokens)
        if expert_tokens.shape[0]:
            self.expert_load.add(expert_tokens)
        return logits

    def copy_pages(self, copies) -> None:
        """Run the host tier's copies (PageCopies, in order) before the step's forward."""
        if copies:
            self.kv_cache = self.host_pool.run(copies, self.kv_cache, self._program)

    def read_pages(self, pages) -> np.ndarray:
        """Pages of the pool on the host now, [layers, len(pages), *page] (the host tier's
        programs; a prefill server hands them to a decode server)."""
        return self.host_pool.read_pages(pages, self.kv_cache, self._program)

    def score(self, target_token_ids: np.ndarray) -> ScoreOutput:
        """Score the last forward's rows: row i's log-probability of target_token_ids[i]
        (i32[T], T the plan's flat tokens), its rank and the top MAX_LOGPROBS."""
        inputs = ScoreInputs(np.asarray(target_token_ids, np.int32))
        if self.publish is not None:
            self.publish(inputs)
        return self.run_score(inputs)

    def run_score(self, inputs: ScoreInputs) -> ScoreOutput:
        """`score` without publishing."""
        targets = inputs.target_token_ids
        if self._hidden is None or targets.shape != self._hidden.shape[:1]:
            raise ValueError(f"{targets.shape} targets for the last forward's rows")
        program = self._program(("score", targets.shape[0]))
        return ScoreOutput(*jax.device_get(program(self.params, self._hidden,
                                                   self._put(targets))))

    def run_sample(self, logits: jax.Array, inputs: SampleInputs) -> PendingStep:
        """`sample_async` from its host inputs, without publishing. The sampler metadata and the
        bitmask go to the device in one transfer."""
        md, token_bitmask, num_rows = inputs.metadata, inputs.token_bitmask, logits.shape[0]
        # From the host metadata, so a multi-host follower picks the same program.
        all_greedy = bool(np.all(md.temperature < sampler.SAMPLING_EPS))
        if token_bitmask is None:
            md = self._put(md)
        else:
            if token_bitmask.shape != (num_rows, self.bitmask_width):
                raise ValueError(f"token bitmask of shape {token_bitmask.shape} for "
                                 f"{(num_rows, self.bitmask_width)}")
            md, token_bitmask = self._put((md, token_bitmask))
            logits = self._program(("bitmask", num_rows))(logits, token_bitmask)
        sample = self._program(("sample", num_rows, md.history_token_ids.shape[1],
                                inputs.top_width, all_greedy))
        out, self._last_tokens = sample(logits, md)
        return PendingStep(tuple(out))
