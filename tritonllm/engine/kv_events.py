"""The llama.cpp engine's prefix cache as KV-cache events, for a router that sends a prompt where its prefix is cached.

The engine keeps a finished request's cells (tritonllm/engine/llamacpp.py); a later prompt that begins with the
same tokens reuses them. A router (NVIDIA Dynamo's KV router) sees that cache as blocks of `block_tokens` tokens,
each named by a hash chained over the blocks before it, as vLLM's and TensorRT-LLM's caches report theirs: a block is
stored when the first kept sequence holding it is kept and removed when the last one goes, so a block that several
kept sequences share is announced once. Events leave on a ZeroMQ PUB socket as JSON (`stored`, `removed`), which the
Dynamo worker relays to Dynamo's event plane (tritonllm/dynamo/kv_relay.py); a PUB socket never blocks the step
thread: with no subscriber, or one too slow, events are dropped, and the router only routes less well.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)

Event = dict  # {"type": "stored", "token_ids", "block_hashes", "parent_hash", "block_tokens", "lora_name"} or
# {"type": "removed", "block_hashes"}


def block_hashes(tokens: np.ndarray, block_tokens: int, adapter: str = "") -> list[int]:
    """The chained hash of each full block of `tokens` (signed 64-bit, as Dynamo's events carry them). The chain
    starts from the LoRA adapter's name: the same tokens computed with another adapter are other cells."""
    hashes, parent = [], adapter.encode()
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        digest = hashlib.blake2b(parent + tokens[start : start + block_tokens].astype("<i4").tobytes(), digest_size=8)
        parent = digest.digest()
        hashes.append(int.from_bytes(parent, "little", signed=True))
    return hashes


class PrefixBlocks:
    """The kept sequences' full blocks, each counted by the kept sequences that hold it; `publish` gets the events."""

    def __init__(self, block_tokens: int, publish: Callable[[Event], None]) -> None:
        self.block_tokens = block_tokens
        self._publish = publish
        self._holders: Counter[int] = Counter()

    def kept(self, tokens: np.ndarray, adapter: str = "") -> None:
        """A sequence's cells (computed with `adapter`, "" the base model) were kept: its blocks that no kept sequence
        held are stored."""
        hashes = block_hashes(tokens, self.block_tokens, adapter)
        # A block's parent is held at least as often as it: the blocks new here are a suffix of the chain.
        first = next((i for i, h in enumerate(hashes) if not self._holders[h]), len(hashes))
        self._holders.update(hashes)
        if first < len(hashes):
            size = self.block_tokens
            self._publish(
                {
                    "type": "stored",
                    "token_ids": tokens[first * size : len(hashes) * size].tolist(),
                    "block_hashes": hashes[first:],
                    "parent_hash": hashes[first - 1] if first else None,
                    "block_tokens": size,
                    "lora_name": adapter or None,
                }
            )

    def dropped(self, tokens: np.ndarray, adapter: str = "") -> None:
        """A kept sequence's cells went (given way, or taken over by a running request): blocks no other holds go."""
        hashes = block_hashes(tokens, self.block_tokens, adapter)
        self._holders.subtract(hashes)
        gone = [h for h in hashes if self._holders[h] <= 0]
        for h in gone:
            del self._holders[h]
        if gone:
            self._publish({"type": "removed", "block_hashes": gone})

    @property
    def blocks(self) -> int:
        return len(self._holders)


class ZmqPublisher:
    """Events as JSON on a ZeroMQ PUB socket bound to `endpoint` (tcp://host:port or ipc://path)."""

    def __init__(self, endpoint: str) -> None:
        import zmq  # pyzmq: nvidia-pytriton's own dependency, so every install has it

        self._zmq = zmq
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self.endpoint = endpoint

    def __call__(self, event: Event) -> None:
        try:
            self._socket.send_json(event, flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            log.debug("a KV event was dropped: its subscriber is behind")

    def close(self) -> None:
        self._socket.close()
