"""The llama.cpp engine's per-row controls on a hand-made logit row: which token each penalty rule picks."""

import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from tritonllm.engine.api import GenerationRequest, Penalties
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


def test_importing_or_choosing_leaves_torchs_thread_count_as_it_was():
    """The llama.cpp engine's rows run torch on one thread; a transformers engine in the same process keeps its
    (a fresh process: this one has imported the module already)."""
    script = (
        "import torch; torch.set_num_threads(2)\n"
        "from tests.unit.engine.test_row_controls import Penalties, choose\n"
        "assert choose(Penalties(presence=1.5), [3, 1], []) == 3\n"
        "print(torch.get_num_threads())"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2"]
