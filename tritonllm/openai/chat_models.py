"""The chat completion request's body: its messages, tools, tool choice and response format, and the guides they
ask for. The parameter policy is models.py's: every body forbids fields it does not know; inside `messages`,
fields other than those a message carries here are ignored, so that an answer's message can be sent back as it
came."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from tritonllm.openai import tools as tooling
from tritonllm.openai.models import INT32_MAX, Body, SamplingRequest, check_schema, invalid
from tritonllm.protocol import MAX_TOP_LOG_PROBS


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # an answer's message, sent back, carries fields of no use here

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # no-op: chat templates do not render it
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return ""
            raise invalid("messages", f"a '{self.role}' message needs content")
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise invalid("messages", f"only text content is supported, got a '{part.get('type')}' part")
            parts.append(part.get("text", ""))
        return "".join(parts)

    def rendered(self) -> dict[str, Any]:
        """The message as chat templates take it: developer as system, tool-call arguments as objects."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments(call.function.arguments)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def arguments(text: str) -> Any:
    """Tool-call arguments as templates render them: the JSON object, or the text when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # no-op: named and required tool calls always follow the schema


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(Body):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # no-op: the grammar always follows the schema


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOG_PROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most the first parsed tool call (auto)

    audio: dict | None = None
    modalities: list[str] | None = None
    prediction: dict | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    web_search_options: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    moderation: dict | None = None
    prompt_cache_options: dict | None = None

    def check_supported(self, vocab_size: int, engine_additions: bool = True) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "needs 'logprobs': true")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise invalid("tool_choice", "needs 'tools'")
        if isinstance(self.tool_choice, NamedToolChoice) and self.named_tool() is None:
            raise invalid("tool_choice", f"names the function '{self.tool_choice.function.name}', not in 'tools'")
        for i, tool in enumerate(self.tools or []):
            check_schema(tooling.parameters(tool.function.model_dump()), f"tools[{i}].function.parameters")
        super().check_supported(vocab_size, engine_additions)

    TOP_LOG_PROBS: ClassVar[str] = "top_logprobs"

    def log_probs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_mode(self) -> str:
        """ "none" (no tools offered), "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def named_tool(self) -> dict | None:
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        name = self.tool_choice.function.name
        return next((t.function.model_dump() for t in self.tools or [] if t.function.name == name), None)

    def offered_tools(self) -> list[dict]:
        """The tools as the prompt shows them (OpenAI's format); none when tool_choice is "none"."""
        if self.tool_mode() == "none":
            return []
        return [tool.model_dump(exclude_none=True, by_alias=True) for tool in self.tools or []]

    def guides(self) -> list[tuple[str, tuple[str, str]]]:
        guides = []
        mode = self.tool_mode()
        if mode == "named":
            guides.append(("tool_choice", ("json_schema", json.dumps(tooling.parameters(self.named_tool())))))
        elif mode == "required":
            functions = [t.function.model_dump() for t in self.tools or []]
            guides.append(("tool_choice", ("json_schema", json.dumps(tooling.required_schema(functions)))))
        form = self.response_format
        if form is not None and form.type == "json_object":
            guides.append(("response_format", ("json", "")))
        elif form is not None and form.type == "json_schema":
            if form.json_schema is None:
                raise invalid("response_format", "type 'json_schema' needs 'json_schema'")
            schema = form.json_schema.schema_
            if schema is None:
                guides.append(("response_format", ("json", "")))
            else:
                check_schema(schema, "response_format")
                guides.append(("response_format", ("json_schema", json.dumps(schema))))
        return guides + super().guides()
