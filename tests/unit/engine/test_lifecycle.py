"""One request's lifecycle (tritonllm/engine/lifecycle.py), which every engine drives with the tokens it makes."""

import pytest

from tritonllm.engine.api import Emission, GenerationRequest, TokenLogProbs
from tritonllm.engine.lifecycle import Lifecycle
from tritonllm.protocol import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, FINISH_STOP


def life(**fields) -> tuple[Lifecycle, list[Emission]]:
    emitted: list[Emission] = []
    request = GenerationRequest(input_ids=[1, 2], **{"max_new_tokens": 4, "end_id": 0, **fields})
    return Lifecycle(request=request, emit=emitted.append, submitted=0.0), emitted


@pytest.mark.parametrize(
    ("tokens", "fields", "reason", "kept"),
    [
        ([5, 6, 0], {}, FINISH_EOS, [5, 6]),  # the end id ends it and is not a token of the answer
        ([5, 6, 7, 8], {}, FINISH_LENGTH, [5, 6, 7, 8]),
        ([5, 6, 7], {"stop_words": ((6, 7),)}, FINISH_STOP, [5, 6, 7]),  # the stop word stays: the text layer cuts
    ],
)
def test_a_token_ends_the_request_with_its_reason(tokens, fields, reason, kept):
    sequence, _ = life(**fields)
    reasons = [sequence.take(token, now=float(i + 1)) for i, token in enumerate(tokens)]
    assert reasons == [None] * (len(tokens) - 1) + [reason] and sequence.tokens == kept


def test_a_stream_gets_each_new_token_and_the_final_emission_the_rest_with_its_timings():
    sequence, emitted = life(streaming=True)
    for now, token in [(1.0, 5), (2.0, 6)]:
        sequence.take(token, now=now)
        sequence.emit_new()
    sequence.take(7, now=4.0)  # not emitted yet: the final emission carries it
    assert sequence.finish(FINISH_CANCELLED) and not sequence.finish(FINISH_CANCELLED)
    assert [e.token_ids for e in emitted] == [[5], [6], [7]]
    final = emitted[-1]
    assert final.finish_reason == FINISH_CANCELLED and final.time_to_first_token == 1.0
    assert final.time_per_output_token == pytest.approx(1.5)  # (4 - 1) / (3 - 1)
    sequence.take(8)
    sequence.emit_new()
    assert len(emitted) == 3, "nothing after the final emission"


def test_a_whole_answer_is_one_emission_with_its_log_probs_and_the_end_id_counts_as_a_step():
    sequence, emitted = life(log_probs=0)
    for now, token in [(1.0, 5), (2.0, 6), (3.0, 0)]:
        reason = sequence.take(token, log_probs=TokenLogProbs(-0.5 * now), now=now)
        sequence.emit_new()
    sequence.finish(reason)
    [final] = emitted
    assert final.token_ids == [5, 6] and final.log_probs == [TokenLogProbs(-0.5), TokenLogProbs(-1.0)]
    assert final.finish_reason == FINISH_EOS and final.time_per_output_token == pytest.approx(1.0)
