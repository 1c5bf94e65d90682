"""Unit: the endpoints through the official `openai` client, in-process, with a stand-in Triton (conftest.py):
log probabilities in both formats, echo, tool calls streamed and not, usage, and refusals naming the parameter."""

from __future__ import annotations

import json

import openai
import pytest

from tests.unit.openai.conftest import MODEL, FakeTriton, answer_of, make_layer, make_tokenizer, response, token

USER = [{"role": "user", "content": "Hello"}]
HELLO, WORLD, PARIS = token("Hello"), token("world"), token("Paris")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {"type": "function", "function": {"name": "add"}}


def with_log_probs(tensors: dict) -> list[dict]:
    """Two tokens in two responses; the first has its text held back (as the detokenizer may), the second
    brings both tokens' text."""
    return [
        response("", [HELLO], [-0.5], [[(HELLO, -0.5), (WORLD, -1.5), (PARIS, -2.0)]]),
        response("Hello world", [WORLD], [-0.25], [[(WORLD, -0.25), (HELLO, -2.5), (PARIS, -3.0)]]),
        response(finish_reason="length"),
    ]


def chat(layer, **options):
    return layer(lambda client: client.chat.completions.create(model=MODEL, messages=USER, **options))


def stream_chat(layer, **options) -> list:
    async def run(client):
        stream = await client.chat.completions.create(model=MODEL, messages=USER, stream=True, **options)
        return [chunk async for chunk in stream]

    return layer(run)


def refused(layer, function, param: str) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        layer(function)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    return err.value


def test_chat_logprobs(layer, triton):
    triton.script = with_log_probs
    answer = chat(layer, logprobs=True, top_logprobs=2, max_tokens=2)
    request = triton.requests[0]
    assert request["return_log_probs"][0, 0] and request["num_top_log_probs"][0, 0] == 2
    content = answer.choices[0].logprobs.content
    assert [(e.token, e.logprob, e.bytes) for e in content] == [
        ("Hello", -0.5, list(b"Hello")),
        ("world", -0.25, list(b"world")),
    ]
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in content] == [
        [("Hello", -0.5), ("world", -1.5), ("Paris", -2.0)],
        [("world", -0.25), ("Hello", -2.5), ("Paris", -3.0)],
    ]  # as many as the engine sent, most likely first


def test_chat_logprobs_streamed_come_with_the_chunk_of_their_tokens(layer, triton):
    triton.script = with_log_probs
    chunks = stream_chat(layer, logprobs=True, top_logprobs=3, max_tokens=2)
    carrying = [c for c in chunks if c.choices and c.choices[0].logprobs]
    assert [[e.token for e in c.choices[0].logprobs.content] for c in carrying] == [["Hello"], ["world"]]
    assert carrying[0].choices[0].delta.content is None  # its text was held back
    assert carrying[1].choices[0].delta.content == "Hello world"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_no_logprobs_unless_asked(layer, triton):
    triton.script = with_log_probs
    assert chat(layer).choices[0].logprobs is None
    assert "return_log_probs" not in triton.requests[0]


def test_non_finite_log_probs_are_openais_floor(layer, triton):
    triton.script = lambda t: [response("Hello", [HELLO], [float("-inf")]), response(finish_reason="eos")]
    assert chat(layer, logprobs=True).choices[0].logprobs.content[0].logprob == -9999.0


def completion(layer, **options):
    return layer(lambda client: client.completions.create(model=MODEL, prompt="Paris is", **options))


def test_completion_logprobs(layer, triton):
    triton.script = with_log_probs
    choice = completion(layer, logprobs=1, max_tokens=2).choices[0]
    assert triton.requests[0]["num_top_log_probs"][0, 0] == 1
    assert choice.text == "Hello world"
    assert choice.logprobs.tokens == ["Hello", "world"]
    assert choice.logprobs.token_logprobs == [-0.5, -0.25]
    assert choice.logprobs.text_offset == [0, 5]
    # the engine's top entries, and the chosen token
    assert choice.logprobs.top_logprobs == [
        {"Hello": -0.5, "world": -1.5, "Paris": -2.0},
        {"world": -0.25, "Hello": -2.5, "Paris": -3.0},
    ]


def test_completion_logprobs_zero_gives_the_chosen_tokens(layer, triton):
    triton.script = lambda t: [response("Hello", [HELLO], [-0.5]), response(finish_reason="eos")]
    choice = completion(layer, logprobs=0).choices[0]
    assert "num_top_log_probs" not in triton.requests[0]
    assert choice.logprobs.top_logprobs == [{"Hello": -0.5}]


def test_completion_logprobs_streamed_continue_the_offsets(layer, triton):
    triton.script = with_log_probs

    async def run(client):
        stream = await client.completions.create(model=MODEL, prompt="Paris is", logprobs=2, stream=True, max_tokens=2)
        return [chunk async for chunk in stream]

    chunks = [c for c in layer(run) if c.choices and c.choices[0].logprobs]
    assert [c.choices[0].logprobs.text_offset for c in chunks] == [[0], [5]]
    assert [c.choices[0].logprobs.tokens for c in chunks] == [["Hello"], ["world"]]


def test_echo_prepends_the_prompt(layer, triton):
    assert completion(layer, echo=True).choices[0].text == "Paris isHello world"

    async def run(client):
        stream = await client.completions.create(model=MODEL, prompt=["Paris is", "Hello"], echo=True, stream=True, n=2)
        return [chunk async for chunk in stream]

    chunks = layer(run)
    assert [c.choices[0].text for c in chunks[:4]] == ["Paris is", "Paris is", "Hello", "Hello"]
    texts = {}
    for chunk in chunks:
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert texts == {0: "Paris isHello world", 1: "Paris isHello world", 2: "HelloHello world", 3: "HelloHello world"}


def test_echo_with_logprobs_is_refused_naming_echo(layer, triton):
    for stream in (False, True):
        refused(
            layer,
            lambda client, s=stream: client.completions.create(
                model=MODEL, prompt="Hi", echo=True, logprobs=1, stream=s
            ),
            "echo",
        )
    assert triton.requests == []


def test_usage_asks_for_the_token_counts(layer, triton):
    answer = chat(layer, n=2)
    assert answer.usage.prompt_tokens == 5 and answer.usage.completion_tokens == 4  # the prompt counted once
    for request in triton.requests:
        assert request["return_num_input_tokens"][0, 0] and request["return_num_output_tokens"][0, 0]


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(tokenizer_dir, triton):
    """usage.prompt_tokens_details.cached_tokens: the engine's reused KV cache blocks times the tokens in a
    block, at most the prompt; streamed with include_usage too."""
    layer = make_layer(tokenizer_dir, triton, kv_cache_block_tokens=2)
    triton.script = lambda tensors: [response("Hi"), response(finish_reason="eos", counts=(5, 1), reused_blocks=2)]
    answer = chat(layer)
    assert answer.usage.prompt_tokens_details.cached_tokens == 4
    assert all(request["return_perf_metrics"][0, 0] for request in triton.requests)

    async def streamed(client):
        chunks = await client.completions.create(
            model=MODEL, prompt="Hi", stream=True, stream_options={"include_usage": True}
        )
        return [chunk async for chunk in chunks][-1].usage

    triton.script = lambda tensors: [response(finish_reason="eos", counts=(5, 1), reused_blocks=9)]
    assert layer(streamed).prompt_tokens_details.cached_tokens == 5, "never more than the prompt"
    triton.script = lambda tensors: [response("Hi", finish_reason="eos")]
    assert chat(layer).usage.prompt_tokens_details.cached_tokens == 0


def test_stream_options_without_stream_is_a_400_naming_it(layer, triton):
    """As OpenAI's API answers: `stream_options` is only allowed with `stream` on, on both endpoints, and nothing
    reaches Triton."""
    options = {"stream_options": {"include_usage": True}}
    error = refused(
        layer, lambda client: client.completions.create(model=MODEL, prompt="Hi", **options), "stream_options"
    )
    assert error.body["type"] == "invalid_request_error" and "'stream'" in error.body["message"]
    refused(
        layer, lambda client: client.chat.completions.create(model=MODEL, messages=USER, **options), "stream_options"
    )
    refused(
        layer,
        lambda client: client.chat.completions.create(model=MODEL, messages=USER, stream=False, **options),
        "stream_options",
    )
    assert triton.requests == []


def test_every_control_reaches_triton(layer, triton):
    chat(
        layer,
        presence_penalty=1.5,
        frequency_penalty=-1,
        logit_bias={str(PARIS): -100},
        seed=3,
        max_tokens=8,
        extra_body={"top_k": 5, "min_tokens": 4, "repetition_penalty": 1.3},
    )
    request = triton.requests[0]
    assert request["presence_penalty"][0, 0] == 1.5 and request["frequency_penalty"][0, 0] == -1
    assert request["logit_bias_token_ids"].tolist() == [[PARIS]]
    assert request["logit_bias_weights"].tolist() == [[-100.0]]
    assert request["top_k"][0, 0] == 5 and request["min_tokens"][0, 0] == 4 and request["seed"][0, 0] == 3
    assert request["repetition_penalty"][0, 0] == pytest.approx(1.3)


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"extra_body": {"min_tokens": 9}, "max_tokens": 8}, "min_tokens"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 1}}}},
            "response_format",
        ),
    ],
)
def test_refusals_name_the_parameter(layer, triton, options, param):
    error = refused(layer, lambda client: client.chat.completions.create(model=MODEL, messages=USER, **options), param)
    if param == "frobnicate":
        assert error.body["message"] == "Unrecognized request argument supplied: frobnicate"
    assert triton.requests == []


def test_no_op_parameters_are_accepted(layer):
    assert chat(layer, user="u", metadata={"k": "v"}, store=False, service_tier="auto", parallel_tool_calls=True)


def test_response_format_becomes_the_guide(layer, triton):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat(layer, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    chat(layer, response_format={"type": "json_object"})
    first, second = triton.requests
    assert first["guided_decoding_guide_type"][0, 0] == b"json_schema"
    assert json.loads(first["guided_decoding_guide"][0, 0]) == schema
    assert second["guided_decoding_guide_type"][0, 0] == b"json" and "guided_decoding_guide" not in second


def named(**options):
    return {
        "tools": [WEATHER, ADD],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        **options,
    }


def test_a_named_tool_call(layer, triton):
    triton.script = lambda t: answer_of('{"city":', ' "Paris"}', finish_reason="eos")
    answer = chat(layer, **named())
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    request = triton.requests[0]
    assert request["guided_decoding_guide_type"][0, 0] == b"json_schema"
    assert json.loads(request["guided_decoding_guide"][0, 0]) == WEATHER["function"]["parameters"]
    assert b"<tools>" in request["text_input"][0, 0]  # the prompt offers the tools (Hermes format)


def test_a_named_tool_call_streams_its_arguments(layer, triton):
    triton.script = lambda t: answer_of('{"city":', ' "Paris"}', finish_reason="eos")
    chunks = stream_chat(layer, **named())
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert [d.function.arguments for d in deltas] == ["", '{"city":', ' "Paris"}']
    assert all(d.index == 0 for d in deltas) and all(d.id is None for d in deltas[1:])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_named_call_cut_short_by_max_tokens_finishes_with_length(layer, triton):
    triton.script = lambda t: answer_of('{"city": "Pa', finish_reason="length")
    choice = chat(layer, **named()).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls[0].function.arguments == '{"city": "Pa'


def test_a_required_tool_call(layer, triton):
    triton.script = lambda t: answer_of('{"name": "add",', ' "arguments": {}}')
    choice = chat(layer, tools=[WEATHER, ADD], tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert (choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments) == (
        "add",
        "{}",
    )
    guide = json.loads(triton.requests[0]["guided_decoding_guide"][0, 0])
    assert [option["properties"]["name"] for option in guide["anyOf"]] == [{"const": "get_weather"}, {"const": "add"}]

    chunks = stream_chat(layer, tools=[WEATHER, ADD], tool_choice="required")
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0][0].function.name == "add" and calls[0][0].function.arguments == "{}"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


AUTO_ANSWER = ('Let me look.\n<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_call>')


def test_auto_parses_hermes_calls(layer, triton):
    triton.script = lambda t: answer_of(*AUTO_ANSWER)
    choice = chat(layer, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert "guided_decoding_guide_type" not in triton.requests[0]

    chunks = stream_chat(layer, tools=[WEATHER])
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert content == "Let me look."
    assert [(d[0].index, d[0].function.name, json.loads(d[0].function.arguments)) for d in calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_without_a_call_is_content(layer, triton):
    triton.script = lambda t: answer_of("It is ", "sunny.")
    choice = chat(layer, tools=[WEATHER]).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("It is sunny.", None, "stop")


def test_parallel_tool_calls_false_keeps_the_first(layer, triton):
    call = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    triton.script = lambda t: answer_of(call, call)
    assert len(chat(layer, tools=[ADD]).choices[0].message.tool_calls) == 2
    assert len(chat(layer, tools=[ADD], parallel_tool_calls=False).choices[0].message.tool_calls) == 1


def test_tool_choice_none_offers_no_tools(layer, triton):
    triton.script = lambda t: answer_of(*AUTO_ANSWER)
    choice = chat(layer, tools=[WEATHER], tool_choice="none").choices[0]
    assert choice.message.tool_calls is None and "<tool_call>" in choice.message.content
    assert b"<tools>" not in triton.requests[0]["text_input"][0, 0]


def test_a_conversation_with_tool_calls_and_results(layer, triton):
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    layer(lambda client: client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER]))
    prompt = triton.requests[0]["text_input"][0, 0].decode()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL:{{ c.function | tojson }}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_a_template_with_tool_support_renders_them_itself(tmp_path):
    triton = FakeTriton()
    layer = make_layer(make_tokenizer(tmp_path, TOOL_TEMPLATE), triton)
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "2"},
    ]
    layer(lambda client: client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD]))
    prompt = triton.requests[0]["text_input"][0, 0].decode()
    assert prompt.startswith('TOOLS:[{"type": "function", "function": {"name": "add"}}]')
    assert 'CALL:{"name": "add", "arguments": {"a": 1}}' in prompt and "tool:2" in prompt
    assert "<tools>" not in prompt


def test_an_over_long_prompt_is_refused_naming_what_the_client_sent(layer, triton):
    """Chat names `messages` (also without max_completion_tokens), completions name `prompt`."""
    long = "word " * 600  # over max_input_len 512
    refused(
        layer,
        lambda client: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}]),
        "messages",
    )
    refused(layer, lambda client: client.completions.create(model=MODEL, prompt=long), "prompt")
    assert triton.requests == []


def keyed_status(tokenizer_dir, triton, header: bytes) -> int:
    """The status of GET /v1/models with this Authorization header (none when empty), the layer's key "clef"."""
    import asyncio

    import httpx2

    from tritonllm.openai.app import create_app
    from tritonllm.openai.generation import Generator
    from tritonllm.openai.settings import Settings

    settings = Settings("unused:0", tokenizer_dir, MODEL, max_input_len=512, max_seq_len=1024, api_key="clef")
    generator = Generator(settings)
    generator._client = triton
    app = create_app(settings, generator)

    async def get(value: bytes) -> int:
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
            headers = [(b"authorization", value)] if value else []
            return (await http.get("/v1/models", headers=headers)).status_code

    return asyncio.run(get(header))


@pytest.mark.parametrize(
    "header",
    [b"Bearer \xe9", "Bearer clé".encode(), b"Bearer wrong", b"", b"clef", b"Basic clef", b"Bearerclef", b"Bearer"],
)
def test_a_wrong_api_key_is_401_whatever_bytes_it_holds(tokenizer_dir, triton, header):
    """An HTTP header may carry any byte; compared as text, a non-ASCII one made compare_digest raise (a 500). The
    key alone, without the Bearer scheme, or under another scheme, is no Bearer credential either."""
    assert keyed_status(tokenizer_dir, triton, header) == 401
    assert keyed_status(tokenizer_dir, triton, b"Bearer clef") == 200


@pytest.mark.parametrize("header", [b"bearer clef", b"BEARER clef", b"BeArEr clef", b"Bearer   clef ", b"Bearer\tclef"])
def test_the_bearer_scheme_is_case_insensitive(tokenizer_dir, triton, header):
    """RFC 7235 section 2.1: an authentication scheme is a case-insensitive token (RFC 6750 names it "Bearer"), then
    whitespace, then the credentials."""
    assert keyed_status(tokenizer_dir, triton, header) == 200
