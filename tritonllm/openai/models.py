"""The OpenAI API's sampling and completion request bodies, its error format, and what one generated choice carries.

Parameter policy, as OpenAI's own API: a parameter this layer does not know is a 400 naming it (every body
forbids extra fields), so nothing a client sends is silently ignored. Accepted are OpenAI's parameters, the
vLLM extras this engine honours (`top_k`, `min_tokens`, `repetition_penalty`, `ignore_eos`, `bad_words`,
`guided_json`, `guided_regex`, `guided_grammar`), and NO_OPS: parameters that by nature change nothing
here (bookkeeping for OpenAI's platform). OpenAI parameters for features this server lacks are accepted
only at their neutral values (UNSUPPORTED). The chat request's body is chat_models.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastapi.responses import JSONResponse
from jsonschema import SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tritonllm.errors import ErrorKind
from tritonllm.protocol import (
    MAX_BIASED_TOKENS,
    MAX_RETURN_SEQUENCES,
    MAX_WORD_BYTES,
    MAX_WORDS,
)

FINISH_REASONS = {"length": "length", "stop": "stop", "eos": "stop"}
MAX_STOPS = min(4, MAX_WORDS)  # OpenAI's limit, within what the models take
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions' `logprobs`
MAX_LOGIT_BIAS = min(300, MAX_BIASED_TOKENS)  # OpenAI's limit of biased tokens, within what the models take
PENALTY_RANGE = 2.0  # presence_penalty and frequency_penalty: OpenAI's -2..2
# A JSON schema's nesting (objects and arrays): deeper ones would exhaust the stack of the schema checker and of the
# grammar compiler; real schemas stay far below.
MAX_SCHEMA_DEPTH = 64
INT32_MAX = 2**31 - 1  # the integer controls travel as INT32 tensors
FLOAT32_MAX = 3.4028234663852886e38  # and the others as FP32: a larger number would arrive as infinity

# Accepted and changing nothing by nature: identifiers and storage options of OpenAI's platform.
NO_OPS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
)
# OpenAI parameters of features this server lacks: accepted at these neutral values only, else a 400 naming them.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "moderation": (None,),
    "prompt_cache_options": (None,),
    "suffix": (None, ""),
}

# OpenAI's error `type` where it is not "invalid_request_error".
OPENAI_TYPES = {
    ErrorKind.BUSY: "rate_limit_exceeded",
    ErrorKind.UNAVAILABLE: "server_error",
    ErrorKind.INTERNAL: "server_error",
}

# The perf metric usage reads (cached tokens), the only one the direct path asks the engine for: each is one more
# tensor in every streamed response.
USAGE_PERF_OUTPUT = "kv_cache_reused_blocks"


class APIError(Exception):
    """An error in OpenAI's format, {"error": {"message", "type", "param", "code"}}, with its kind's status."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind, self.param, self.code = kind, param, code
        self.status = kind.http_status
        self.type = OPENAI_TYPES.get(kind, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(param: str, message: str) -> APIError:
    """A client's mistake in one parameter: 400, naming it."""
    return APIError(ErrorKind.INVALID_INPUT, f"'{param}': {message}", param=param)


def depth(value: Any) -> int:
    """How deeply JSON objects and arrays nest in `value` (0 for a scalar), without recursing."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            pending.extend((child, level + 1) for child in children)
    return deepest


def check_schema(schema: Any, param: str) -> None:
    """Refuse a schema that is not a JSON schema here, naming the parameter, rather than in the engine's grammar."""
    if not isinstance(schema, dict):
        raise invalid(param, "the schema must be a JSON object")
    if depth(schema) > MAX_SCHEMA_DEPTH:
        raise invalid(param, f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise invalid(param, f"not a valid JSON schema: {exc.message}") from None


def refuse_surrogates(value: Any) -> Any:
    """`value` as it came, unless a string in it holds a lone UTF-16 surrogate (JSON's "\\ud800" parses, but is no
    text any tokenizer or response can encode): a ValueError, which names the field."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode()
                except UnicodeEncodeError:
                    raise ValueError("a string holds a lone surrogate (an unpaired \\ud800-\\udfff escape)") from None
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return value


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    _no_surrogates = field_validator("*", mode="before")(refuse_surrogates)


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # no-op: this server sends no obfuscation padding


class SamplingRequest(Body):
    """What both endpoints take; `inputs` turns it into tensorrt_llm_bls's inputs."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_RETURN_SEQUENCES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-PENALTY_RANGE, le=PENALTY_RANGE)
    frequency_penalty: float | None = Field(default=None, ge=-PENALTY_RANGE, le=PENALTY_RANGE)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in -100..100

    # vLLM's extra parameters.
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # -1 or 0: off
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    repetition_penalty: float | None = Field(default=None, gt=0, le=FLOAT32_MAX)
    ignore_eos: bool = False
    bad_words: list[str] | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None

    # NO_OPS
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    def check_supported(self, vocab_size: int, engine_additions: bool = True) -> None:
        """Refuse, before any request is sent, what this server cannot honour or the models would refuse."""
        if self.stream_options is not None and not self.stream:  # OpenAI's rule and wording
            raise APIError(
                ErrorKind.INVALID_INPUT,
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                param="stream_options",
            )
        for name, neutral in UNSUPPORTED.items():
            if name in type(self).model_fields and getattr(self, name) not in neutral:
                raise invalid(name, "is not supported by this server")
        if not engine_additions and self.log_probs():
            raise invalid(
                self.TOP_LOG_PROBS, "must be 0 here: the TensorRT-LLM engine returns only the chosen tokens' log probs"
            )
        self.biases(vocab_size)
        self.stops()
        self.words()
        self.guide()

    TOP_LOG_PROBS: ClassVar[str] = ""  # the parameter that asks for the most likely tokens' log probabilities

    def log_probs(self) -> int | None:
        """None: no log probabilities; k >= 0: the chosen token's and the k most likely tokens'."""
        return None

    def stops(self) -> list[str]:
        """The stop sequences, checked here: the models would refuse them too, but only once a request runs."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise invalid("stop", f"takes at most {MAX_STOPS} sequences")
        check_words(stops, "stop")
        return stops

    def words(self) -> list[str]:
        words = list(self.bad_words or [])
        if len(words) > MAX_WORDS:
            raise invalid("bad_words", f"takes at most {MAX_WORDS} words")
        check_words(words, "bad_words")
        return words

    def biases(self, vocab_size: int) -> dict[int, float]:
        """logit_bias by token id, each id in the vocabulary and each bias in OpenAI's -100..100."""
        biases = {}
        if len(self.logit_bias or {}) > MAX_LOGIT_BIAS:
            raise invalid("logit_bias", f"takes at most {MAX_LOGIT_BIAS} tokens")
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise invalid("logit_bias", f"keys are token ids, got {key!r}") from None
            if not 0 <= token < vocab_size:
                raise invalid("logit_bias", f"token id {token} is not in the vocabulary (0 to {vocab_size - 1})")
            if not -100 <= bias <= 100:
                raise invalid("logit_bias", f"the bias of token {token} is {bias}, not in -100..100")
            biases[token] = bias
        return biases

    def guides(self) -> list[tuple[str, tuple[str, str]]]:
        """Every guided-decoding request as (parameter, (guide type, guide)); at most one may be given."""
        guides = []
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except (ValueError, RecursionError):  # RecursionError: nested too deeply for the parser
                    raise invalid("guided_json", "is not JSON, or nests too deeply") from None
            check_schema(schema, "guided_json")
            guides.append(("guided_json", ("json_schema", json.dumps(schema))))
        if self.guided_regex is not None:
            guides.append(("guided_regex", ("regex", self.guided_regex)))
        if self.guided_grammar is not None:
            guides.append(("guided_grammar", ("ebnf_grammar", self.guided_grammar)))
        return guides

    def guide(self) -> tuple[str, str] | None:
        """The one guided-decoding request, as (guided_decoding_guide_type, guided_decoding_guide)."""
        guides = self.guides()
        if len(guides) > 1:
            raise invalid(guides[1][0], f"cannot be combined with '{guides[0][0]}'")
        return guides[0][1] if guides else None

    def sampled_top_p(self) -> float | None:
        """`top_p`, or 1.0 (the whole distribution) when a temperature above 0 comes alone: OpenAI samples then,
        and NVIDIA's interface below, as TensorRT-LLM, decodes a temperature without top_k or top_p greedily."""
        if self.top_p is None and self.temperature and not (self.top_k and self.top_k > 0):
            return 1.0
        return self.top_p

    def inputs(self, choice: int, vocab_size: int, engine_additions: bool = True) -> dict[str, Any]:
        """request_tensors' keyword arguments for choice `choice` (its seed is seed + choice). engine_additions:
        the engine takes the portable engine's additions, openai_penalties among them (OpenAI's penalty rule)."""
        log_probs = self.log_probs()
        guide = self.guide()
        penalised = bool(self.presence_penalty or self.frequency_penalty)
        return {
            "stop": self.stops(),
            "bad_words": self.words(),
            "logit_bias": self.biases(vocab_size),
            "chat": False,
            "temperature": self.temperature,
            "top_p": self.sampled_top_p(),
            "top_k": self.top_k if self.top_k and self.top_k > 0 else None,
            "seed": None if self.seed is None else (self.seed + choice) % 2**64,
            "presence_penalty": self.presence_penalty or None,
            "frequency_penalty": self.frequency_penalty or None,
            "openai_penalties": True if penalised and engine_additions else None,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,  # stated: NVIDIA's interface defaults to 1 (no end id first)
            "end_id": -1 if self.ignore_eos else None,
            "return_log_probs": True if log_probs is not None else None,
            "num_top_log_probs": log_probs or None,
            "guided_decoding_guide_type": guide[0] if guide else None,
            "guided_decoding_guide": guide[1] if guide and guide[1] else None,
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
            "return_perf_metrics": True,  # USAGE_PERF_OUTPUT: usage.prompt_tokens_details.cached_tokens
            "stream": True,
        }


def check_words(words: list[str], param: str) -> None:
    for word in words:
        if len(word.encode()) > MAX_WORD_BYTES:
            raise invalid(param, f"a sequence is {len(word.encode())} bytes, over the limit of {MAX_WORD_BYTES}")


class CompletionRequest(SamplingRequest):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    def check_supported(self, vocab_size: int, engine_additions: bool = True) -> None:
        super().check_supported(vocab_size, engine_additions)
        if self.best_of not in (None, self.n):
            raise invalid("best_of", "is supported only equal to n (every generated choice is returned)")
        if self.echo and self.logprobs is not None:
            # The prompt's log probabilities would need a forward pass over it that the engines do not return.
            raise invalid("echo", "cannot be combined with 'logprobs': prompt log probabilities are not computed")

    TOP_LOG_PROBS: ClassVar[str] = "logprobs"

    def log_probs(self) -> int | None:
        return self.logprobs


class UnloadLoraAdapter(Body):
    """vLLM's body for /v1/unload_lora_adapter."""

    lora_name: str = Field(min_length=1, max_length=64)


class LoadLoraAdapter(UnloadLoraAdapter):
    """vLLM's body for /v1/load_lora_adapter: `lora_path` inside the build's --lora-dir."""

    lora_path: str = Field(min_length=1, max_length=4096)


@dataclass
class Generation:
    """One choice: its text (whole, or streamed as deltas), the tokens that came with it and their log
    probabilities when asked for, and, at the end, why and how long."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those whose KV cache an earlier request left (the prefix cache)
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, most likely first

    def extend(self, later: Generation) -> None:
        """Append a later delta of the same choice."""
        self.text += later.text
        self.tokens += later.tokens
        self.log_probs += later.log_probs
        self.top += later.top
        self.finish_reason = later.finish_reason
        self.prompt_tokens, self.completion_tokens = later.prompt_tokens, later.completion_tokens
        self.cached_tokens = later.cached_tokens
