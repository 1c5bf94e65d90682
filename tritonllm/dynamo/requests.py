"""Dynamo's requests in, the engine model's tensors out, and the engine's deltas back as Dynamo's chunks.

Dynamo's frontend tokenizes and applies the chat template, and hands a worker a PreprocessedRequest: the prompt's
token ids and the OpenAI request's controls in three groups (`sampling_options`, `stop_conditions`,
`output_options`). Here each control is taken by the OpenAI layer's own request rules (`CompletionRequest`: its
bounds, its guided-decoding checks, its mapping to tensorrt_llm_bls's tensors), so a Dynamo request is checked as
an OpenAI one to this server is; what Dynamo does itself (stop strings and its hidden stop tokens, detokenizing) is
left to it, and a control this server cannot honour is refused by its Dynamo name, never dropped.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pydantic

from tritonllm.errors import ErrorKind
from tritonllm.openai.models import USAGE_PERF_OUTPUT, APIError, CompletionRequest
from tritonllm.protocol import FINISH_EOS, request_tensors
from tritonllm.text.pipeline import Delta

# Dynamo's name of each control the OpenAI layer's request takes, by group, as (Dynamo's name, the request's field).
CONTROLS: dict[str, dict[str, str]] = {
    "sampling_options": {
        "temperature": "temperature",
        "top_p": "top_p",
        "top_k": "top_k",
        "seed": "seed",
        "presence_penalty": "presence_penalty",
        "frequency_penalty": "frequency_penalty",
        "repetition_penalty": "repetition_penalty",
    },
    "stop_conditions": {"max_tokens": "max_tokens", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos"},
    "output_options": {"logprobs": "logprobs"},
}
# What Dynamo's frontend and its Rust backend honour themselves: stop strings and hidden stop tokens (it ends the
# request when one appears, cancelling it here), and everything about the text.
DYNAMO_HONOURS: dict[str, frozenset[str]] = {
    "sampling_options": frozenset({"include_stop_str_in_output"}),
    "stop_conditions": frozenset({"stop", "stop_token_ids_hidden"}),
    "output_options": frozenset({"skip_special_tokens", "formatted_prompt", "return_tokens_as_token_ids"}),
}
# Controls this server does not offer, taken only at the values that ask for nothing.
NEUTRAL: dict[str, dict[str, tuple]] = {
    "sampling_options": {
        "n": (None, 1),
        "best_of": (None, 1),
        "use_beam_search": (None, False),
        "length_penalty": (None, 1.0),
        "min_p": (None, 0.0),
        "guided_decoding": (None,),  # taken by GUIDES below
    },
    "stop_conditions": {"max_thinking_tokens": (None,)},
    "output_options": {"prompt_logprobs": (None,)},
}
# Dynamo's guided_decoding keys, as the OpenAI layer's (vLLM's) guided_* fields; `backend` may name this server's.
GUIDES = {"json": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar"}
GUIDE_BACKENDS = (None, "", "xgrammar")
# The engine's finish reasons as Dynamo's: its end id is OpenAI's "stop".
FINISH_REASONS = {FINISH_EOS: "stop"}


def invalid(name: str, message: str) -> APIError:
    return APIError(ErrorKind.INVALID_INPUT, f"'{name}': {message}", param=name)


def _guides(guided: Any) -> dict[str, Any]:
    if not isinstance(guided, dict):
        raise invalid("sampling_options.guided_decoding", "must be an object")
    fields = {}
    for key, value in guided.items():
        name = f"sampling_options.guided_decoding.{key}"
        if key in GUIDES:
            if value is not None:
                fields[GUIDES[key]] = value
        elif key == "backend":
            if value not in GUIDE_BACKENDS:
                raise invalid(name, f"this server's guided decoding is xgrammar's, not {value!r}")
        elif value not in (None, [], {}):
            raise invalid(name, "is not supported by this server (guided decoding takes json, regex or grammar)")
    return fields


def completion_request(
    request: dict[str, Any], room: int, vocab_size: int, engine_additions: bool = True
) -> CompletionRequest:
    """The OpenAI layer's request for Dynamo's, its controls checked by that request's rules (`engine_additions` as
    the OpenAI layer's settings say). `room`: the tokens the prompt leaves (max_tokens, when Dynamo sends none)."""
    fields: dict[str, Any] = {"model": str(request.get("model") or ""), "prompt": "", "max_tokens": room}
    names: dict[str, str] = {}  # the request's field -> Dynamo's name, for its errors
    for group, controls in CONTROLS.items():
        given = request.get(group) or {}
        if not isinstance(given, dict):
            raise invalid(group, "must be an object")
        for key, value in given.items():
            name = f"{group}.{key}"
            if key in controls:
                if value is not None:
                    fields[controls[key]] = value
                    names[controls[key]] = name
            elif key == "guided_decoding" and value is not None:
                guides = _guides(value)
                fields.update(guides)
                names.update({field: f"{name}.{key}" for key, field in GUIDES.items() if field in guides})
            elif key in DYNAMO_HONOURS[group]:
                continue
            elif value not in NEUTRAL[group].get(key, (None,)):
                raise invalid(name, f"is not supported by this server, got {value!r}")
    try:
        body = CompletionRequest(**fields)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else ""
        raise invalid(names.get(field, field), error["msg"]) from None
    try:
        body.check_supported(vocab_size, engine_additions)
    except APIError as exc:
        raise invalid(names.get(exc.param or "", exc.param or ""), str(exc).partition(": ")[2] or str(exc)) from None
    return body


def engine_arrays(body: CompletionRequest, vocab_size: int, engine_additions: bool = True) -> dict[str, np.ndarray]:
    """tensorrt_llm_bls's inputs for the request, as the OpenAI layer makes them for a choice, without the text: the
    prompt comes in tokens."""
    inputs = body.inputs(0, vocab_size, engine_additions)
    tensors = request_tensors("", body.max_tokens, **inputs)
    return {name: value for name, value, _ in tensors if name not in ("text_input", "apply_chat_template")}


def chunk(delta: Delta, token_text) -> dict[str, Any]:
    """A delta as Dynamo's chunk: its tokens, and their log probabilities when the request asked."""
    out: dict[str, Any] = {"token_ids": delta.ids, "index": 0}
    if delta.log_probs:
        out["log_probs"] = delta.log_probs
    if delta.top_ids:
        out["top_logprobs"] = [
            [
                {"rank": rank, "token_id": int(token), "token": token_text(int(token)), "logprob": float(p)}
                for rank, (token, p) in enumerate(zip(ids, probs, strict=True), start=1)
            ]
            for ids, probs in zip(delta.top_ids, delta.top_log_probs, strict=True)
        ]
    return out


def final_chunk(final: dict[str, np.ndarray], block_tokens: int) -> dict[str, Any]:
    """The pipeline's final tensors as Dynamo's last chunk: no new tokens, its finish reason and usage
    (`block_tokens`: the unit of the engine's reused KV-cache blocks)."""
    reason = final["finish_reason"].reshape(-1)[0].decode()
    prompt = int(final["num_input_tokens"].reshape(-1)[0])
    completion = int(final["num_output_tokens"].reshape(-1)[0])
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    usage["total_tokens"] = prompt + completion
    if USAGE_PERF_OUTPUT in final:
        cached = int(final[USAGE_PERF_OUTPUT].reshape(-1)[0]) * block_tokens
        usage["prompt_tokens_details"] = {"cached_tokens": min(cached, prompt)}
    return {"token_ids": [], "index": 0, "finish_reason": FINISH_REASONS.get(reason, reason), "completion_usage": usage}
