"""Unit: the sender thread's merging and order (tritonllm.backend.outbox) and the engine's emission merge rule."""

from __future__ import annotations

import itertools
import threading
import time

from tritonllm.backend.outbox import Outbox, merge_runs
from tritonllm.engine.api import Emission, TokenLogProbs


def texts(a, b) -> bool:
    return isinstance(a, str) and isinstance(b, str)


TEXT = (texts, "".join)  # an outbox's joinable, join for text items


def ends(item) -> bool:
    """A text item ending in "." is its key's last."""
    return isinstance(item, str) and item.endswith(".")


def test_merge_runs_joins_consecutive_joinable_items_in_order():
    assert merge_runs(["x", "y", 2, "3", "4"], *TEXT) == ["xy", 2, "34"]


def test_merge_runs_joins_a_run_once():
    runs = []
    items = [str(i) for i in range(50)]
    joined = merge_runs(items, texts, lambda run: runs.append(len(run)) or "".join(run))
    assert joined == ["".join(items)]
    assert runs == [50]


def test_emission_join_joins_tokens_up_to_the_final_one():
    run = [Emission([1, 2]), Emission([3]), Emission([4], finish_reason="length", time_to_first_token=0.5)]
    assert all(Emission.joinable(a, b) for a, b in itertools.pairwise(run))
    assert Emission.join(run) == Emission([1, 2, 3, 4], finish_reason="length", time_to_first_token=0.5)
    assert not Emission.joinable(Emission([1], finish_reason="length"), Emission([2]))
    assert not Emission.joinable(Emission([1]), Emission([], finish_reason="error", error="boom"))


def test_emission_join_keeps_log_probs_one_per_token():
    lp = [TokenLogProbs(-1.0), TokenLogProbs(-2.0)]
    joined = Emission.join([Emission([1], log_probs=lp[:1]), Emission([2], log_probs=lp[1:])])
    assert joined.token_ids == [1, 2] and joined.log_probs == lp
    assert Emission.join([Emission([1]), Emission([2])]).log_probs is None


def test_outbox_sends_each_item_alone_when_idle_and_merged_when_busy():
    sent: list[tuple[object, str]] = []
    release = threading.Event()

    def send(key, item):
        sent.append((key, item))
        release.wait(5)  # the first send blocks while more items queue up

    key = object()
    box = Outbox("test-sender", send, *TEXT, ends, tick=lambda: None, period=0.05, report=print)
    try:
        box.put(key, "a")
        deadline = time.monotonic() + 5
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)
        for item in "bcd":
            box.put(key, item)
        release.set()
        while len(sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        box.close()
    assert sent == [(key, "a"), (key, "bcd")]


def test_outbox_survives_a_failing_send_and_ticks():
    sent, reports, ticks = [], [], []

    def send(key, item):
        if item == "bad":
            raise RuntimeError("peer gone")
        sent.append(item)

    box = Outbox(
        "test-sender",
        send,
        lambda a, b: False,
        "".join,
        ends,
        tick=lambda: ticks.append(1),
        period=0.02,
        report=reports.append,
    )
    try:
        box.put("k1", "bad")
        box.put("k2", "good")
        deadline = time.monotonic() + 5
        while (not sent or len(ticks) < 2) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        box.close()
    assert sent == ["good"]
    assert reports == ["sending a response failed"]
    assert len(ticks) >= 2


def test_close_sends_what_is_queued():
    sent = []
    box = Outbox(
        "test-sender", lambda key, item: sent.append(item), *TEXT, ends, tick=lambda: None, period=0.05, report=print
    )
    for item in "abc":
        box.put(object(), item)
    box.close()
    assert sorted(sent) == ["a", "b", "c"]


def test_a_key_whose_end_waits_is_sent_first_and_keys_keep_their_place():
    sent: list[tuple[str, str]] = []
    started, release = threading.Event(), threading.Event()

    def send(key, item):
        sent.append((key, item))
        started.set()
        release.wait(5)  # the first send blocks while the rest queue up

    box = Outbox("test-sender", send, *TEXT, ends, tick=lambda: None, period=0.05, report=print)
    try:
        box.put("busy", "0")
        assert started.wait(5)
        for key, item in [("a", "1"), ("b", "1"), ("c", "1"), ("a", "2"), ("c", "2."), ("b", "2.")]:
            box.put(key, item)
        release.set()
        deadline = time.monotonic() + 5
        while len(sent) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        box.close()
    # c's and b's ends first, in the order they came, each with what its key queued before; then a, the oldest.
    assert sent == [("busy", "0"), ("c", "12."), ("b", "12."), ("a", "12")]
