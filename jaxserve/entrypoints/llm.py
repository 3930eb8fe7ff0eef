"""The offline API, in vLLM's shape:

    from jaxserve import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", max_num_seqs=64)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, Sequence

from jaxserve.core.engine import LLMEngine
from jaxserve.core.engine_factory import build_engine
from jaxserve.errors import InvalidRequest
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer


class LLM:
    """model: a registered name or a path (GGUF file, HF directory, orbax checkpoint).
    engine_args: the engine settings by name (jaxserve.engine_settings.SETTINGS: max_num_seqs,
    max_model_len, num_pages, tensor_parallel_size, quantization, chat_template, ...), as the
    command-line flags take them; data_parallel_size > 1 is for the servers (one LLMEngine is one
    replica). warmup=False compiles each program on first use instead of all at start (one-off
    scripts)."""

    def __init__(self, model: str, *, dtype: str | None = None, warmup: bool = True,
                 strict_compile: bool = False, progress: bool = True, **engine_args: Any):
        self.engine = build_engine(model, dtype=dtype, warmup=warmup,
                                   strict_compile=strict_compile, progress=progress,
                                   **engine_args)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine, llm._ids = engine, itertools.count()
        return llm

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: str | dict | Sequence[str | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of the prompts."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequest(f"{len(params)} sampling params for {len(prompts)} prompts",
                                     "sampling_params")
        # Validate everything before queueing anything: a bad prompt fails the call, not half of it.
        prepared = [self.engine.prepare(str(next(self._ids)), p, sp)
                    for p, sp in zip(prompts, params)]
        order = {r.request_id: i for i, r in enumerate(prepared)}
        for r in prepared:
            self.engine.add_request(r.request_id, prepared=r)
        results: list[RequestOutput | None] = [None] * len(prepared)
        from tqdm import tqdm

        with tqdm(total=len(prepared), desc="requests", file=sys.stderr,
                  disable=not use_tqdm) as bar:
            try:
                while self.engine.has_unfinished():
                    for out in self.engine.step():
                        if out.finished:
                            results[order[out.request_id]] = out
                            bar.update(1)
            except BaseException:
                for r in prepared:  # an interrupted call leaves no request holding pages
                    self.engine.abort(r.request_id)
                self.engine.step()
                raise
        return results
