"""Log probabilities in OpenAI's two formats, from the token ids and log probs tensorrt_llm_bls returns.

Each token's string is its id decoded alone, as vLLM does: a token that is part of a character reads as
U+FFFD, and `bytes` (chat) lets a client join such pieces back.
"""

from __future__ import annotations

import functools
import math

from tritonllm.openai.models import Generation

FLOOR = -9999.0  # OpenAI's value for "very unlikely", in place of -inf (which JSON cannot carry)


def clamp(log_prob: float) -> float:
    return max(log_prob, FLOOR) if not math.isnan(log_prob) else FLOOR


class TokenTexts:
    """Token id -> its text, decoded alone; cached, since top log probs decode the same ids again and again."""

    def __init__(self, tokenizer) -> None:
        self.text = functools.lru_cache(maxsize=1 << 16)(lambda token: tokenizer.decode([token]))

    def __call__(self, token: int) -> str:
        return self.text(token)

    def chat(self, generation: Generation) -> dict:
        """choice.logprobs of a chat completion: {"content": [{token, logprob, bytes, top_logprobs}]}."""

        def entry(token: int, log_prob: float) -> dict:
            text = self(token)
            return {"token": text, "logprob": clamp(log_prob), "bytes": list(text.encode())}

        content = []
        for i, (token, log_prob) in enumerate(zip(generation.tokens, generation.log_probs, strict=True)):
            top = generation.top[i] if i < len(generation.top) else []
            content.append({**entry(token, log_prob), "top_logprobs": [entry(t, p) for t, p in top]})
        return {"content": content, "refusal": None}

    def completion(self, generation: Generation, offset: int) -> tuple[dict, int]:
        """choice.logprobs of a completion: {tokens, token_logprobs, top_logprobs, text_offset}, the offsets
        counting from `offset` (the characters before the first token: the echoed prompt, earlier chunks),
        and the offset after the last token. Each top_logprobs entry also holds the chosen token, as
        OpenAI's (up to logprobs + 1 entries)."""
        tokens, offsets, tops = [], [], []
        for i, token in enumerate(generation.tokens):
            text = self(token)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            top = {self(t): clamp(p) for t, p in (generation.top[i] if i < len(generation.top) else [])}
            top.setdefault(text, clamp(generation.log_probs[i]))
            tops.append(top)
        logprobs = {
            "tokens": tokens,
            "token_logprobs": [clamp(p) for p in generation.log_probs],
            "top_logprobs": tops,
            "text_offset": offsets,
        }
        return logprobs, offset
