"""Tokenizer: SmolLM2's GGUF tokenizer against HF's golden ids, tiny GGUF and tokenizer.json
tokenizers built here, chat templates, and incremental detokenization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from jaxserve.errors import InvalidRequest, TokenizerError
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

# ---------------------------------------------------------------- SmolLM2 (the real GGUF)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


@pytest.mark.slow
def test_golden_ids_exactly(smollm2_tokenizer, golden_dir):
    cases = json.loads((golden_dir / "smollm2_tokenizer_golden.json").read_text())
    assert len(cases) >= 5
    for case in cases:
        ids = smollm2_tokenizer.encode(case["text"])
        assert ids == case["ids"], case["text"]
        assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == case["text"]


@pytest.mark.slow
def test_golden_prompt_ids_chat_and_raw(smollm2_tokenizer, smollm2_golden):
    chat = [c for c in smollm2_golden["cases"] if "messages" in c["case"]]
    raw = [c for c in smollm2_golden["cases"] if "prompt" in c["case"]]
    assert chat and raw
    for case in chat:
        ids = smollm2_tokenizer.apply_chat_template(case["case"]["messages"])
        assert ids == case["input_ids"]
    # SmolLM2's GGUF sets add_bos_token = false and HF's raw prompts carry no BOS.
    for case in raw:
        assert smollm2_tokenizer.encode(case["case"]["prompt"]) == case["input_ids"]
    for case in smollm2_golden["cases"]:
        assert smollm2_tokenizer.decode(case["greedy_ids"], skip_special_tokens=False) \
            == case["greedy_text"]


@pytest.mark.slow
def test_smollm2_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.all_special_ids == tuple(range(17))  # the GGUF's 17 control tokens
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n")
    assert "<|im_start|>assistant" not in text


# Printable text from scripts that need 1 to 4 UTF-8 bytes per character. SmolLM2's vocabulary
# lacks the bytes 0xF1 and 0xF2 (it never saw planes 4 to 11): characters there cannot be encoded.
_UNICODE_TEXT = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_categories=("Cs", "Cc")),
        st.sampled_from("東京日本語한국어ÀéîõüßЖπ🎉😀👍🏽🚀🧪 \n\t.,!?0123456789"),
    ),
    max_size=40,
)


def _stream(detok: IncrementalDetokenizer, ids: list[int], decode) -> list[str]:
    """Feed `ids` one at a time and return the deltas, finish() last, checking at every step
    that the text so far is a prefix of the final text (nothing emitted is ever taken back)."""
    final = decode(ids)
    deltas = []
    for token_id in ids:
        deltas.append(detok.add(token_id))
        assert "".join(deltas) == detok.text
        assert final.startswith(detok.text)
    deltas.append(detok.finish())
    return deltas


def _caught_up(tok: Tokenizer, ids: list[int]) -> None:
    """Without byte-fallback pieces, text comes out as soon as a character is complete."""
    detok = IncrementalDetokenizer(tok)
    for i, token_id in enumerate(ids):
        detok.add(token_id)
        so_far = tok.decode(ids[:i + 1])
        if not so_far.endswith("\ufffd"):
            assert detok.text == so_far


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(text=_UNICODE_TEXT)
def test_incremental_detokenizer_unicode_text(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text)
    deltas = _stream(IncrementalDetokenizer(tok), ids, tok.decode)
    assert "".join(deltas) == tok.decode(ids) == text
    assert "\ufffd" in text or not any("\ufffd" in d for d in deltas)
    _caught_up(tok, ids)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=30), skip=st.booleans())
def test_incremental_detokenizer_any_ids(smollm2_tokenizer, ids, skip):
    """Arbitrary ids (lone UTF-8 continuation bytes, special tokens): the deltas still add up
    to decode(ids), and a U+FFFD comes out only where decode(ids) has one."""
    tok = smollm2_tokenizer

    def decode(i):
        return tok.decode(i, skip_special_tokens=skip)

    deltas = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, decode)
    assert "".join(deltas) == decode(ids)


@pytest.mark.slow
def test_incremental_detokenizer_emoji_split_across_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("🎉")
    assert len(ids) > 1  # the emoji's bytes span tokens: the first ones must be held back
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]
    # A character that never completes comes out (as decode writes it) at the end.
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[0]) == ""
    assert detok.finish() == tok.decode(ids[:1]) == "\ufffd"


@pytest.mark.slow
def test_incremental_detokenizer_after_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.encode("Über den Wolken 東京")
    generated = tok.encode(" muss die Freiheit 🎉 grenzenlos sein.")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(detok.add(i) for i in generated) + detok.finish()
    assert text == tok.decode(prompt + generated)[len(tok.decode(prompt)):]


# ---------------------------------------------------------------- tiny GGUF tokenizers

_BYTES = pre_tokenizers.ByteLevel.alphabet()  # the 256 characters of byte-level BPE
_TINY_MERGES = ["Ġ Ġ", "Ġ 1", "1 2", "3 4", "12 3", "4 5", "h i"]


def tiny_gguf(path: Path, *, pre: str = "smollm", model: str = "gpt2", add_bos: bool = True,
              chat_template: str | None = "{% for m in messages %}<s>{{ m['content'] }}"
                                          "{% endfor %}") -> Path:
    """A GGUF holding only a tokenizer: byte tokens, a few merges, two control tokens."""
    from gguf import GGUFWriter

    tokens = ["<s>", "</s>", *sorted(_BYTES)] + [m.replace(" ", "") for m in _TINY_MERGES]
    w = GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(_TINY_MERGES)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]


def test_gguf_pre_tokenizer_decides_the_merges(tmp_path):
    # Digits split first (StarCoder / SmolLM): the two spaces merge, the digit stands alone.
    smollm = Tokenizer.from_gguf(tiny_gguf(tmp_path / "s.gguf", pre="smollm"))
    assert _pieces(smollm, "a  1") == ["a", "  ", "1"]
    assert _pieces(smollm, "12345") == list("12345")
    # GPT-2's split keeps " 1" together and leaves digits to the merges.
    gpt2 = Tokenizer.from_gguf(tiny_gguf(tmp_path / "g.gguf", pre="gpt-2"))
    assert _pieces(gpt2, "a  1") == ["a", " ", " 1"]
    assert _pieces(gpt2, "12345") == ["12", "34", "5"]
    # Llama 3 cuts digit runs into threes; Qwen2 into single digits.
    llama3 = Tokenizer.from_gguf(tiny_gguf(tmp_path / "l.gguf", pre="llama-bpe"))
    assert _pieces(llama3, "12345") == ["123", "45"]
    qwen2 = Tokenizer.from_gguf(tiny_gguf(tmp_path / "q.gguf", pre="qwen2"))
    assert _pieces(qwen2, "12345") == list("12345")
    # DeepSeek-V3 (llama.cpp's deepseek-v3): digits in threes, then CJK runs cut from the Latin
    # word they follow, then its word split (an ASCII sign may lead a word).
    ds3 = Tokenizer.from_gguf(tiny_gguf(tmp_path / "d.gguf", pre="deepseek-v3"))
    assert _pieces(ds3, "12345") == ["123", "45"]
    split = ds3._backend.pre_tokenizer.pre_tokenize_str
    assert [decoders.ByteLevel().decode([p]) for p, _ in split("hi世界 a.b (c) don't")] == [
        "hi", "世界", " a", ".b", " (", "c", ")", " don", "'t"]


def test_gguf_kimi_k2_tokenizer_encodes_as_tiktoken(tmp_path):
    """Kimi K2's vocabulary is tiktoken's (its pattern, ranks as merges): a GGUF of the tiny
    vocabulary with pre `kimi-k2` splits text as Kimi's pat_str does (the `regex` module's
    engine, which has its class intersection) and gives the tokens tiktoken gives."""
    import regex
    import tiktoken

    from jaxserve.tokenizer import _KIMI_K2_SPLIT

    # GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the others for
    # 256, 257, ... in byte order.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = iter(range(256, 512))
    byte_of = {chr(b if b in printable else next(others)): b for b in range(256)}

    def _to_bytes(token: str) -> bytes:
        return bytes(byte_of[c] for c in token)

    ranks = {bytes([b]): b for b in range(256)}
    for merge in _TINY_MERGES:  # a merge's rank is its priority
        left, right = merge.split(" ")
        ranks[_to_bytes(left) + _to_bytes(right)] = len(ranks)
    reference = tiktoken.Encoding("kimi-tiny", pat_str=_KIMI_K2_SPLIT, mergeable_ranks=ranks,
                                  special_tokens={})
    kimi = Tokenizer.from_gguf(tiny_gguf(tmp_path / "k.gguf", pre="kimi-k2"))
    for text in ("hi世界  12345 HTTPServer don't", "ÉCOLE naïve a/b//c 中文テスト\n\n x"):
        want = [reference.decode_single_token_bytes(t) for t in reference.encode(text)]
        got = [_to_bytes(kimi._backend.id_to_token(i))
               for i in kimi.encode(text, add_special_tokens=False)]
        assert got == want, text
        pieces = kimi._backend.pre_tokenizer.pre_tokenize_str(text)
        assert [_to_bytes(p) for p, _ in pieces] == [
            m.encode() for m in regex.findall(_KIMI_K2_SPLIT, text, flags=regex.V1)], text


def test_gguf_flags_and_special_tokens(tmp_path):
    tok = Tokenizer.from_gguf(tiny_gguf(tmp_path / "t.gguf", add_bos=True))
    assert tok.bos_token_id == 0 and tok.eos_token_ids == (1,)
    assert tok.all_special_ids == (0, 1)
    hi = tok.encode("hi", add_special_tokens=False)
    assert len(hi) == 1
    assert tok.encode("hi") == [0, *hi]
    assert tok.encode("</s>hi", add_special_tokens=False) == [1, *hi]
    assert tok.decode([0, *hi, 1]) == "hi"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == [0, *hi]
    no_bos = Tokenizer.from_gguf(tiny_gguf(tmp_path / "n.gguf", add_bos=False))
    assert no_bos.encode("hi") == hi


def test_gguf_bad_tokenizers(tmp_path):
    tok = Tokenizer.from_gguf(tiny_gguf(tmp_path / "t.gguf", chat_template=None))
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(TokenizerError, match="pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf(tiny_gguf(tmp_path / "p.gguf", pre="mystery"))
    with pytest.raises(TokenizerError, match="tokenizer model 'bert' is not supported"):
        Tokenizer.from_gguf(tiny_gguf(tmp_path / "m.gguf", model="bert"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(TokenizerError, match="not a readable GGUF"):
        Tokenizer.from_gguf(junk)


_SPM_PIECES = {"▁h": -1, "ll": -2, "▁he": -3, "llo": -4, "▁hello": -5, "or": -6, "▁w": -7,
               "▁wor": -8, "ld": -9, "▁world": -10, "▁hi": -11,
               **{c: -100 for c in "▁helowrdi"}}


def tiny_spm_gguf(path: Path) -> Path:
    """A Llama-2-style GGUF tokenizer: scored pieces, `<0xHH>` byte pieces, no add_bos flag."""
    from gguf import GGUFWriter

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *_SPM_PIECES]
    w = GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [float(s) for s in _SPM_PIECES.values()])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(_SPM_PIECES))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_sentencepiece_tokenizer(tmp_path):
    tok = Tokenizer.from_gguf(tiny_spm_gguf(tmp_path / "spm.gguf"))
    hello, world, hi = (259 + list(_SPM_PIECES).index(p) for p in ("▁hello", "▁world", "▁hi"))
    # BOS by default (llama.cpp's default for sentencepiece), pieces merged by score.
    assert tok.encode("hello world") == [1, hello, world]
    assert tok.all_special_ids == (0, 1, 2)
    # 東 is not in the vocabulary: its three UTF-8 bytes come as <0xHH> pieces.
    ids = tok.encode("hi 東", add_special_tokens=False)
    assert ids[0] == hi and ids[-3:] == [3 + 0xE6, 3 + 0x9D, 3 + 0xB1]
    assert tok.decode(ids) == "hi 東"
    assert tok.decode([1, hello, world, 2]) == "hello world"
    assert tok.decode([world]) == "world"  # the leading space of a text is the prefix's


def test_chat_template_sandbox_and_errors(tmp_path):
    template = ("{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}"
                "{{ messages|tojson }}{{ ''.__class__.__mro__ }}")
    tok = Tokenizer.from_gguf(tiny_gguf(tmp_path / "t.gguf", chat_template=template))
    with pytest.raises(InvalidRequest, match="no messages"):
        tok.apply_chat_template([])
    # The sandbox refuses attribute access that could reach Python internals.
    with pytest.raises(TokenizerError, match="sandbox.*unsafe"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tojson = Tokenizer.from_gguf(tiny_gguf(tmp_path / "j.gguf",
                                           chat_template="{{ messages|tojson }}"))
    # transformers' tojson: no HTML escaping, non-ASCII kept.
    rendered = tojson.apply_chat_template([{"role": "user", "content": "<a&b> 東"}],
                                          tokenize=False)
    assert rendered == '[{"role": "user", "content": "<a&b> 東"}]'
    broken = Tokenizer.from_gguf(tiny_gguf(tmp_path / "b.gguf", chat_template="{% for %}"))
    with pytest.raises(TokenizerError, match="does not compile"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])


# -------------------------------------------------------- tokenizer.json (sentencepiece-style)

_CORPUS = ["hello there world", "the world says hello", "hello again and again", "there there"]


def spm_tokenizer_json(directory: Path) -> Path:
    """A Llama-2-shaped tokenizer.json: BPE with byte fallback, `▁` for spaces, a decoder that
    strips the leading space, BOS added by the post-processor."""
    trained = Backend(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trained.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=80, show_progress=False))
    spec = json.loads(trained.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = specials + [f"<0x{b:02X}>" for b in range(256)] + sorted(spec["vocab"],
                                                                     key=spec["vocab"].get)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    backend = Backend(models.BPE({t: i for i, t in enumerate(vocab)}, merges, unk_token="<unk>",
                                 byte_fallback=True, fuse_unk=True))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def test_tokenizer_json_directory(tmp_path):
    json_path = spm_tokenizer_json(tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] "
                         "{{ m['content'] }}{{ eos_token }}{% endfor %}",
    }))
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_file(tmp_path / "model")
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 0)
    assert tok.all_special_ids == (0, 1, 2)
    assert tok.vocab_size == Backend.from_file(str(json_path)).get_vocab_size()
    ids = tok.encode("hello world")
    assert ids[0] == 1 and tok.decode(ids) == "hello world"
    # Characters outside the vocabulary go through byte fallback and come back whole.
    assert tok.decode(tok.encode("hello 東京 🎉")) == "hello 東京 🎉"
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert chat == "<s>[user] hello</s>"
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) \
        == tok.encode(chat, add_special_tokens=False)
    # chat_template.jinja (newer HF layout) takes precedence over the config's copy.
    (tmp_path / "model" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_file(json_path).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False) == "hi!"


def test_tokenizer_json_without_config_has_no_template(tmp_path):
    tok = Tokenizer.from_file(spm_tokenizer_json(tmp_path))
    assert tok.bos_token_id is None and tok.eos_token_ids == ()
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(TokenizerError, match="no such tokenizer file"):
        Tokenizer.from_file(tmp_path / "missing")
    (tmp_path / "bad" / "tokenizer.json").parent.mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        Tokenizer.from_file(tmp_path / "bad")
    spm_tokenizer_json(tmp_path / "badconfig")
    (tmp_path / "badconfig" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: unreadable"):
        Tokenizer.from_file(tmp_path / "badconfig")


@pytest.fixture(scope="session")
def spm_tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_file(spm_tokenizer_json(tmp_path_factory.mktemp("spm")))


@settings(max_examples=60, deadline=None)
@given(text=_UNICODE_TEXT)
def test_incremental_detokenizer_byte_fallback(spm_tokenizer, text):
    tok = spm_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tok), ids, tok.decode)
    # Not always `text`: spaces become `▁` and the decoder strips a leading one.
    assert "".join(deltas) == tok.decode(ids)
    assert "\ufffd" in text or not any("\ufffd" in d for d in deltas)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_incremental_detokenizer_byte_fallback_any_ids(spm_tokenizer, data, skip):
    """Runs of `<0xHH>` pieces, valid or not, interrupted by special tokens: HF decodes an invalid
    run as one U+FFFD per piece, and the stream agrees with it."""
    tok = spm_tokenizer
    pieces = st.sampled_from([0, 1, 2, 0x30 + 3, 0xC2 + 3, 0xA0 + 3, 0xE6 + 3, 0x9D + 3, 0xB1 + 3,
                              *tok.encode("hello there", add_special_tokens=False)])
    ids = data.draw(st.lists(pieces, max_size=20))

    def decode(i):
        return tok.decode(i, skip_special_tokens=skip)

    deltas = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, decode)
    assert "".join(deltas) == decode(ids)


def test_incremental_detokenizer_keeps_the_space_after_a_prompt(spm_tokenizer):
    # The decoder strips a text's leading space; a generated token is mid-text, so with the
    # prompt as context its space stays (as in decode(prompt + generated)).
    tok = spm_tokenizer
    prompt, generated = tok.encode("hello there"), tok.encode("world again",
                                                              add_special_tokens=False)
    with_prompt = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(with_prompt.add(i) for i in generated) + with_prompt.finish() \
        == " world again"
    alone = IncrementalDetokenizer(tok)
    assert "".join(alone.add(i) for i in generated) + alone.finish() == "world again"

