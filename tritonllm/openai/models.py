"""The OpenAI API's request bodies, its error format, and what one generated choice carries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from tritonllm.errors import ErrorKind
from tritonllm.protocol import MAX_WORD_BYTES, MAX_WORDS, STREAMING_MODEL

FINISH_REASONS = {"length": "length", "stop": "stop", "eos": "stop"}
MAX_STOPS = min(4, MAX_WORDS)  # OpenAI's limit, within what the models take

# OpenAI's error `type` where it is not "invalid_request_error".
OPENAI_TYPES = {
    ErrorKind.BUSY: "rate_limit_exceeded",
    ErrorKind.UNAVAILABLE: "server_error",
    ErrorKind.INTERNAL: "server_error",
}


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


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted at their neutral values only: the engine cannot honour them, and silently ignoring them would mislead.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
    tools: list | None = None
    response_format: dict | None = None

    def check_supported(self) -> None:
        """Refuse, before any request is sent, what this server cannot honour or the models would refuse."""
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            if getattr(self, name) != neutral:
                raise APIError(ErrorKind.INVALID_INPUT, f"'{name}' is not supported by this server", param=name)
        for name in ("logprobs", "tools"):
            if getattr(self, name):
                raise APIError(ErrorKind.INVALID_INPUT, f"'{name}' is not supported by this server", param=name)
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(
                ErrorKind.INVALID_INPUT, "only response_format {'type': 'text'} is supported", param="response_format"
            )
        self.stops()

    def stops(self) -> list[str]:
        """The stop sequences, checked here: the models would refuse them too, but only once a request runs."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise APIError(ErrorKind.INVALID_INPUT, f"'stop' takes at most {MAX_STOPS} sequences", param="stop")
        for stop in stops:
            if len(stop.encode()) > MAX_WORD_BYTES:
                raise APIError(
                    ErrorKind.INVALID_INPUT,
                    f"'stop': a sequence is {len(stop.encode())} bytes, over the limit of {MAX_WORD_BYTES}",
                    param="stop",
                )
        return stops


class CompletionRequest(SamplingRequest):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(
                    ErrorKind.INVALID_INPUT,
                    f"only text content is supported, got a '{part.get('type')}' part",
                    param="messages",
                )
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


@dataclass(frozen=True)
class Settings:
    grpc_url: str
    tokenizer_dir: str
    model_name: str
    max_input_len: int
    max_seq_len: int
    api_key: str | None = None
    triton_model: str = STREAMING_MODEL


@dataclass
class Generation:
    """One choice: its text (whole, or streamed as deltas) and, at the end, why and how long."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
