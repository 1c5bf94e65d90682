"""Sampling and bad words as tensor operations: distributions, filters, seeding, and the argument rows."""

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.generation.continuous_batching.utils import CudaGraphBuffer

from tritonllm.engine.logits import GREEDY, ban, sample, uniform
from tritonllm.engine.row_draw import REACHES, draw_one, row_uniform, step_seed
from tritonllm.engine.sampling import (
    ArgumentGroups,
    BadWords,
    ProcessorKeyedGraphs,
    Sampling,
    key_graphs_by_processors,
    request_processors,
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


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 0, 1.0), (0.8, 0, 0.9), (1.0, 0, 0.999), (1.0, 40, 1.0), (0.5, 5, 0.5),
     (1.0, 300, 1.0), (2.0, 0, 0.95)],
)  # fmt: skip
def test_one_rows_draw_is_samples(temperature, top_k, top_p):
    """draw_one, the llama.cpp rows' draw, picks what `sample` picks, near the row's peak and beyond it: rows of
    2,000 logits shaped like a model's (a few likely tokens, a long tail) and with ties among the likely ones."""
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randn(2000, generator=generator) * scale for scale in (1.0, 3.0, 6.0)]
    tied = torch.randn(2000, generator=generator) * 3
    tied[tied.topk(60).indices[10:]] = tied.topk(10).values[-1]
    seeds = [step_seed(seed, 7) for seed in range(150)]
    for scores in [*rows, tied]:
        expected = sample(
            scores.repeat(len(seeds), 1),
            torch.full((len(seeds),), temperature),
            torch.full((len(seeds),), top_k),
            torch.full((len(seeds),), top_p),
            torch.tensor(seeds),
        ).argmax(-1)
        assert [draw_one(scores.numpy(), temperature, top_k, top_p, seed) for seed in seeds] == expected.tolist()


@pytest.mark.parametrize(("top_k", "top_p"), [(1, 0.9), (5, 1.0), (0, 0.9), (0, 1.0)])
def test_a_row_with_nan_draws_a_real_token(top_k, top_p):
    """A NaN once made the top-k edge NaN and the prefix empty: an IndexError that failed the engine's step loop."""
    row = torch.randn(3000, generator=torch.Generator().manual_seed(2)).numpy()
    row[[7, 70, 700]] = np.nan
    for seed in range(20):
        token = draw_one(row, 1.0, top_k, top_p, seed)
        assert 0 <= token < row.size and not np.isnan(row[token])


def test_a_rows_uniform_is_samples():
    seeds = [step_seed(seed, 3) for seed in range(2000)] + [0, 2**31 - 1]
    expected = uniform(torch.tensor(seeds), torch.zeros(len(seeds), 1, dtype=torch.long))[:, 0]
    assert [float(row_uniform(seed)) for seed in seeds] == expected.tolist()


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


def request(generated=(), pending=False, **kwargs):
    """A request as the processors see it when a step is prepared. `pending`: the step's input token is still
    being generated by the previous step (asynchronous batching), so the host does not have it yet."""
    context = [9, 9, *generated]
    state = SimpleNamespace(
        logit_processor_kwargs=kwargs,
        initial_tokens=context[:2],
        generated_tokens=context[2:],
        position_offset=len(context) + pending,  # the position of the token this step generates
    )
    return SimpleNamespace(state=state, has_new_token=True)


def test_kwargs_are_checked_against_every_group():
    plist = ArgumentGroups([Sampling(), BadWords(2)])
    plist.check_kwargs({"sample": True, "seed": 3, "bad_words": ((1,),)})
    with pytest.raises(TypeError):
        plist.check_kwargs({"top_k": "5"})
    with pytest.raises(ValueError):
        plist.check_kwargs({"frequency_penalty": 1.0})


def run(groups, requests, scores, input_ids=None):
    """What transformers' batching manager does with the processor list for one step. `input_ids`: each
    request's input token on the device (default: the last of its context)."""
    plist = ArgumentGroups(groups)
    storage = torch.zeros(plist.tensors_required, 8, dtype=torch.int32)
    plist.fill_defaults(storage[:, :1])
    args = plist.prepare_tensor_args(requests, storage)
    if input_ids is None:
        input_ids = [(r.state.initial_tokens + r.state.generated_tokens)[-1] for r in requests]
    return plist(torch.tensor(input_ids), scores, args[:, : len(requests)])


def test_argument_rows_carry_each_request_to_its_row():
    scores = LOGITS.repeat(3, 1)
    kwargs = {"sample": True, "temperature": 1.0, "top_k": 1, "top_p": 1.0, "seed": 5}
    requests = [request(), request(**{**kwargs, "top_k": 0}), request(**kwargs)]
    out = run([Sampling(), BadWords(4)], requests, scores.clone())
    assert torch.equal(out[0], scores[0])
    assert torch.isneginf(out[1]).sum() == 3
    assert out[2].argmax() == 1 and torch.isneginf(out[2]).sum() == 3


def test_a_sampling_request_never_draws_a_banned_token():
    plist = request_processors(max_words=2)
    storage = torch.zeros(plist.tensors_required, 8, dtype=torch.int32)
    plist.fill_defaults(storage[:, :1])
    kwargs = {"sample": True, "temperature": 1.0, "top_k": 1, "top_p": 1.0, "seed": 5, "bad_words": ((1,),)}
    args = plist.prepare_tensor_args([request(**kwargs)], storage)
    out = plist(torch.tensor([9]), LOGITS.repeat(1, 1), args[:, :1])
    assert out[0].argmax() == 3 and torch.isneginf(out[0]).sum() == 3  # the most likely token left


def test_steps_without_sampling_or_bans_skip_the_work():
    scores = torch.randn(2, 10)
    out = run([Sampling(), BadWords(2)], [request(), request()], scores)
    assert out is scores


def test_bad_words_ban_the_last_token_after_the_rest_of_the_word():
    words = ((4,), (7, 2), (5, 6, 1))  # ban 4 always; 2 right after 7; 1 right after 5 6
    requests = [request(g, bad_words=words) for g in [(7,), (3,), (5, 6), (6, 6)]]
    out = run([BadWords(3)], requests, torch.zeros(4, 10))
    assert [torch.isneginf(row).nonzero().flatten().tolist() for row in out] == [[2, 4], [4], [1, 4], [4]]


def test_bad_words_check_an_input_token_the_host_has_not_seen():
    """Asynchronous batching prepares a step while the previous one generates its input token: the host knows
    the tokens before it, the device checks the token itself."""
    words = ((7, 2), (5, 6, 1))
    requests = [request((3,), pending=True, bad_words=words), request((5,), pending=True, bad_words=words)]
    banned = lambda out: [torch.isneginf(row).nonzero().flatten().tolist() for row in out]  # noqa: E731
    assert banned(run([BadWords(2)], requests, torch.zeros(2, 10), input_ids=[7, 6])) == [[2], [1]]
    assert banned(run([BadWords(2)], requests, torch.zeros(2, 10), input_ids=[3, 5])) == [[], []]


def test_sampling_seeds_follow_the_generated_position_not_the_host_state():
    """A step's seed comes from the position it generates, known on the host before the previous token is."""
    kwargs = {"sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 5}
    synchronous = Sampling().prepare([request((1, 2), **kwargs)])
    asynchronous = Sampling().prepare([request((1,), pending=True, **kwargs)])
    assert torch.equal(synchronous, asynchronous)
    assert synchronous[3, 0] == step_seed(5, 4)


class FakeGraph:
    def reset(self) -> None:  # what transformers' graph store calls on each graph when it goes
        pass


def prepared(plist, requests):
    storage = torch.zeros(plist.tensors_required, 8, dtype=torch.int32)
    plist.fill_defaults(storage[:, :1])
    plist.prepare_tensor_args(requests, storage)


def test_graph_keys_tell_apart_the_processing_a_step_runs():
    """A CUDA graph captured for a greedy step has no sampling in it: a step that samples must get its own."""
    plist = request_processors(max_words=2)
    keys = []
    for requests in (
        [request(), request()],
        [request(), request(sample=True, temperature=1.0, top_k=0, top_p=1.0, seed=1)],
        [request(bad_words=((4,),))],
        [request(bad_words=((4,),), sample=True, temperature=1.0, top_k=0, top_p=1.0, seed=1)],
    ):
        prepared(plist, requests)
        keys.append(plist.graph_key((16, 4096, 256)))
    assert keys[0] == (16, 4096, 256)  # greedy steps keep the manager's key, as its warm-up captured them
    assert len(set(keys)) == 4


def test_graph_store_keeps_warm_up_graphs_and_separates_sampling_steps():
    plist = request_processors(max_words=2)
    warm = CudaGraphBuffer()
    warm.set_graph((16,), greedy := FakeGraph())
    io = SimpleNamespace(graphs=warm)
    assert key_graphs_by_processors(io, plist) == [io.graphs]
    assert isinstance(io.graphs, ProcessorKeyedGraphs) and not warm._storage
    assert len(io.graphs) == 1  # the warm-up graph, counted where it now lives
    prepared(plist, [request(sample=True, temperature=1.0, top_k=0, top_p=1.0, seed=1)])
    assert io.graphs.get_graph((16,)) is None  # a new capture, not the greedy graph
    io.graphs.set_graph((16,), sampling := FakeGraph())
    prepared(plist, [request()])
    assert io.graphs.get_graph((16,)) is greedy
    prepared(plist, [request(sample=True, temperature=0.5, top_k=3, top_p=0.9, seed=2)])
    assert io.graphs.get_graph((16,)) is sampling
    assert len(io.graphs) == 2


def test_both_buffer_sets_of_asynchronous_batching_are_keyed():
    pairs = [SimpleNamespace(device_io=SimpleNamespace(graphs=CudaGraphBuffer())) for _ in range(2)]
    key_graphs_by_processors(SimpleNamespace(io_pairs=pairs), request_processors(max_words=2))
    assert all(isinstance(pair.device_io.graphs, ProcessorKeyedGraphs) for pair in pairs)
    with pytest.raises(RuntimeError, match="no CUDA graph store"):
        key_graphs_by_processors(SimpleNamespace(), request_processors(max_words=2))


@pytest.mark.parametrize(
    ("temperature", "top_p", "scale", "rung"),
    [(1.0, 0.95, 4.0, 1), (0.7, 0.9, 2.0, 1), (1.5, 0.9, 4.0, 1), (1.5, 0.99, 2.0, 2)],
)
def test_a_nucleus_past_the_first_rung_is_drawn_from_a_wider_one_as_sample_draws(temperature, top_p, scale, rung):
    """A broad row, as a raw prompt gives: the tokens within REACHES[0] of the peak hold less than top_p of its mass,
    so draw_one decides with the second rung's, or (rung 2) the whole row, and still picks what `sample` picks."""
    generator = torch.Generator().manual_seed(5)
    scores = torch.randn(20_000, generator=generator) * scale
    scaled = scores / temperature
    probs = scaled.softmax(-1)
    within = [scaled >= scaled.max() - reach for reach in REACHES]
    assert probs[within[0]].sum() < top_p
    assert probs[within[1]].sum() >= top_p if rung == 1 else within[1].all()
    seeds = [step_seed(seed, 11) for seed in range(120)]
    expected = sample(
        scores.repeat(len(seeds), 1),
        torch.full((len(seeds),), temperature),
        torch.zeros(len(seeds), dtype=torch.long),
        torch.full((len(seeds),), top_p),
        torch.tensor(seeds),
    ).argmax(-1)
    assert [draw_one(scores.numpy(), temperature, 0, top_p, seed) for seed in seeds] == expected.tolist()
