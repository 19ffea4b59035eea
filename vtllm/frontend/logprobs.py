"""Token logprobs in the two OpenAI shapes (chat ``content`` list, completions arrays)."""

from __future__ import annotations

from typing import Any

from vtllm.frontend.generation import TokenLogprob
from vtllm.frontend.tokenizer import ModelTokenizer


def _token_text(tokenizer: ModelTokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: ModelTokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    """``{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}``."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for entry in entries:
        item = one(entry.token_id, entry.logprob)
        item["top_logprobs"] = [one(t, lp) for t, lp in entry.top]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    tokenizer: ModelTokenizer, entries: list[TokenLogprob], text_offset: int
) -> dict[str, Any]:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; offsets count from
    ``text_offset`` (the length of the text before these tokens)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        text = _token_text(tokenizer, entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        tops.append({_token_text(tokenizer, t): lp for t, lp in entry.top} or None)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
