"""Waiting in tests for what another thread or process does."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(condition: Callable[[], object], timeout: float = 10.0) -> bool:
    """Whether `condition()` holds within `timeout` seconds, asked every 20 ms."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
