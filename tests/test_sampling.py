"""Sampling and bad words as tensor operations: distributions, filters, seeding, and the argument rows."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from tritonllm.sampling import (
    GREEDY,
    ArgumentGroups,
    BadWords,
    Sampling,
    ban,
    request_processors,
    sample,
    step_seed,
    uniform,
)

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # token 1 most likely, then 3, 2, 0
LOGITS = PROBS.log()


def draw(seeds, temperature=1.0, top_k=0, top_p=1.0, logits=LOGITS) -> list[int]:
    """The token drawn for each seed, all rows in one batch."""
    n = len(seeds)
    scores = logits.repeat(n, 1)
    out = sample(
        scores.clone(),
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.int32),
        torch.full((n,), top_p),
        torch.tensor(seeds, dtype=torch.int32),
    )
    assert torch.isneginf(out).sum(-1).eq(logits.numel() - 1).all(), "each sampled row is one-hot"
    return out.argmax(-1).tolist()


def frequencies(tokens: list[int]) -> list[float]:
    counts = Counter(tokens)
    return [counts[t] / len(tokens) for t in range(PROBS.numel())]


SEEDS = [step_seed(seed, 0) for seed in range(4000)]


def test_draws_follow_the_distribution():
    for measured, expected in zip(frequencies(draw(SEEDS)), PROBS.tolist(), strict=True):
        assert abs(measured - expected) < 0.025


def test_temperature_sharpens_and_flattens():
    cold, hot = frequencies(draw(SEEDS, temperature=0.3)), frequencies(draw(SEEDS, temperature=3.0))
    assert cold[1] > 0.8
    assert 0.25 < hot[1] < 0.45
    assert hot[0] > 0.12


def test_top_k_keeps_the_k_most_likely():
    assert set(draw(SEEDS, top_k=1)) == {1}
    assert set(draw(SEEDS, top_k=2)) == {1, 3}
    assert frequencies(draw(SEEDS, top_k=2))[1] == pytest.approx(0.5 / 0.8, abs=0.03)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    assert set(draw(SEEDS, top_p=0.5)) == {1}  # 0.5 alone reaches 0.5
    assert set(draw(SEEDS, top_p=0.6)) == {1, 3}
    assert set(draw(SEEDS, top_p=0.81)) == {1, 3, 2}
    assert set(draw(SEEDS, top_p=1e-6)) == {1}  # the most likely token always stays


def test_a_draw_depends_on_its_seed_not_on_its_batch():
    seeds = SEEDS[:64]
    alone = [draw([s])[0] for s in seeds]
    assert draw(seeds) == alone
    assert draw(seeds[::-1]) == alone[::-1]
    assert len(set(alone)) > 1


def test_greedy_rows_are_untouched():
    scores = torch.randn(3, 50)
    ones = torch.ones(3)
    out = sample(scores.clone(), ones, torch.zeros(3, dtype=torch.int32), ones, torch.tensor([GREEDY, 7, GREEDY]))
    assert torch.equal(out[0], scores[0]) and torch.equal(out[2], scores[2])
    assert torch.isneginf(out[1]).sum() == 49


def test_uniform_is_in_the_open_interval_and_seed_dependent():
    ids = torch.arange(100_000).unsqueeze(0)
    u = uniform(torch.tensor([3], dtype=torch.int32), ids)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u, uniform(torch.tensor([4], dtype=torch.int32), ids))


def test_step_seeds_fit_int32_and_vary_by_position():
    seeds = {step_seed(2**64 - 1, p) for p in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**31 for s in seeds)


def test_ban_sets_listed_ids_to_minus_infinity_only():
    scores = torch.zeros(2, 6)
    out = ban(scores, torch.tensor([[0, 0, 5, -1], [-1, -1, -1, -1]]))
    assert torch.isneginf(out[0]).tolist() == [True, False, False, False, False, True]
    assert torch.equal(out[1], scores[1])


def request(generated=(), **kwargs):
    state = SimpleNamespace(
        logit_processor_kwargs=kwargs,
        initial_tokens=[9, 9],
        generated_tokens=list(generated),
        generated_len=lambda: len(generated),
    )
    return SimpleNamespace(state=state, has_new_token=True)


def test_kwargs_are_checked_against_every_group():
    plist = ArgumentGroups([Sampling(False), BadWords(False, 2)])
    plist.check_kwargs({"sample": True, "seed": 3, "bad_words": ((1,),)})
    with pytest.raises(TypeError):
        plist.check_kwargs({"top_k": "5"})
    with pytest.raises(ValueError):
        plist.check_kwargs({"frequency_penalty": 1.0})


def run(groups, requests, scores):
    """What transformers' batching manager does with the processor list for one step."""
    plist = ArgumentGroups(groups)
    storage = torch.zeros(plist.tensors_required, 8, dtype=torch.int32)
    plist.fill_defaults(storage[:, :1])
    args = plist.prepare_tensor_args(requests, storage)
    return plist(None, scores, args[:, : len(requests)])


@pytest.mark.parametrize("always", [False, True])
def test_argument_rows_carry_each_request_to_its_row(always):
    scores = LOGITS.repeat(3, 1)
    kwargs = {"sample": True, "temperature": 1.0, "top_k": 1, "top_p": 1.0, "seed": 5}
    requests = [request(), request(**{**kwargs, "top_k": 0}), request(**kwargs)]
    out = run([Sampling(always), BadWords(always, 4)], requests, scores.clone())
    assert torch.equal(out[0], scores[0])
    assert torch.isneginf(out[1]).sum() == 3
    assert out[2].argmax() == 1 and torch.isneginf(out[2]).sum() == 3


@pytest.mark.parametrize("always", [False, True])
def test_a_sampling_request_never_draws_a_banned_token(always):
    plist = request_processors(always, max_words=2)
    storage = torch.zeros(plist.tensors_required, 8, dtype=torch.int32)
    plist.fill_defaults(storage[:, :1])
    kwargs = {"sample": True, "temperature": 1.0, "top_k": 1, "top_p": 1.0, "seed": 5, "bad_words": ((1,),)}
    args = plist.prepare_tensor_args([request(**kwargs)], storage)
    out = plist(None, LOGITS.repeat(1, 1), args[:, :1])
    assert out[0].argmax() == 3 and torch.isneginf(out[0]).sum() == 3  # the most likely token left


def test_eager_steps_without_sampling_or_bans_skip_the_work():
    scores = torch.randn(2, 10)
    out = run([Sampling(False), BadWords(False, 2)], [request(), request()], scores)
    assert out is scores


def test_bad_words_ban_the_last_token_after_the_rest_of_the_word():
    words = ((4,), (7, 2))  # ban 4 always; ban 2 right after 7
    scores = torch.zeros(2, 10)
    out = run([BadWords(False, 2)], [request((7,), bad_words=words), request((3,), bad_words=words)], scores)
    assert torch.isneginf(out[0]).nonzero().flatten().tolist() == [2, 4]
    assert torch.isneginf(out[1]).nonzero().flatten().tolist() == [4]
