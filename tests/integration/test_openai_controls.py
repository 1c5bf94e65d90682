"""Integration: every generation control of the OpenAI-compatible layer, through the official `openai` client
against a real tritonserver: log probabilities against a reference forward pass, structured output, tool
calls, penalties and biases, echo, and the refusals that name their parameter."""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch

pytestmark = pytest.mark.integration
QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "answer": {
        "type": "object",
        "properties": {
            "capital": {"type": "string", "enum": ["Paris", "Lyon", "Marseille"]},
            "sure": {"type": "boolean"},
        },
        "required": ["capital", "sure"],
        "additionalProperties": False,
    },
    "colors": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue", "yellow"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "list": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
}


@pytest.fixture(scope="module")
def api(openai_frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=openai_frontend(), api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(api) -> str:
    return api.models.list().data[0].id


def chat(api, model, content=QUESTION, **options):
    return api.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **options)


def stream_chat(api, model, content=QUESTION, **options) -> list:
    return [c for c in chat(api, model, content, stream=True, **options) if c.choices]


def chat_ids(tokenizer, content: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def reference(tokenizer, hf_model, ids: list[int], steps: int, k: int) -> list[tuple[str, float, list]]:
    """transformers' greedy tokens after `ids`, each as (text, log prob, [(text, log prob)] of the k likeliest):
    log_softmax of the model's own logits."""
    eos = tokenizer.eos_token_id
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, pad_token_id=eos)
    generated = out[0, len(ids) :].tolist()
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + generated])).logits[0, len(ids) - 1 : -1].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    rows = []
    for position, token in enumerate(generated):
        top = log_probs[position].topk(k)
        rows.append(
            (
                tokenizer.decode([token]),
                float(log_probs[position, token]),
                [(tokenizer.decode([int(i)]), float(v)) for v, i in zip(top.values, top.indices, strict=True)],
            )
        )
    return rows


def check_against(rows: list, entries: list[tuple[str, float, list]], atol: float) -> None:
    assert [e[0] for e in entries] == [r[0] for r in rows[: len(entries)]]
    for (_, log_prob, top), (_, expected, expected_top) in zip(entries, rows, strict=False):
        assert log_prob == pytest.approx(expected, abs=atol)
        assert [t for t, _ in top] == [t for t, _ in expected_top]
        assert [p for _, p in top] == pytest.approx([p for _, p in expected_top], abs=atol)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_a_reference_forward_pass(api, model, tokenizer, hf_model, stream, log_prob_atol):
    options = {"logprobs": True, "top_logprobs": 5, "max_tokens": 12}
    if stream:
        chunks = stream_chat(api, model, **options)
        content = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        choice = chat(api, model, **options).choices[0]
        content, text = choice.logprobs.content, choice.message.content
    entries = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]
    check_against(reference(tokenizer, hf_model, chat_ids(tokenizer, QUESTION), 12, 5), entries, log_prob_atol)
    assert "".join(e.token for e in content) == text
    for e in content:
        assert e.bytes == list(e.token.encode())


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_a_reference_forward_pass(api, model, tokenizer, hf_model, stream, log_prob_atol):
    prompt = "The three primary colors are"
    options = {"logprobs": 3, "max_tokens": 10}
    if stream:
        chunks = [c for c in api.completions.create(model=model, prompt=prompt, stream=True, **options) if c.choices]
        parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        log_probs = [x for p in parts for x in p.token_logprobs]
        tops = [x for p in parts for x in p.top_logprobs]
        offsets = [x for p in parts for x in p.text_offset]
    else:
        logprobs = api.completions.create(model=model, prompt=prompt, **options).choices[0].logprobs
        tokens, log_probs, tops, offsets = (
            logprobs.tokens,
            logprobs.token_logprobs,
            logprobs.top_logprobs,
            logprobs.text_offset,
        )
    rows = reference(tokenizer, hf_model, tokenizer(prompt)["input_ids"], 10, 3)
    assert tokens == [r[0] for r in rows]
    assert log_probs == pytest.approx([r[1] for r in rows], abs=log_prob_atol)
    for top, (token, log_prob, expected) in zip(tops, rows, strict=True):
        assert top == pytest.approx(dict(expected) | {token: log_prob}, abs=log_prob_atol)  # the chosen one is in it
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("k", [0, 1, 20])
def test_top_logprobs_count_and_order(api, model, k):
    for content in (
        chat(api, model, logprobs=True, top_logprobs=k, max_tokens=6).choices[0].logprobs.content,
        [
            e
            for c in stream_chat(api, model, logprobs=True, top_logprobs=k, max_tokens=6)
            if c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ],
    ):
        assert len(content) == 6
        for entry in content:
            values = [t.logprob for t in entry.top_logprobs]
            assert len(values) == k and values == sorted(values, reverse=True)
            if k:
                assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
                assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)


def test_logprobs_with_n_and_usage_in_a_stream(api, model):
    chunks = list(
        chat(api, model, n=2, max_tokens=5, logprobs=True, stream=True, stream_options={"include_usage": True})
    )
    for index in (0, 1):
        entries = [
            e
            for c in chunks
            if c.choices and c.choices[0].index == index and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ]
        assert len(entries) == 5
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens > 0


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_always_parses_and_validates(api, model, name, stream):
    schema = SCHEMAS[name]
    form = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    prompts = [f"Answer in JSON: {name}.", "Describe a person as JSON.", "Which colors do you like?"]
    prompts = prompts[:1] if stream else prompts  # streamed text is the same text: one prompt shows it

    def one(i: int) -> str:
        options = {"response_format": form, "max_tokens": 200, "temperature": 0.8, "seed": i}
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in stream_chat(api, model, prompts[i], **options))
        answer = chat(api, model, prompts[i], **options).choices[0]
        assert answer.finish_reason == "stop", answer.message.content
        return answer.message.content

    with ThreadPoolExecutor(len(prompts)) as pool:  # together: the engine batches them
        for text in pool.map(one, range(len(prompts))):
            jsonschema.validate(json.loads(text), schema)


def test_json_object_parses(api, model):
    def one(seed: int):
        return chat(
            api,
            model,
            "Describe Paris as JSON.",
            response_format={"type": "json_object"},
            max_tokens=300,
            temperature=0.7,
            seed=seed,
        ).choices[0]

    with ThreadPoolExecutor(2) as pool:
        for answer in pool.map(one, range(2)):
            assert answer.finish_reason == "stop"
            assert isinstance(json.loads(answer.message.content), dict | list | str | int | float | bool)


def test_response_format_text_is_plain(api, model):
    assert chat(api, model, response_format={"type": "text"}, max_tokens=8).choices[0].message.content


NAMED = {"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}


def test_a_named_tool_call_follows_its_schema(api, model):
    def one(seed: int):
        prompt = "What's the weather in Paris?"
        return chat(api, model, prompt, max_tokens=120, temperature=0.7, seed=seed, **NAMED).choices[0]

    with ThreadPoolExecutor(3) as pool:
        choices = list(pool.map(one, range(3)))
    for choice in choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_named_tool_call_streamed(api, model):
    chunks = stream_chat(api, model, "What's the weather in Paris?", max_tokens=120, **NAMED)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = chat(api, model, "What's the weather in Paris?", max_tokens=120, **NAMED).choices[0]
    assert whole.message.tool_calls[0].function.arguments == arguments  # greedy: the same call


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required(api, model, stream):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    options = {"tools": [WEATHER, ADD], "tool_choice": "required", "max_tokens": 150}
    if stream:
        chunks = stream_chat(api, model, "What is 2 plus 3?", **options)
        calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = chat(api, model, "What is 2 plus 3?", **options).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
        assert choice.message.content is None
    assert finish == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_answers_content_or_parsed_calls(api, model, stream):
    names = {"get_weather"}

    def one(prompt: str):
        if stream:
            chunks = stream_chat(api, model, prompt, tools=[WEATHER], max_tokens=48)
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
            return content, calls, chunks[-1].choices[0].finish_reason
        choice = chat(api, model, prompt, tools=[WEATHER], max_tokens=48).choices[0]
        return choice.message.content, choice.message.tool_calls or [], choice.finish_reason

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(one, ("What's the weather in Paris?", "Hello, how are you?")))
    for content, calls, finish in answers:
        if calls:
            assert finish == "tool_calls"
            for call in calls:
                assert call.function.name in names and isinstance(json.loads(call.function.arguments), dict)
        else:
            assert content and finish in ("stop", "length")


def test_a_conversation_with_a_tool_result(api, model):
    messages = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    answer = api.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=40)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def completion_text(api, model, prompt, **options) -> str:
    return api.completions.create(model=model, prompt=prompt, **options).choices[0].text


REPEATING = "Paris Paris Paris Paris Paris Paris"  # greedy: the same line twice


@pytest.mark.parametrize(
    "control",
    [
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 1.8}},
    ],
)
def test_penalties_take_effect(api, model, control):
    plain = completion_text(api, model, REPEATING, max_tokens=16)
    penalized = completion_text(api, model, REPEATING, max_tokens=16, **control)
    assert penalized != plain
    assert max(Counter(penalized.split()).values()) < max(Counter(plain.split()).values()), (plain, penalized)


def test_top_k_one_is_greedy_whatever_the_temperature(api, model):
    greedy = completion_text(api, model, "Once upon a time", max_tokens=16)
    for seed in range(2):
        options = {"temperature": 1.8, "seed": seed, "extra_body": {"top_k": 1}}
        assert completion_text(api, model, "Once upon a time", max_tokens=16, **options) == greedy
    sampled = {
        completion_text(
            api, model, "Once upon a time", max_tokens=16, temperature=1.8, seed=s, extra_body={"top_k": 50}
        )
        for s in range(3)
    }
    assert sampled != {greedy}


def test_logit_bias_changes_the_greedy_first_token(api, model, tokenizer, hf_model):
    prompt = "The capital of France is"
    with torch.no_grad():
        first_id = int(hf_model(torch.tensor([tokenizer(prompt)["input_ids"]])).logits[0, -1].argmax())
    first = tokenizer.decode([first_id])
    plain = api.completions.create(model=model, prompt=prompt, max_tokens=1, logprobs=0).choices[0]
    assert plain.logprobs.tokens == [first]
    banned = api.completions.create(
        model=model, prompt=prompt, max_tokens=1, logprobs=0, logit_bias={str(first_id): -100}
    )
    assert banned.choices[0].logprobs.tokens != [first]
    forced_id = tokenizer(" zebra", add_special_tokens=False)["input_ids"][0]
    forced = api.completions.create(model=model, prompt=prompt, max_tokens=1, logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == tokenizer.decode([forced_id])
    streamed = stream_chat(api, model, max_tokens=1, logit_bias={str(forced_id): 100})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == tokenizer.decode([forced_id])


SHORT = "What is 2+2? Answer with a number only."  # greedy: "2 + 2 = 4", then the end


def test_min_tokens_holds_off_the_end(api, model):
    short = chat(api, model, SHORT, max_tokens=64)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    longer = chat(api, model, SHORT, max_tokens=64, extra_body={"min_tokens": 20})
    assert longer.usage.completion_tokens >= 20


def test_ignore_eos_generates_max_tokens(api, model):
    answer = chat(api, model, SHORT, max_tokens=30, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 30 and answer.choices[0].finish_reason == "length"


def test_echo_prepends_the_prompt(api, model):
    prompt = "The three primary colors are"
    plain = completion_text(api, model, prompt, max_tokens=8)
    assert completion_text(api, model, prompt, max_tokens=8, echo=True) == prompt + plain
    chunks = [
        c for c in api.completions.create(model=model, prompt=prompt, max_tokens=8, echo=True, stream=True) if c.choices
    ]
    assert chunks[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in chunks) == prompt + plain


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda api, m: api.completions.create(model=m, prompt="Hi", echo=True, logprobs=1), "echo"),
        (lambda api, m: api.completions.create(model=m, prompt="Hi", logprobs=6), "logprobs"),
        (lambda api, m: chat(api, m, logprobs=True, top_logprobs=21), "top_logprobs"),
        (lambda api, m: chat(api, m, top_logprobs=2), "top_logprobs"),
        (lambda api, m: chat(api, m, presence_penalty=2.5), "presence_penalty"),
        (lambda api, m: chat(api, m, frequency_penalty=-3), "frequency_penalty"),
        (lambda api, m: chat(api, m, logit_bias={"49152": 1}), "logit_bias"),
        (lambda api, m: chat(api, m, logit_bias={"5": 150}), "logit_bias"),
        (lambda api, m: chat(api, m, extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        (lambda api, m: chat(api, m, max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens"),
        (lambda api, m: chat(api, m, extra_body={"top_k": -2}), "top_k"),
        (lambda api, m: chat(api, m, extra_body={"frobnicate": True}), "frobnicate"),
        (lambda api, m: chat(api, m, tool_choice="required"), "tool_choice"),
        (
            lambda api, m: chat(api, m, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
            "tool_choice",
        ),
        (
            lambda api, m: chat(
                api, m, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}
            ),
            "response_format",
        ),
        (lambda api, m: chat(api, m, modalities=["text", "audio"]), "modalities"),
    ],
)
def test_unsupported_values_are_400_naming_the_parameter(api, model, call, param):
    with pytest.raises(openai.BadRequestError) as err:
        call(api, model)
    assert err.value.body["param"] == param and param in err.value.body["message"]


def test_a_guide_the_engine_refuses_is_400(api, model):
    with pytest.raises(openai.BadRequestError) as err:
        chat(api, model, max_tokens=4, extra_body={"guided_regex": "(unclosed"})
    assert err.value.body["type"] == "invalid_request_error"


def test_usage_with_n_and_include_usage(api, model):
    chunks = list(chat(api, model, n=3, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"] * 3
    single = chat(api, model, max_tokens=6)
    assert chunks[-1].usage.prompt_tokens == single.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 18
