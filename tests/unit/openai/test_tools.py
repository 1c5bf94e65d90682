"""Unit: the Hermes tool-call format: prompt rendering, the parser (well-formed and malformed answers), its
streaming form, and the grammars of forced calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tritonllm.openai.tools import (
    HermesStream,
    hermes_messages,
    parse_call,
    parse_hermes,
    required_schema,
    template_renders_tools,
)

NAMES = {"get_weather", "add"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


def calls(text: str) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parse_hermes(text, NAMES)[1]]


def test_a_call_alone():
    content, found = parse_hermes(f"<tool_call>\n{WEATHER}\n</tool_call>", NAMES)
    assert content is None
    assert [c["type"] for c in found] == ["function"] and found[0]["id"].startswith("call_")
    assert calls(f"<tool_call>\n{WEATHER}\n</tool_call>") == [("get_weather", {"city": "Paris"})]


def test_text_around_calls_is_the_content_trimmed_next_to_the_calls():
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{ADD}</tool_call>\n Done. "
    content, _ = parse_hermes(text, NAMES)
    assert content == "Let me check.\nDone."
    assert calls(text) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]


def test_an_unclosed_call_at_the_end_still_counts():
    assert calls(f"<tool_call>\n{WEATHER}") == [("get_weather", {"city": "Paris"})]


def test_arguments_as_a_json_string_or_parameters_are_read():
    assert calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>') == [("add", {"a": 1})]
    assert calls('<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>') == [("add", {"a": 1})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is sunny.",
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not an offered function
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>["get_weather"]</tool_call>',
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
        '<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call>',
        "<tool_call>",
        "",
    ],
)
def test_malformed_calls_stay_content_as_written(text):
    assert parse_hermes(text, NAMES) == (text, [])


def test_a_malformed_call_beside_a_good_one_stays_in_the_content():
    text = f"<tool_call>oops</tool_call> then <tool_call>{ADD}</tool_call>"
    content, found = parse_hermes(text, NAMES)
    assert content == "<tool_call>oops</tool_call> then" and len(found) == 1


def test_parse_call_of_a_required_answer():
    call = parse_call(ADD, NAMES)
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert parse_call('{"name": "add", "arguments": {"a": ', NAMES) is None


TEXTS = [
    "Plain answer with trailing space. ",
    "  leading space",
    f"Let me check.\n\n<tool_call>\n{WEATHER}\n</tool_call>",
    f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>\nDone.",
    f"<tool_call>oops</tool_call> then <tool_call>{ADD}</tool_call> after",
    "Compare a<b and <tool_ca but no call.",
    "<tool_call>broken",
    f"a <tool_call>{WEATHER}</tool_call> b <tool_call>{ADD}</tool_call> c",
    "<tool",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streaming_emits_what_parsing_the_whole_text_gives(text, size):
    stream = HermesStream(NAMES)
    emitted = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size))
    rest, found = stream.finish()
    content, expected = parse_hermes(text, NAMES)
    assert emitted + rest == (content or "")
    assert [c["function"] for c in found] == [c["function"] for c in expected]


def test_streaming_passes_plain_text_on_at_once():
    stream = HermesStream(NAMES)
    assert stream.feed("Hello") == "Hello"
    assert stream.feed(" world <tool") == " world"  # "<tool" may begin a call; the space before it may be trimmed
    assert stream.feed("kit>") == " <toolkit>"


def test_required_schema_accepts_exactly_a_call_of_an_offered_function():
    functions = [
        {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
        {"name": "now"},
    ]
    schema = required_schema(functions)
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, schema)
    jsonschema.validate({"name": "now", "arguments": {}}, schema)
    for bad in ({"name": "get_weather", "arguments": {}}, {"name": "other", "arguments": {}}, {"name": "now"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_hermes_messages_offer_the_tools_in_the_system_prompt():
    out = hermes_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], TOOLS)
    assert [m["role"] for m in out] == ["system", "user"]
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools")
    assert f"<tools>\n{json.dumps(TOOLS[0])}\n</tools>" in system and "<tool_call>" in system
    assert hermes_messages([{"role": "user", "content": "Hi"}], TOOLS)[0]["content"].startswith("# Tools")
    assert hermes_messages([{"role": "user", "content": "Hi"}], []) == [{"role": "user", "content": "Hi"}]


def test_hermes_messages_render_calls_and_results():
    call = {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    out = hermes_messages(
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "", "tool_calls": [call, call]},
            {"role": "tool", "content": "sunny", "tool_call_id": "1"},
            {"role": "tool", "content": "rain", "tool_call_id": "2"},
            {"role": "assistant", "content": "Sunny, and rain."},
        ],
        [],
    )
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant"]
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert out[1]["content"] == f"{one}\n{one}"
    assert out[2]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)


def test_which_templates_render_tools():
    assert template_renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_renders_tools("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not template_renders_tools(None)
