"""Unit: the sender thread's merging (tritonllm.backend.outbox) and the engine's emission merge rule."""

from __future__ import annotations

import itertools
import threading

from tests.polling import eventually
from tritonllm.backend.outbox import Outbox, coalesce
from tritonllm.engine.api import Emission, TokenLogProbs


def texts(a, b) -> bool:
    return isinstance(a, str) and isinstance(b, str)


TEXT = (texts, "".join)  # an outbox's joinable, join for text items


def test_coalesce_joins_per_key_and_keeps_order():
    a, b = object(), object()
    items = [(a, "x"), (b, "1"), (a, "y"), (b, 2), (a, "z"), (b, "3"), (b, "4")]
    assert coalesce(items, *TEXT) == [(a, "xyz"), (b, "1"), (b, 2), (b, "34")]


def test_coalesce_joins_a_run_once():
    runs = []
    items = [(None, str(i)) for i in range(50)]
    joined = coalesce(items, texts, lambda run: runs.append(len(run)) or "".join(run))
    assert joined == [(None, "".join(i for _, i in items))]
    assert runs == [50]


def test_coalesce_keeps_equal_keys_apart_when_they_are_different_objects():
    a, b = [], []  # equal, but two requests
    assert coalesce([(a, "x"), (b, "y")], *TEXT) == [(a, "x"), (b, "y")]


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
    box = Outbox("test-sender", send, *TEXT, tick=lambda: None, period=0.05, report=print)
    try:
        box.put(key, "a")
        eventually(lambda: sent, 5)
        for item in "bcd":
            box.put(key, item)
        release.set()
        eventually(lambda: len(sent) >= 2, 5)
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
        tick=lambda: ticks.append(1),
        period=0.02,
        report=reports.append,
    )
    try:
        box.put("k1", "bad")
        box.put("k2", "good")
        eventually(lambda: sent and len(ticks) >= 2, 5)
    finally:
        box.close()
    assert sent == ["good"]
    assert reports == ["sending a response failed"]
    assert len(ticks) >= 2


def test_close_sends_what_is_queued():
    sent = []
    box = Outbox(
        "test-sender", lambda key, item: sent.append(item), *TEXT, tick=lambda: None, period=0.05, report=print
    )
    for item in "abc":
        box.put(object(), item)
    box.close()
    assert sorted(sent) == ["a", "b", "c"]
