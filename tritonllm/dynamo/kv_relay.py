"""The engine's KV-cache events, from its ZeroMQ socket to Dynamo's event plane.

The llama.cpp engine publishes its prefix cache's blocks as they are kept and dropped (tritonllm/engine/kv_events.py)
on the endpoint its server was started with; this thread subscribes there and hands each event to the
`KvEventPublisher` Dynamo's worker made for this worker, whose KV router then knows which prompts this server has
cached.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

log = logging.getLogger(__name__)


class KvRelay:
    def __init__(self, endpoint: str, block_tokens: int) -> None:
        self.endpoint, self.block_tokens = endpoint, block_tokens
        self.relayed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, publisher: Any) -> None:
        """Dynamo's PushSource hook: `publisher` is the worker's dynamo.llm.KvEventPublisher."""
        self._thread = threading.Thread(target=self._run, args=(publisher,), name="kv-relay", daemon=True)
        self._thread.start()

    def _run(self, publisher: Any) -> None:
        socket = zmq.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if not socket.poll(100):
                    continue
                try:
                    self.relay(socket.recv_json(), publisher)
                except Exception:  # one bad event must not end the relay: the router would go blind
                    log.exception("a KV event could not be relayed")
        finally:
            socket.close()

    def relay(self, event: dict, publisher: Any) -> None:
        if event["type"] == "stored":
            if event["block_tokens"] != self.block_tokens:
                raise ValueError(f"the engine's blocks are {event['block_tokens']} tokens, not {self.block_tokens}")
            hashes = event["block_hashes"]
            publisher.publish_stored(
                token_ids=event["token_ids"],
                num_block_tokens=[self.block_tokens] * len(hashes),
                block_hashes=hashes,
                parent_hash=event["parent_hash"],
                lora_name=event.get("lora_name"),  # Dynamo hashes an adapter's blocks apart from the base model's
            )
        elif event["type"] == "removed":
            publisher.publish_removed(block_hashes=event["block_hashes"])
        else:
            raise ValueError(f"unknown KV event type {event['type']!r}")
        self.relayed += 1
        log.info("relayed KV event %d: %s of %d blocks", self.relayed, event["type"], len(event["block_hashes"]))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
