"""benchmarks/gpu_bench.py's reading of the device timeline (runs on the GPU machine; arithmetic checked here)."""

import pytest

from benchmarks import gpu_bench


def test_device_idle_splits_gaps_inside_and_between_steps():
    # two steps of two overlapping kernels, a 280 us host turn between them
    kernels = [(300.0, 310.0), (0.0, 10.0), (5.0, 12.0), (13.0, 20.0), (310.5, 320.0)]
    assert gpu_bench.device_idle(kernels) == pytest.approx(
        {"busy": 38.5, "idle_inside_steps": 1.5, "idle_between_steps": 280.0}
    )


def test_equivalence_finds_bad_words_across_the_prompt_and_where_answers_part():
    assert gpu_bench.contains_word([1, 2, 3], [4, 5], (3, 4))  # its first token is the prompt's last
    assert not gpu_bench.contains_word([1, 2, 3], [4, 5], (2, 4))
    assert gpu_bench.contains_word([1], [5, 6], (6,))
    assert not gpu_bench.contains_word([6], [5], (6,))  # a prompt token is not generated
    assert gpu_bench.agreement([[1, 2, 3], [1, 2], [7]], [[1, 2, 3], [1, 2, 4], [8]]) == {
        "same": "1/3",
        "first_difference_at": [0, 2],  # a shorter answer differs where it ends
    }


def test_build_variants_split_server_environment_from_build_arguments_with_values():
    env, argv = gpu_bench.split_environment(["--max-batch-tokens", "1024", "TORCH_LOGS=graph", "--compile"])
    assert env == {"TORCH_LOGS": "graph"}
    assert argv == ["--max-batch-tokens", "1024", "--compile"]
