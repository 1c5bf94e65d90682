"""The relay hands the engine's events to Dynamo's publisher in its own terms, and refuses a block size it did not
register."""

from __future__ import annotations

import pytest

from tritonllm.dynamo.kv_relay import KvRelay


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def publish_stored(self, **fields) -> None:
        self.calls.append(("stored", fields))

    def publish_removed(self, **fields) -> None:
        self.calls.append(("removed", fields))


def test_events_become_publisher_calls():
    relay, publisher = KvRelay("ipc:///unused", 16), Recorder()
    stored = {"type": "stored", "token_ids": list(range(32)), "block_hashes": [1, 2], "parent_hash": 7}
    relay.relay({**stored, "block_tokens": 16, "lora_name": "terse"}, publisher)
    relay.relay({"type": "removed", "block_hashes": [2]}, publisher)
    assert publisher.calls == [
        (
            "stored",
            {
                "token_ids": list(range(32)),
                "num_block_tokens": [16, 16],
                "block_hashes": [1, 2],
                "parent_hash": 7,
                "lora_name": "terse",
            },
        ),
        ("removed", {"block_hashes": [2]}),
    ]
    assert relay.relayed == 2


def test_another_block_size_or_kind_is_refused():
    relay = KvRelay("ipc:///unused", 16)
    with pytest.raises(ValueError, match="8 tokens"):
        relay.relay(
            {"type": "stored", "token_ids": [], "block_hashes": [], "parent_hash": None, "block_tokens": 8}, None
        )
    with pytest.raises(ValueError, match="unknown"):
        relay.relay({"type": "cleared"}, None)
