"""Repetition, presence and frequency penalties on logits, in either array library: the transformers engine applies
them to a step's batch in torch (tritonllm/engine/controls.py), the llama.cpp engine to one row in numpy
(tritonllm/engine/row_controls.py), so that its process never loads torch for them. One rule for both."""

from __future__ import annotations

from types import ModuleType
from typing import Any


def penalise(
    scores: Any,
    count: Any,
    repeated: Any | None,
    repetition: Any | None,
    presence: Any | None,
    frequency: Any | None,
    xp: ModuleType,
) -> Any:
    """Repetition (transformers' RepetitionPenaltyLogitsProcessor), then presence and frequency (OpenAI's: logit -=
    presence * [count > 0] + frequency * count) penalties. count: float [B, V] (or [V]) of the generated tokens;
    repeated: bool, the prompt's and the generated tokens; the penalties [B, 1] (or scalars); xp: torch or numpy,
    whose `where`, `minimum` and `maximum` these are. A None penalty is not computed."""
    if repetition is not None:
        # transformers' where(score < 0, score * penalty, score / penalty), without a select on the scores'
        # signs (a branch per element on the CPU): for a penalty >= 1 that is the smaller of the two, else the
        # larger, the same values.
        scaled, divided = scores * repetition, scores / repetition
        penalised = xp.where(repetition >= 1, xp.minimum(scaled, divided), xp.maximum(scaled, divided))
        scores = xp.where(repeated, penalised, scores)
    if presence is not None:
        scores = scores - (frequency * count + presence * (count > 0))
    return scores
