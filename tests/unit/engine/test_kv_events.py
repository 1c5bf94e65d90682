"""The prefix cache as KV events: blocks stored once, removed with their last holder, hashes chained."""

from __future__ import annotations

import numpy as np

from tritonllm.engine.kv_events import PrefixBlocks, ZmqPublisher, block_hashes


def blocks(events: list[dict]) -> PrefixBlocks:
    return PrefixBlocks(4, events.append)


def test_hashes_are_chained_over_full_blocks_only():
    tokens = np.arange(10, dtype=np.int32)
    hashes = block_hashes(tokens, 4)
    assert len(hashes) == 2  # the last 2 tokens make no full block
    assert hashes == block_hashes(np.arange(8, dtype=np.int32), 4)
    assert all(-(2**63) <= h < 2**63 for h in hashes)
    other = np.array([9, 1, 2, 3, 4, 5, 6, 7], np.int32)  # the same second block after another first one
    assert block_hashes(other, 4)[1] != hashes[1]


def test_a_block_several_kept_sequences_hold_is_stored_once_and_removed_with_the_last():
    events: list[dict] = []
    cache = blocks(events)
    first = np.arange(8, dtype=np.int32)
    second = np.array([0, 1, 2, 3, 9, 9, 9, 9, 7], np.int32)  # shares the first block
    cache.kept(first)
    cache.kept(second)
    h_first, h_second = block_hashes(first, 4), block_hashes(second, 4)
    assert events == [
        {
            "type": "stored",
            "token_ids": list(range(8)),
            "block_hashes": h_first,
            "parent_hash": None,
            "block_tokens": 4,
            "lora_name": None,
        },
        {
            "type": "stored",
            "token_ids": [9, 9, 9, 9],
            "block_hashes": h_second[1:],
            "parent_hash": h_first[0],
            "block_tokens": 4,
            "lora_name": None,
        },
    ]
    events.clear()
    cache.dropped(first)
    assert events == [{"type": "removed", "block_hashes": [h_first[1]]}]  # the shared block stays
    events.clear()
    cache.dropped(second)
    assert events == [{"type": "removed", "block_hashes": h_second}]
    assert cache.blocks == 0


def test_a_sequence_kept_again_after_it_went_is_stored_again():
    events: list[dict] = []
    cache = blocks(events)
    tokens = np.arange(4, dtype=np.int32)
    cache.kept(tokens)
    cache.dropped(tokens)
    cache.kept(tokens)
    assert [e["type"] for e in events] == ["stored", "removed", "stored"]
    cache.kept(np.arange(3, dtype=np.int32))  # no full block: nothing to say
    assert len(events) == 3


def test_events_reach_a_subscriber_as_json(tmp_path):
    import zmq

    endpoint = f"ipc://{tmp_path}/events"
    publisher = ZmqPublisher(endpoint)
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(endpoint)
    try:
        event = {"type": "removed", "block_hashes": [1, -2]}
        for _ in range(50):  # a subscriber that joined misses what came before (ZeroMQ's PUB/SUB)
            publisher(event)
            if subscriber.poll(100):
                assert subscriber.recv_json() == event
                break
        else:
            raise AssertionError("no event arrived")
    finally:
        subscriber.close()
        publisher.close()


def test_an_adapters_blocks_are_other_blocks():
    events: list[dict] = []
    cache = blocks(events)
    tokens = np.arange(8, dtype=np.int32)
    cache.kept(tokens)
    cache.kept(tokens, "terse")
    assert [e["type"] for e in events] == ["stored", "stored"]
    assert events[1]["lora_name"] == "terse"
    assert not set(events[0]["block_hashes"]) & set(events[1]["block_hashes"])
    assert events[1]["block_hashes"] == block_hashes(tokens, 4, "terse")
    events.clear()
    cache.dropped(tokens, "terse")
    assert events == [{"type": "removed", "block_hashes": block_hashes(tokens, 4, "terse")}]
