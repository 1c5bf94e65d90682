"""Penalties, min_tokens, embedding bias and log probabilities per request, in the portable engine's batching:
each equals transformers' `generate` or a reference loop over full forward passes of the model, alone and when
requests with other controls share its batch."""

import math
import threading
from types import SimpleNamespace

import pytest
import torch

from tests.unit.engine.conftest import chat_ids
from tritonllm.engine.api import Emission, EngineConfig, GenerationRequest, Guide, Penalties, SamplingParams
from tritonllm.engine.checks import check_batching
from tritonllm.engine.controls import RequestSlots
from tritonllm.engine.process import EngineProcess
from tritonllm.errors import InputError
from tritonllm.protocol import FINISH_EOS, FINISH_LENGTH, MAX_TOP_LOG_PROBS

N = 16  # tokens per request: enough for penalties to change the text, short enough for a 2-core host


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return {
        "france": chat_ids(tokenizer, "What is the capital of France?"),  # greedy ends after 7 tokens
        "list": chat_ids(tokenizer, "List the colors of the rainbow, then list them again."),
        "story": chat_ids(tokenizer, "Tell me a story about a cat and a dog."),
    }


def until_end(tokens: list[int], end_id: int) -> list[int]:
    return tokens[: tokens.index(end_id)] if end_id in tokens else tokens


def hf_generate(hf_model, ids, n, end_id, **kwargs) -> list[int]:
    out = hf_model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=end_id, pad_token_id=end_id, **kwargs
    )[0, len(ids) :].tolist()
    return until_end(out, end_id)


@torch.no_grad()
def openai_reference(hf_model, ids, n, end_id, presence, frequency, count_prompt=False) -> list[int]:
    """Greedy over full forward passes, with OpenAI's presence and frequency penalties on the generated tokens (and
    with count_prompt on the prompt's, as TensorRT-LLM counts them)."""
    sequence, counts = list(ids), torch.zeros(hf_model.config.vocab_size)
    if count_prompt:
        counts += torch.bincount(torch.tensor(ids), minlength=counts.shape[0]).float()
    out = []
    for _ in range(n):
        logits = hf_model(torch.tensor([sequence])).logits[0, -1].float()
        logits = logits - (frequency * counts + presence * (counts > 0))
        token = int(logits.argmax())
        if token == end_id:
            break
        out.append(token)
        sequence.append(token)
        counts[token] += 1
    return out


@torch.no_grad()
def model_log_probs(hf_model, ids, tokens) -> torch.Tensor:
    """log_softmax of the model's logits at each generated position: [len(tokens), vocab]."""
    logits = hf_model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : len(ids) + len(tokens) - 1]
    return logits.float().log_softmax(-1)


def run(engine, request: GenerationRequest) -> list[Emission]:
    """Every emission of one request."""
    emissions: list[Emission] = []
    done = threading.Event()

    def emit(emission):
        emissions.append(emission)
        if emission.final:
            done.set()

    engine.submit(request, emit)
    assert done.wait(120), "timed out"
    assert emissions[-1].error is None, emissions[-1].error
    return emissions


def joined(emissions: list[Emission]) -> tuple[list[int], list | None, str]:
    tokens = [t for e in emissions for t in e.token_ids]
    log_probs = None if all(e.log_probs is None for e in emissions) else [p for e in emissions for p in e.log_probs]
    return tokens, log_probs, emissions[-1].finish_reason


# ---------------------------------------------------------------------- penalties


@pytest.mark.parametrize("repetition", [1.3, 0.7])
def test_repetition_penalty_equals_generate(engine, hf_model, tokenizer, prompts, repetition):
    eos = tokenizer.eos_token_id
    ids = prompts["list"]
    tokens, reason = engine.generate(
        GenerationRequest(ids, N, end_id=eos, penalties=Penalties(repetition=repetition)), timeout=120
    )
    assert tokens == hf_generate(hf_model, ids, N, eos, repetition_penalty=repetition)
    assert tokens != engine.generate(GenerationRequest(ids, N, end_id=eos), timeout=120)[0]
    assert reason in (FINISH_EOS, FINISH_LENGTH)


def test_min_tokens_equals_generate(engine, hf_model, tokenizer, prompts):
    eos, ids = tokenizer.eos_token_id, prompts["france"]
    plain, reason = engine.generate(GenerationRequest(ids, N, end_id=eos), timeout=120)
    assert reason == FINISH_EOS and len(plain) < 12  # so that min_tokens changes something
    tokens, _ = engine.generate(GenerationRequest(ids, N, end_id=eos, penalties=Penalties(min_tokens=12)), timeout=120)
    assert len(tokens) >= 12
    assert tokens == hf_generate(hf_model, ids, N, eos, min_new_tokens=12)


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 0.8), (0.5, 0.5), (-0.5, -0.3)])
def test_presence_and_frequency_follow_openais_formula(engine, hf_model, tokenizer, prompts, presence, frequency):
    eos, ids = tokenizer.eos_token_id, prompts["list"]
    request = GenerationRequest(ids, N, end_id=eos, penalties=Penalties(presence=presence, frequency=frequency))
    tokens, _ = engine.generate(request, timeout=120)
    assert tokens == openai_reference(hf_model, ids, N, eos, presence, frequency)


def test_count_prompt_counts_the_prompts_tokens(engine, hf_model, tokenizer, prompts):
    eos, ids, presence, frequency = tokenizer.eos_token_id, prompts["list"], 1.5, 0.2
    penalties = Penalties(presence=presence, frequency=frequency, count_prompt=True)
    tokens, _ = engine.generate(GenerationRequest(ids, N, end_id=eos, penalties=penalties), timeout=120)
    assert tokens == openai_reference(hf_model, ids, N, eos, presence, frequency, count_prompt=True)
    assert tokens != openai_reference(hf_model, ids, N, eos, presence, frequency), "the prompt changes the text"


def test_penalties_then_top_k_one_sampling_is_greedy_with_penalties(engine, tokenizer, prompts):
    eos, ids = tokenizer.eos_token_id, prompts["story"]
    penalties = Penalties(repetition=1.2, frequency=0.4)
    greedy, _ = engine.generate(GenerationRequest(ids, N, end_id=eos, penalties=penalties), timeout=120)
    top1 = SamplingParams(sample=True, temperature=1.0, top_k=1, seed=7)
    sampled, _ = engine.generate(GenerationRequest(ids, N, end_id=eos, penalties=penalties, sampling=top1), timeout=120)
    assert sampled == greedy
    plain_top1, _ = engine.generate(GenerationRequest(ids, N, end_id=eos, sampling=top1), timeout=120)
    assert plain_top1 == engine.generate(GenerationRequest(ids, N, end_id=eos), timeout=120)[0]


def test_neutral_controls_leave_greedy_as_generate(engine, hf_model, tokenizer, prompts):
    eos, ids = tokenizer.eos_token_id, prompts["story"]
    request = GenerationRequest(ids, N, end_id=eos, penalties=Penalties(1.0, 0.0, 0.0, 0), embedding_bias=())
    assert engine.generate(request, timeout=120)[0] == hf_generate(hf_model, ids, N, eos)


# ---------------------------------------------------------------------- embedding bias


def test_embedding_bias_of_minus_infinity_keeps_a_token_out(engine, tokenizer, prompts):
    eos, ids = tokenizer.eos_token_id, prompts["france"]
    greedy, _ = engine.generate(GenerationRequest(ids, N, end_id=eos), timeout=120)
    first = greedy[0]
    biased, _ = engine.generate(
        GenerationRequest(ids, N, end_id=eos, embedding_bias=((first, -math.inf),)), timeout=120
    )
    assert first not in biased and biased
    # A large positive bias makes its token the greedy choice at every step.
    forced, reason = engine.generate(GenerationRequest(ids, 5, end_id=eos, embedding_bias=((42, 1e4),)), timeout=120)
    assert forced == [42] * 5 and reason == FINISH_LENGTH


# ---------------------------------------------------------------------- log probabilities


@pytest.mark.parametrize("streaming", [False, True])
def test_log_probs_are_the_models_own(engine, hf_model, tokenizer, prompts, streaming):
    eos, ids = tokenizer.eos_token_id, prompts["story"]
    request = GenerationRequest(ids, N, end_id=eos, log_probs=5, streaming=streaming)
    emissions = run(engine, request)
    tokens, log_probs, _ = joined(emissions)
    assert tokens == engine.generate(GenerationRequest(ids, N, end_id=eos), timeout=120)[0]  # output unchanged
    assert all(e.log_probs is not None and len(e.log_probs) == len(e.token_ids) for e in emissions)
    reference = model_log_probs(hf_model, ids, tokens)
    for position, (token, entry) in enumerate(zip(tokens, log_probs, strict=True)):
        assert entry.log_prob == pytest.approx(float(reference[position, token]), abs=1e-4)
        values, top_ids = reference[position].topk(5)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert entry.top[0][0] == token  # greedy: the chosen token is the most likely


def test_log_probs_are_before_penalties_and_end_with_the_tokens(engine, hf_model, tokenizer, prompts):
    """Under penalties the chosen token is often not the model's most likely; its log probability is still the
    model's. The end id is not a token of the output, and has no entry either."""
    eos, ids = tokenizer.eos_token_id, prompts["france"]
    request = GenerationRequest(ids, N, end_id=eos, log_probs=0, penalties=Penalties(repetition=1.5, presence=1.0))
    tokens, log_probs, reason = joined(run(engine, request))
    assert len(log_probs) == len(tokens) and all(entry.top == () for entry in log_probs)
    reference = model_log_probs(hf_model, ids, tokens)
    assert [e.log_prob for e in log_probs] == pytest.approx(
        [float(reference[i, t]) for i, t in enumerate(tokens)], abs=1e-4
    )
    if reason == FINISH_EOS:
        assert eos not in tokens


def test_sampled_tokens_have_their_log_probs(engine, hf_model, tokenizer, prompts):
    ids = prompts["story"]
    sampling = SamplingParams(sample=True, temperature=1.5, top_k=0, top_p=1.0, seed=3)
    tokens, log_probs, _ = joined(
        run(engine, GenerationRequest(ids, 8, log_probs=MAX_TOP_LOG_PROBS, sampling=sampling))
    )
    reference = model_log_probs(hf_model, ids, tokens)
    assert [e.log_prob for e in log_probs] == pytest.approx(
        [float(reference[i, t]) for i, t in enumerate(tokens)], abs=1e-4
    )
    assert all(len(e.top) == MAX_TOP_LOG_PROBS for e in log_probs)


# ---------------------------------------------------------------------- one batch, many controls


def mixed_requests(tokenizer, prompts) -> list[GenerationRequest]:
    eos = tokenizer.eos_token_id
    sample = SamplingParams(sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=11)
    return [
        GenerationRequest(prompts["story"], N, end_id=eos),
        GenerationRequest(prompts["story"], N, end_id=eos, penalties=Penalties(repetition=1.3)),
        GenerationRequest(prompts["list"], N, end_id=eos, penalties=Penalties(presence=1.0, frequency=0.5)),
        GenerationRequest(prompts["france"], N, end_id=eos, penalties=Penalties(min_tokens=10), log_probs=2),
        GenerationRequest(prompts["list"], N, end_id=eos, embedding_bias=((28, -math.inf), (30, 2.0))),
        GenerationRequest(prompts["story"], N, end_id=eos, sampling=sample, penalties=Penalties(frequency=0.3)),
        GenerationRequest(prompts["france"], N, end_id=eos, guide=Guide("regex", r"(Yes|No), [a-z ]{1,40}\.")),
        GenerationRequest(prompts["list"], N, end_id=eos, log_probs=4, streaming=True),
    ]


def test_requests_with_different_controls_share_a_batch(engine, tokenizer, prompts):
    requests = mixed_requests(tokenizer, prompts)
    alone = [joined(run(engine, r)) for r in requests]
    results: list = [None] * len(requests)
    done = threading.Semaphore(0)

    def submit(i):
        emissions = []

        def emit(e):
            emissions.append(e)
            if e.final:
                results[i] = joined(emissions)
                done.release()

        engine.submit(requests[i], emit)

    for i in range(len(requests)):
        submit(i)
    for _ in requests:
        assert done.acquire(timeout=300)
    for got, expected in zip(results, alone, strict=True):
        tokens, log_probs, reason = got
        assert (tokens, reason) == (expected[0], expected[2])
        if expected[1] is None:
            assert log_probs is None
        else:
            assert [e.log_prob for e in log_probs] == pytest.approx([e.log_prob for e in expected[1]], abs=1e-4)
    assert engine.running() == 0
    # Released slots are freed at a later step that uses slots: only that request's own is left.
    engine.generate(GenerationRequest(prompts["france"], 2, penalties=Penalties(repetition=1.1)), timeout=60)
    assert len(engine._slots) == 1 and len(engine.guides) == 0


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"penalties": Penalties(repetition=0.0)}, "repetition_penalty"),
        ({"penalties": Penalties(repetition=math.nan)}, "repetition_penalty"),
        ({"penalties": Penalties(presence=math.inf)}, "presence_penalty"),
        ({"penalties": Penalties(frequency=math.nan)}, "frequency_penalty"),
        ({"penalties": Penalties(min_tokens=-1)}, "min_tokens"),
        ({"embedding_bias": ((10**7, 1.0),)}, "embedding_bias"),
        ({"embedding_bias": ((-1, 1.0),)}, "embedding_bias"),
        ({"embedding_bias": ((5, math.nan),)}, "embedding_bias"),
        ({"embedding_bias": ((5, math.inf),)}, "embedding_bias"),
        ({"log_probs": MAX_TOP_LOG_PROBS + 1}, "num_top_log_probs"),
        ({"log_probs": -2}, "num_top_log_probs"),
        ({"guide": Guide("xml", "<a/>")}, "guided_decoding_guide_type"),
        ({"guide": Guide("regex", "")}, "guided_decoding_guide"),
    ],
)
def test_controls_out_of_range_are_refused_naming_the_input(engine, changes, field):
    request = GenerationRequest([1, 2, 3], 4, **changes)
    with pytest.raises(InputError) as refused:
        engine.submit(request, lambda e: None)
    assert refused.value.field == field
    assert engine.running() == 0


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"guide": Guide("json")}, "guided_decoding_guide"), ({"log_probs": 0}, "return_log_probs")],
)
def test_asynchronous_batching_refuses_what_needs_each_token_on_the_host(changes, field):
    request = GenerationRequest([1, 2, 3], 4, **changes)
    check_batching(request, async_batching=False)
    with pytest.raises(InputError, match="--async-batching false") as refused:
        check_batching(request, async_batching=True)
    assert refused.value.field == field
    check_batching(GenerationRequest([1], 4, penalties=Penalties(1.2, 0.5, 0.5, 3)), async_batching=True)


# ---------------------------------------------------------------------- device slots


def state(request_id, prompt=(1, 2), **kwargs):
    return SimpleNamespace(
        request_id=request_id, initial_tokens=list(prompt), logit_processor_kwargs=kwargs, position_offset=len(prompt)
    )


def in_step(*request_ids):
    return [SimpleNamespace(state=SimpleNamespace(request_id=r)) for r in request_ids]


def test_slots_grow_keeping_their_rows_and_free_once_out_of_the_batch():
    slots = RequestSlots(vocab_size=8, capacity=2, device="cpu")
    first = slots.slot(state("a", prompt=(3,), repetition_penalty=1.2, embedding_bias=((5, 1.5), (5, 1.0))))
    assert slots.prompt[first].nonzero().flatten().tolist() == [3] and slots.bias[first, 5] == 2.5
    slots.counts[first, 4] = 2
    slots.slot(state("b"))
    third = slots.slot(state("c"))  # no free slot: the table doubles
    assert slots.capacity == 4 and third not in (first, slots.slot(state("b")))
    assert slots.counts[first, 4] == 2 and slots.bias[first, 5] == 2.5 and slots.prompt[first, 3]
    slots.release("a")
    slots.begin_step(in_step("a", "b"))  # a step still holds it (asynchronous batching's step in flight)
    assert slots.slot(state("a")) == first
    slots.begin_step(in_step("b"))
    assert len(slots) == 2
    reused = slots.slot(state("d"))
    assert reused == first and slots.counts[reused].sum() == 0 and slots.bias[reused].sum() == 0


# ---------------------------------------------------------------------- in a process of its own


@pytest.fixture(scope="module")
def child(manifest):
    process = EngineProcess(
        EngineConfig(manifest["model_dir"], dtype=manifest["dtype"], max_batch_size=4, max_seq_len=512)
    )
    yield process
    process.shutdown()


def test_controls_travel_to_the_engines_process(child, engine, tokenizer, prompts):
    eos = tokenizer.eos_token_id
    requests = [
        GenerationRequest(prompts["list"], 8, end_id=eos, penalties=Penalties(1.3, 0.2, 0.2, 0), log_probs=3),
        GenerationRequest(prompts["france"], 8, end_id=eos, embedding_bias=((504, -math.inf),), streaming=True),
        GenerationRequest(prompts["france"], 12, end_id=eos, guide=Guide("regex", r"[0-9]{3}")),
    ]
    for request in requests:
        here, there = joined(run(engine, request)), joined(run(child, request))
        assert there[0] == here[0] and there[2] == here[2]
        assert (there[1] is None) == (here[1] is None)
        if here[1] is not None:
            assert [e.top for e in there[1]] == [e.top for e in here[1]]
    with pytest.raises(InputError) as refused:
        child.submit(GenerationRequest([1, 2], 4, guide=Guide("regex", "[a-")), lambda e: None)
    assert refused.value.field == "guided_decoding_guide" and "compile" in str(refused.value)
    with pytest.raises(InputError, match="embedding_bias"):
        child.submit(GenerationRequest([1, 2], 4, embedding_bias=((engine.vocab_size, 1.0),)), lambda e: None)
    assert child.running() == 0
