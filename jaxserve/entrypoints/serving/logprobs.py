"""Logprobs in OpenAI's two shapes: chat's `content` list (token, logprob, bytes, top_logprobs)
and completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset)."""

from __future__ import annotations


def _token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


# A token the grammar masked has logprob -inf, which JSON cannot carry: clamped, as vLLM does.
MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def chat_logprobs(tokenizer, ids: list[int], logprobs) -> dict:
    content = []
    for tid, lp in zip(ids, logprobs):
        tok = _token_str(tokenizer, tid)
        tops = []
        for i, v in lp.top:
            t = _token_str(tokenizer, i)
            tops.append({"token": t, "logprob": _logprob(v), "bytes": list(t.encode("utf-8"))})
        content.append({"token": tok, "logprob": _logprob(lp.logprob),
                        "bytes": list(tok.encode("utf-8")),
                        "top_logprobs": tops})
    return {"content": content}


def completion_logprobs(tokenizer, ids: list[int], logprobs, text_offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in zip(ids, logprobs):
        tok = _token_str(tokenizer, tid)
        tokens.append(tok)
        token_lps.append(_logprob(lp.logprob))
        tops.append({_token_str(tokenizer, i): _logprob(v) for i, v in lp.top})
        offsets.append(text_offset)
        text_offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}
