"""Errors a client can cause. They become INVALID_ARG (HTTP 400) responses, never crashes."""

from __future__ import annotations


class InputError(ValueError):
    """A request input is missing or out of range; the message names the input and the limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
