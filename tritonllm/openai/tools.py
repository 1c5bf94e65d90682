"""Tool calling: the prompt that offers the tools, the grammars of forced calls, and the parser of the answers.

A chat template that renders `tools` itself is used as it is. Otherwise (SmolLM2's has none) the tools are
offered in the Hermes format, that of Qwen2.5's template, which many small models were trained on: a system
prompt lists them inside <tools></tools>, and the model calls one by answering
<tool_call>{"name": ..., "arguments": {...}}</tool_call>; earlier calls are rendered the same way, and tool
results as a user turn of <tool_response></tool_response> blocks. The answers of `tool_choice` "auto" are
parsed in that format whichever template rendered the prompt (Qwen2.5's, Hermes', and the fallback's).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

START, END = "<tool_call>", "</tool_call>"
TOOL_CALL = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.DOTALL)

TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def parameters(function: dict) -> dict:
    """A function's parameters schema; OpenAI lets a function without parameters take none."""
    return function.get("parameters") or EMPTY_PARAMETERS


def required_schema(functions: list[dict]) -> dict:
    """tool_choice "required": one call of any of the functions, {"name": ..., "arguments": {...}}."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": parameters(f)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
    }


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template takes `tools` (as transformers' apply_chat_template passes them)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation with its tools, earlier calls and tool results written as text in the Hermes format,
    for a template that knows only system, user and assistant turns."""
    out: list[dict] = []
    if tools:
        listing = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{listing}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": listing})
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                f"{START}\n{json.dumps(call_json(c['function']), ensure_ascii=False)}\n{END}"
                for c in message["tool_calls"]
            ]
            out.append({"role": "assistant", "content": "\n".join([content, *calls] if content else calls)})
        elif role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results: one user turn, as Qwen2.5's template
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
        else:
            out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def call_json(function: dict) -> dict:
    return {"name": function["name"], "arguments": function["arguments"]}


def tool_call(name: str, arguments: str) -> dict:
    """A tool call in OpenAI's format."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_call(text: str, names: set[str]) -> dict | None:
    """One call, {"name": ..., "arguments": {...}}, as a tool call; None when it is not one of `names`'."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    args: Any = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return tool_call(call["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """An answer's content and tool calls. Without a well-formed call of an offered function the whole
    text is the content; otherwise the content is the text around the calls, trimmed next to them (None if
    empty). A malformed or unknown call stays in the content as written."""
    calls, segments, position = [], [], 0
    for match in TOOL_CALL.finditer(text):
        call = parse_call(match.group(1).strip(), names)
        if call is None:
            continue
        segments.append(text[position : match.start()])
        calls.append(call)
        position = match.end()
    if not calls:
        return text, []
    segments.append(text[position:])
    return join_segments(segments), calls


def join_segments(segments: list[str]) -> str | None:
    parts = [segments[0].rstrip(), *(s.strip() for s in segments[1:])]
    return "\n".join(p for p in parts if p) or None


class HermesStream:
    """parse_hermes over a stream of text deltas. Content is passed on as it comes, except what may begin a
    tool call or trail before one (held until it is known); from the first <tool_call> on, the rest is
    parsed at the end. What it emits, joined, equals parse_hermes' content for the whole text."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.sent = ""  # content emitted so far: a prefix of the text, never ending in whitespace
        self.held = ""  # the rest of the text so far
        self.calling = False  # a <tool_call> has begun

    def feed(self, delta: str) -> str:
        """The content that can be emitted now."""
        self.held += delta
        if self.calling:
            return ""
        start = self.held.find(START)
        if start >= 0:
            self.calling = True
        else:
            start = len(self.held) - partial_start(self.held)
        keep = len(self.held[:start].rstrip())  # whitespace before a call is trimmed
        out, self.held = self.held[:keep], self.held[keep:]
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The content still to emit, and the tool calls."""
        content, calls = parse_hermes(self.sent + self.held, self.names)
        if not calls:
            return self.held, []
        return (content or "")[len(self.sent) :], calls


def partial_start(text: str) -> int:
    """The length of the longest end of `text` that begins <tool_call>."""
    for size in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-size:]):
            return size
    return 0
