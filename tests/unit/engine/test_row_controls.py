"""The llama.cpp engine's per-row controls on a hand-made logit row: which token each penalty rule picks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonllm.engine.api import GenerationRequest, Penalties
from tritonllm.engine.penalties import penalise
from tritonllm.engine.row_controls import RowControls

VOCAB = 8


def row() -> np.ndarray:
    """Token 3 leads token 5 by 1.0; the rest trail far behind."""
    logits = np.full(VOCAB, -10.0, dtype=np.float32)
    logits[3], logits[5] = 2.0, 1.0
    return logits


def choose(penalties: Penalties, prompt: list[int], generated: list[int]) -> int:
    controls = RowControls(GenerationRequest(prompt, 4, penalties=penalties), VOCAB, None, "r")
    for token in generated:
        controls._accept(token)
    return controls.choose(row(), generated)[0]


@pytest.mark.parametrize(
    ("penalties", "expected"),
    [
        (Penalties(presence=1.5), 3),  # OpenAI's rule: the prompt is not counted
        (Penalties(presence=1.5, count_prompt=True), 5),  # TensorRT-LLM's: it is
        (Penalties(frequency=0.6, count_prompt=True), 3),  # once: 2.0 - 0.6 > 1.0
    ],
)
def test_presence_and_frequency_count_the_prompt_only_with_count_prompt(penalties, expected):
    assert choose(penalties, [3, 1], []) == expected


def test_frequency_counts_each_occurrence_of_prompt_and_generated_tokens():
    penalties = Penalties(frequency=0.4, count_prompt=True)
    assert choose(penalties, [3, 1, 3], []) == 3  # 2.0 - 0.8 > 1.0
    assert choose(penalties, [3, 1, 3], [3]) == 5  # 2.0 - 1.2 < 1.0
    assert choose(Penalties(frequency=0.4), [3, 1, 3], [3]) == 3  # the generated one alone: 2.0 - 0.4


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    repetition=st.sampled_from([1.0, 0.7, 1.3, 2.0]),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
)
def test_numpy_penalties_are_the_transformers_engines_torch_ones(seed, repetition, presence, frequency):
    """One rule in two array libraries: a row of the llama.cpp engine (numpy) and a batch row of the transformers
    engine (torch) come out the same."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    scores = rng.normal(0, 4, (1, 64)).astype(np.float32)
    count = rng.integers(0, 3, (1, 64)).astype(np.float32)
    repeated = (count > 0) | (rng.random((1, 64)) < 0.2)
    ours = penalise(
        scores[0], count[0], repeated[0], np.float32(repetition), np.float32(presence), np.float32(frequency), np
    )
    theirs = penalise(
        *(torch.from_numpy(a) for a in (scores, count, repeated)),
        *(torch.tensor([[v]], dtype=torch.float32) for v in (repetition, presence, frequency)),
        torch,
    )
    np.testing.assert_allclose(ours, theirs[0].numpy(), rtol=1e-6, atol=1e-6)


def test_log_probs_are_of_the_raw_row_most_likely_first():
    request = GenerationRequest([1], 4, log_probs=3, embedding_bias=((5, 10.0),))
    logits = row()
    logits[6] = -1.0
    token, chosen = RowControls(request, VOCAB, None, "r").choose(logits, [])
    assert token == 5, "the bias decides the token"
    expected = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    assert chosen.log_prob == pytest.approx(expected[5], abs=1e-5), "of the raw logits, before the bias"
    assert [t for t, _ in chosen.top] == [3, 5, 6], "most likely first"
    assert logits[5] == 1.0, "the row is left as it was"


def test_bad_words_and_the_end_id_before_min_tokens_are_banned():
    request = GenerationRequest([1, 7], 4, end_id=3, penalties=Penalties(min_tokens=1), bad_words=((7, 5),))
    controls = RowControls(request, VOCAB, None, "r")
    assert controls.choose(row(), [])[0] not in (3, 5), "the end id before min_tokens; 5 after the prompt's 7"
    assert controls.choose(row(), [2])[0] == 3, "min_tokens reached, and no 7 before"
