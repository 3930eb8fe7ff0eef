"""Tokenizer: a HF `tokenizers` BPE built from GGUF metadata or from tokenizer.json, the model's own
chat template rendered in a jinja2 sandbox, and incremental detokenization for streaming.

Host-side only: nothing here imports JAX.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from jaxserve.errors import InvalidRequest, ModelNotFound, NoChatTemplate, TokenizerError
from jaxserve.tool_calling.functions import FunctionTool
from jaxserve.tool_calling.prompt import (chat_messages, fallback_adds_system,
                                          template_call_format, template_uses_tools)

# ---------------------------------------------------------------- GGUF pre-tokenizers

# BPE merges only inside a pre-token, so the split regex a vocabulary was trained with decides the
# ids. `tokenizer.ggml.pre` names the tokenizer llama.cpp recognised when it wrote the file; several
# names share one split. GPT-2's own split is what `ByteLevel(use_regex=True)` applies; the others
# are written out and run before a `ByteLevel` that only maps bytes.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's split with single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# tiktoken's o200k split: case-aware words that keep their contraction.
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek-V3 / R1's three splits, one after another (its tokenizer.json's Split sequence, as
# llama.cpp's `deepseek-v3`): digit runs in threes, CJK runs, then a Llama-3-like split in which
# punctuation and symbols are their own class and one ASCII sign may lead a Latin word.
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)

# Kimi K2 (llama.cpp's `kimi-k2`): its tiktoken pattern (tokenization_kimi.py's pat_str), o200k's
# with Han runs on their own and kept out of the letter classes (`&&`: Oniguruma's intersection).
_KIMI_K2_SPLIT = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_split():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split():
    # StarCoder-family vocabularies (SmolLM2 among them) were trained with every digit on its own.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _regex_split(*patterns: str):
    """Each pattern splits the pieces of the one before, then bytes map to byte-level chars."""
    def build():
        return pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return build


_PRE_TOKENIZERS = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "roberta-bpe",
                     "jina-v1-en", "jina-v2-code", "jina-v2-de", "jina-v2-es", "jina-de",
                     "jina-es", "gigachat"), _gpt2_split),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva"), _digits_then_gpt2_split),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3",
                     "falcon-h1", "pixtral"), _regex_split(_LLAMA3_SPLIT)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _regex_split(_QWEN2_SPLIT)),
    **dict.fromkeys(("gpt-4o", "llama4"), _regex_split(_O200K_SPLIT)),
    "deepseek-v3": _regex_split(*_DEEPSEEK3_SPLITS),
    "kimi-k2": _regex_split(_KIMI_K2_SPLIT),
}

# llama.cpp's token types (gguf.TokenType): unknown and control tokens are special (skipped when
# decoding with skip_special_tokens); user-defined ones are matched whole in the text but decode
# like any token.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4


def _gguf_fields(path: Path) -> dict:
    from jaxserve.gguf_file import GGUFFile  # here: reading a tokenizer.json never needs gguf

    try:
        reader = GGUFFile(str(path))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: not a readable GGUF file ({e})") from None
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _add_typed_tokens(backend: Backend, tokens: list[str], types: list[int]) -> None:
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t in (_UNKNOWN, _CONTROL)])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == _USER_DEFINED])


def _byte_level_backend(path: Path, meta: dict) -> Backend:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise TokenizerError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported (supported: "
                             f"{', '.join(sorted(_PRE_TOKENIZERS))})")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    # `tokenizer.ggml.add_space_prefix` is not applied: llama.cpp reads it for sentencepiece
    # vocabularies only, and HF's byte-level converter ignores it too.
    _add_typed_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type", []))
    return backend


def _sentencepiece_merges(tokens: list[str], scores: list[float],
                          types: list[int]) -> list[tuple[str, str]]:
    """sentencepiece's BPE merges the adjacent pair whose union scores highest; a `tokenizers` BPE
    merges the pair of lowest rank. So every split of a normal piece into two normal pieces is a
    merge, ranked by the piece's score (ties: lower ids first)."""
    normal = {t: i for i, t in enumerate(tokens) if not types or types[i] == _NORMAL}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_backend(path: Path, meta: dict) -> Backend:
    """Llama-2 / Mistral-style vocabularies (`tokenizer.ggml.model == "llama"`), built as
    transformers' non-legacy Llama tokenizer: `▁` for spaces, one prefixed at the start of the
    text, bytes missing from the vocabulary spelled as `<0xHH>` pieces."""
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [])
    if "tokenizer.ggml.scores" not in meta:
        raise TokenizerError(f"{path}: sentencepiece GGUF without tokenizer.ggml.scores")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = Backend(models.BPE(
        {t: i for i, t in enumerate(tokens)},
        _sentencepiece_merges(tokens, meta["tokenizer.ggml.scores"], types),
        unk_token=tokens[unk] if unk is not None else None, fuse_unk=True, byte_fallback=True))
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # split=False: sentencepiece runs over the whole text, so pieces may span spaces.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        prepend_scheme="first" if space_prefix else "never", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    _add_typed_tokens(backend, tokens, types)
    return backend


# `tokenizer.ggml.model` -> (builder, llama.cpp's add_bos default when the file has no flag).
_GGUF_TOKENIZERS = {"gpt2": (_byte_level_backend, False), "llama": (_sentencepiece_backend, True)}


def _bos_eos_processor(tokens: list[str], bos_id: int | None, eos_id: int | None):
    """`encode(add_special_tokens=True)` adds BOS / EOS around the text as the file's flags say."""
    parts = [(tokens[i], i) for i in (bos_id, eos_id) if i is not None]
    single = " ".join(([f"{tokens[bos_id]}:0"] if bos_id is not None else []) + ["$A:0"]
                      + ([f"{tokens[eos_id]}:0"] if eos_id is not None else []))
    return processors.TemplateProcessing(single=single, special_tokens=list(dict.fromkeys(parts)))


# ---------------------------------------------------------------- tokenizer.json directories


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: unreadable ({e})") from None


def _token_content(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _config_chat_template(config: dict, directory: Path) -> str | None:
    path = directory / "chat_template.jinja"
    if path.exists():  # transformers >= 4.43 writes the template beside the config
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one serves chat
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def _generation_eos_ids(directory: Path) -> list[int]:
    # Instruct models often stop on more than the tokenizer's eos (Llama 3: <|eot_id|>); HF keeps
    # that list in generation_config.json.
    eos = _read_json(directory / "generation_config.json").get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


# ---------------------------------------------------------------- chat templates


class _TemplateRaised(Exception):
    """A chat template rejected the messages (`raise_exception(...)` in the template)."""


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    # transformers' filter, not jinja's: jinja's escapes <, >, & and ' for HTML, which changes the
    # text (and so the tokens) of any tool schema holding them.
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def _compile_template(source: str) -> jinja2.Template:
    # The same environment options transformers renders with, so a template's whitespace comes out
    # as its authors tested it.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"the model's chat template does not compile: {e}") from None


# What the renderer itself passes a template: a request's chat_template_kwargs may not replace it.
_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token",
                                 "eos_token", "raise_exception", "strftime_now"})
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_CHARS = 16_384
_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def check_template_kwargs(value: dict, param: str = "chat_template_kwargs") -> dict:
    """A request's extra chat-template variables (vLLM's `chat_template_kwargs`, such as Qwen3's
    `enable_thinking`), bounded: at most 32 names that are identifiers, none of the variables the
    renderer sets, JSON values of at most 16 KiB in all. InvalidRequest naming `param`."""
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequest(f"'{param}' takes at most {MAX_TEMPLATE_KWARGS} names, got "
                             f"{len(value)}", param=param)
    for name in value:
        if not _KWARG_NAME.fullmatch(name):
            raise InvalidRequest(f"'{param}': {name!r:.70} is not a template variable name "
                                 f"(letters, digits and '_', at most 64)", param=param)
        if name in _TEMPLATE_VARIABLES:
            raise InvalidRequest(f"'{param}': {name!r} is set by the server and cannot be "
                                 f"replaced", param=param)
    if len(json.dumps(value, ensure_ascii=False)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidRequest(f"'{param}' is longer than {MAX_TEMPLATE_KWARGS_CHARS} characters "
                             f"of JSON", param=param)
    return value


# ---------------------------------------------------------------- Tokenizer


class Tokenizer:
    """A model's tokenizer: encode/decode through a `tokenizers.Tokenizer`, plus the special
    tokens and chat template that come with the model."""

    def __init__(self, backend: Backend, *, source: str, bos_token: str | None = None,
                 eos_token: str | None = None, extra_eos_token_ids: Sequence[int] = (),
                 chat_template: str | None = None):
        self._backend = backend
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template or None
        eos = [self._token_id(eos_token)] + [int(i) for i in extra_eos_token_ids]
        self._eos_token_ids = tuple(dict.fromkeys(i for i in eos if i is not None))

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    @classmethod
    def from_gguf(cls, path: str | Path, *, chat_template: str | None = None) -> Tokenizer:
        """chat_template: overrides the file's (as `--chat-template` does)."""
        path = Path(path)
        meta = _gguf_fields(path)
        kind = meta.get("tokenizer.ggml.model")
        if kind not in _GGUF_TOKENIZERS:
            raise TokenizerError(f"{path}: GGUF tokenizer model {kind!r} is not supported "
                                 f"(supported: {', '.join(_GGUF_TOKENIZERS)})")
        if "tokenizer.ggml.tokens" not in meta:
            raise TokenizerError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens")
        tokens = meta["tokenizer.ggml.tokens"]
        build, add_bos_default = _GGUF_TOKENIZERS[kind]
        backend = build(path, meta)

        def special(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return None if value is None else int(value)

        bos, eos = special("bos_token_id"), special("eos_token_id")
        add_bos = bos is not None and bool(meta.get("tokenizer.ggml.add_bos_token",
                                                    add_bos_default))
        add_eos = eos is not None and bool(meta.get("tokenizer.ggml.add_eos_token", False))
        if add_bos or add_eos:
            backend.post_processor = _bos_eos_processor(tokens, bos if add_bos else None,
                                                        eos if add_eos else None)
        extra_eos = [i for i in (special("eot_token_id"), special("eom_token_id")) if i is not None]
        return cls(backend, source=str(path),
                   bos_token=tokens[bos] if bos is not None else None,
                   eos_token=tokens[eos] if eos is not None else None,
                   extra_eos_token_ids=extra_eos,
                   chat_template=chat_template or meta.get("tokenizer.chat_template"))

    @classmethod
    def from_file(cls, path: str | Path, *, chat_template: str | None = None) -> Tokenizer:
        """From an HF tokenizer.json, or a directory holding one (with tokenizer_config.json,
        chat_template.jinja and generation_config.json read when present). chat_template
        overrides the directory's."""
        path = Path(path)
        json_path = path / "tokenizer.json" if path.is_dir() else path
        if not json_path.is_file():
            raise TokenizerError(f"{json_path}: no such tokenizer file")
        try:
            backend = Backend.from_file(str(json_path))
        except Exception as e:  # the Rust side raises plain Exception for any malformed file
            raise TokenizerError(f"{json_path}: not a valid tokenizer.json ({e})") from None
        directory = json_path.parent
        config = _read_json(directory / "tokenizer_config.json")
        return cls(backend, source=str(json_path),
                   bos_token=_token_content(config.get("bos_token")),
                   eos_token=_token_content(config.get("eos_token")),
                   extra_eos_token_ids=_generation_eos_ids(directory),
                   chat_template=chat_template or _config_chat_template(config, directory))

    # ------------------------------------------------------------ properties

    def to_json(self) -> str:
        """The tokenizer as HF tokenizer.json text (what llguidance builds its token index from)."""
        return self._backend.to_str()

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self.bos_token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @cached_property
    def all_special_ids(self) -> tuple[int, ...]:
        return tuple(sorted(i for i, t in self._backend.get_added_tokens_decoder().items()
                            if t.special))

    @cached_property
    def _byte_fallback_ids(self) -> frozenset[int]:
        """The `<0xHH>` pieces of a sentencepiece-style vocabulary with byte fallback."""
        if not getattr(self._backend.model, "byte_fallback", False):
            return frozenset()
        ids = (self._backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)

    # ------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------ chat

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise NoChatTemplate("this model has no chat template; send a plain prompt "
                                 "(completions) instead of chat messages")
        return _compile_template(self.chat_template)

    @cached_property
    def template_uses_tools(self) -> bool:
        """The chat template renders tools itself (it reads the `tools` variable); otherwise
        tools and tool messages go through jaxserve's Hermes-style fallback."""
        return self.chat_template is not None and template_uses_tools(self.chat_template)

    @cached_property
    def template_call_format(self) -> str | None:
        """The call format a template that does not list tools writes its history's calls in
        (DeepSeek-V3's), which the tools prompt then teaches (tool_calling.prompt)."""
        if self.chat_template is None or self.template_uses_tools:
            return None
        return template_call_format(self.chat_template)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True, tools: Sequence[FunctionTool] = (),
                            template_kwargs: Mapping[str, Any] | None = None
                            ) -> list[int] | str:
        """Render `messages` with the model's template; with `tokenize`, the ids (the template
        writes its own special tokens, so none are added). Tools, assistant tool calls and tool
        results go to the template when it handles them, else through the built-in fallback
        (`jaxserve.tool_calling.prompt`). `template_kwargs`: more variables for the template
        (checked by check_template_kwargs), such as `enable_thinking`."""
        native = self.template_uses_tools
        extra = dict(template_kwargs or {})
        if native:
            extra["tools"] = [t.to_openai() for t in tools] or None
        try:
            text = self._render(chat_messages(messages, tools, native=native,
                                              call_format=self.template_call_format),
                                add_generation_prompt, extra)
        except _TemplateRaised as e:
            if native or not fallback_adds_system(messages, tools):
                raise InvalidRequest(f"the chat template rejected the messages: {e}",
                                     param="messages") from None
            # A template that refuses the system role (Gemma 2) gets the tools in the first
            # user message instead.
            text = self.apply_chat_template(
                chat_messages(messages, tools, native=False, tools_in_user=True,
                              call_format=self.template_call_format),
                add_generation_prompt, tokenize=False, template_kwargs=template_kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _render(self, messages: list[dict], add_generation_prompt: bool, extra: dict) -> str:
        try:
            return self._template.render(**extra, messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "")
        except SecurityError as e:  # the template's fault, whatever the messages
            raise TokenizerError(f"the model's chat template was stopped by the sandbox: {e}") \
                from None
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"the chat template failed on these messages: {e}",
                                 param="messages") from None


# ---------------------------------------------------------------- streaming


_INCOMPLETE = "\ufffd"
# Prompt tokens decoded in front of the first generated ones: decoders that strip the leading space
# of a text (sentencepiece's) must see the generated tokens mid-text, as they are.
_PROMPT_CONTEXT = 4


class IncrementalDetokenizer:
    """Turns generated ids, fed one at a time, into text deltas.

    Keeps two offsets into the ids, as vLLM and TGI do: text is decoded over the window
    `[prefix_offset:]` and compared with the decode of `[prefix_offset:read_offset]`, so the
    decoder always sees a few tokens of left context (merges of spaces, byte fallback) while each
    step decodes O(1) tokens. A delta ending in U+FFFD is a multi-byte character whose bytes have
    not all arrived: it is held back until they do. The deltas concatenate to `decode(ids)`
    (`decode(prompt + ids)` past the prompt, given `prompt_ids`) once `finish()` is called.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Tokens whose text depends on what follows them, so no offset may sit right after one:
        # HF's byte-fallback decoder turns a whole run of `<0xHH>` pieces into U+FFFDs when any
        # of it is invalid, and a skipped special token between two pieces joins their runs.
        self._no_boundary_after = tokenizer._byte_fallback_ids | (
            frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset())
        context = [int(i) for i in prompt_ids[-_PROMPT_CONTEXT:]]
        if context and (context[-1] in self._no_boundary_after
                        or self._decode(context).endswith(_INCOMPLETE)):
            context = []  # a prompt ending mid-character gives no usable boundary
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Feed one generated id; the text it completes (often "", never half a character)."""
        token_id = int(token_id)
        self._ids.append(token_id)
        if token_id in self._no_boundary_after:
            return ""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return ""
        return self._emit(full[len(prefix):])

    def finish(self) -> str:
        """The text held back at the end of generation (a truly incomplete character is decoded
        as U+FFFD, as `decode` does)."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return self._emit(self._decode(self._ids[self._prefix_offset:])[len(prefix):])

    def _emit(self, delta: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta


# ---------------------------------------------------------------------------------------------
# Which tokenizer a model uses.


def tokenizer_source(spec) -> str | None:
    """Where the tokenizer of a model (a model_registry.ModelSpec) lives: the GGUF itself, an HF
    tokenizer.json, or what an orbax checkpoint recorded about the model it was converted from."""
    if spec.format == "gguf":
        return str(spec.path.resolve())
    if spec.format == "hf":
        path = spec.path / "tokenizer.json"
        return str(path.resolve()) if path.exists() else None
    from jaxserve.weights.checkpoint import read_meta

    return read_meta(spec.path).get("tokenizer_source")


def read_chat_template(value: str) -> str:
    """`--chat-template`, as vLLM takes it: a file holding a jinja chat template, or the template
    itself. Checked to compile, so a bad one fails at start."""
    path = Path(value)
    try:
        source = path.read_text() if path.is_file() else None
    except OSError as e:
        raise TokenizerError(f"--chat-template {value}: unreadable ({e})") from None
    if source is None:
        if "{{" not in value and "{%" not in value:
            raise TokenizerError(f"--chat-template {value}: no such file")
        source = value
    _compile_template(source)
    return source


def load_tokenizer(spec, chat_template: str | None = None) -> Tokenizer:
    """chat_template: `--chat-template` (a file or the template), overriding the model's."""
    source = tokenizer_source(spec)
    if source is None:
        raise ModelNotFound(f"{spec.path}: no tokenizer found (expected tokenizer.json)")
    template = read_chat_template(chat_template) if chat_template is not None else None
    if source.endswith(".gguf"):
        return Tokenizer.from_gguf(source, chat_template=template)
    return Tokenizer.from_file(source, chat_template=template)
