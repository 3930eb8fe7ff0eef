"""Logprobs in OpenAI's two shapes: chat's `content` list (token, logprob, bytes, top_logprobs)
and completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset), the latter
with the echoed prompt's tokens first; and vLLM's `prompt_logprobs`."""

from __future__ import annotations


def _token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


# A token the grammar masked has logprob -inf, which JSON cannot carry: clamped, as vLLM does.
MIN_LOGPROB = -9999.0


def wire_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def chat_logprobs(tokenizer, ids: list[int], logprobs) -> dict:
    content = []
    for tid, lp in zip(ids, logprobs):
        tok = _token_str(tokenizer, tid)
        tops = []
        for i, v in lp.top:
            t = _token_str(tokenizer, i)
            tops.append({"token": t, "logprob": wire_logprob(v), "bytes": list(t.encode("utf-8"))})
        content.append({"token": tok, "logprob": wire_logprob(lp.logprob),
                        "bytes": list(tok.encode("utf-8")),
                        "top_logprobs": tops})
    return {"content": content}


def completion_logprobs(tokenizer, ids: list[int], logprobs, text_offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in zip(ids, logprobs):
        tok = _token_str(tokenizer, tid)
        tokens.append(tok)
        token_lps.append(wire_logprob(lp.logprob))
        tops.append({_token_str(tokenizer, i): wire_logprob(v) for i, v in lp.top})
        offsets.append(text_offset)
        text_offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(tokenizer, prompt_logprobs, prompt_ids: list[int], k: int) -> dict:
    """Completions' `echo` with `logprobs`: the prompt's tokens in OpenAI's parallel lists, the
    first token's logprob and top logprobs null (nothing comes before it), offsets from 0 into
    the echoed text, which leaves special tokens out (they take no characters there).
    prompt_logprobs: the engine's RequestOutput.prompt_logprobs (the first None)."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    special = frozenset(tokenizer.all_special_ids)
    for tid, lp in zip(prompt_ids, prompt_logprobs):
        tok = _token_str(tokenizer, tid)
        tokens.append(tok)
        token_lps.append(None if lp is None else wire_logprob(lp.logprob))
        tops.append(None if lp is None else
                    {_token_str(tokenizer, i): wire_logprob(v) for i, v in lp.top[:k]})
        offsets.append(offset)
        offset += 0 if tid in special else len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def join_completion_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(tokenizer, prompt_logprobs, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first null) a dict token id -> {logprob,
    rank, decoded_token} holding the prompt token itself and the k most likely ones."""
    out = []
    for lp in prompt_logprobs:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": wire_logprob(lp.logprob), "rank": lp.rank,
                                    "decoded_token": _token_str(tokenizer, lp.token_id)}}
        for rank, (i, v) in enumerate(lp.top[:k], start=1):
            entry.setdefault(str(i), {"logprob": wire_logprob(v), "rank": rank,
                                      "decoded_token": _token_str(tokenizer, i)})
        out.append(entry)
    return out
