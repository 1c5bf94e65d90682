"""One error hierarchy. Each kind carries its Triton error code and the HTTP status the OpenAI layer answers.

The Python-backend adapters turn a `TritonLLMError` into a Triton error with the kind's code, and tag
its message with the kind (`[kind] message`), because an error inside a gRPC stream reaches the
client as text only: `ErrorKind.of_message` reads the tag back, so the OpenAI layer maps kinds, never
message wording. A client mistake is never a 500 on any entry point.
"""

from __future__ import annotations

import enum
import re


class ErrorKind(enum.Enum):
    """(HTTP status, Triton error code name) per kind; the code names are `pb_utils.TritonError`'s."""

    INVALID_INPUT = (400, "INVALID_ARG")
    UNAUTHORIZED = (401, "INVALID_ARG")
    NOT_FOUND = (404, "NOT_FOUND")
    TOO_LARGE = (413, "INVALID_ARG")
    BUSY = (429, "UNAVAILABLE")
    UNAVAILABLE = (503, "UNAVAILABLE")
    INTERNAL = (500, "INTERNAL")

    @property
    def http_status(self) -> int:
        return self.value[0]

    @property
    def triton_code(self) -> str:
        return self.value[1]

    @property
    def tag(self) -> str:
        return f"[{self.name.lower()}]"

    @classmethod
    def of_message(cls, message: str) -> ErrorKind | None:
        """The kind a tagged message carries (anywhere in it: Triton prefixes the failing step's name)."""
        match = _TAG.search(message or "")
        return cls[match.group(1).upper()] if match else None


_TAG = re.compile(r"\[(" + "|".join(k.name.lower() for k in ErrorKind) + r")\]")


class TritonLLMError(Exception):
    """Base of the project's errors; `kind` says who is at fault and how it is answered."""

    kind = ErrorKind.INTERNAL

    def tagged(self) -> str:
        return f"{self.kind.tag} {self}"


def error_of_kind(kind: ErrorKind, message: str) -> TritonLLMError:
    """An error of `kind` made elsewhere, of which only its message and kind came (an engine's, across a process)."""
    error = TritonLLMError(message)
    error.kind = kind
    return error


class InputError(TritonLLMError, ValueError):
    """A request input is missing or out of range; the message names the input and the limit."""

    kind = ErrorKind.INVALID_INPUT

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ServerBusy(TritonLLMError):
    """The engine's queue is full: retry later (Triton UNAVAILABLE, HTTP 429)."""

    kind = ErrorKind.BUSY


class EngineFailure(TritonLLMError, RuntimeError):
    """The engine failed a request, or stopped (Triton INTERNAL, HTTP 500)."""

    kind = ErrorKind.INTERNAL


class ConfigError(TritonLLMError, ValueError):
    """An option, a build or a folder that cannot work; the message says which and what to do."""

    kind = ErrorKind.INVALID_INPUT
