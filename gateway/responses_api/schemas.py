"""The Responses API's request body and its input items, checked strictly and named by their path on error.

The body is a pydantic model like the chat request's (`gateway.schemas`). Items, tools and
``tool_choice`` are checked here by hand rather than as pydantic unions: a union reports
every branch that failed, and a client deserves one message that names the item and field
at fault (``input.3.type: ...``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.errors import InvalidRequest
from gateway.schemas import FUNCTION_NAME, MAX_TOOLS, RequestBody

MAX_ITEMS = 2048
"""Most input items one request may carry."""


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("a format of type 'json_schema' needs a name and a schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    format: TextFormat | None = None


class ResponseCreate(RequestBody):
    """``POST /v1/responses``: what kvpool reads; other fields of OpenAI's are ignored or refused (`refused`)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=128)
    store: bool = True
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    prompt_cache_key: str | None = Field(None, max_length=1024)
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    seed: int | None = Field(None, ge=0, lt=2**32, description="kvpool extension: the sampler's seed.")

    @field_validator("input")
    @classmethod
    def _some_items(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(v, list) and not v:
            raise ValueError("input must hold at least one item")
        if isinstance(v, list) and len(v) > MAX_ITEMS:
            raise ValueError(f"at most {MAX_ITEMS} input items per request")
        return v

    def refused(self) -> None:
        """Fields kvpool cannot honour: a 400 naming each, rather than an answer that silently ignores it."""
        if self.truncation == "auto":
            raise InvalidRequest(
                "truncation 'auto' is not supported: kvpool never drops part of a conversation; an input beyond the context is a 400",
                param="truncation",
            )
        if self.background:
            raise InvalidRequest("background responses are not supported; stream instead", param="background")
        if self.conversation is not None:
            raise InvalidRequest("the Conversations API is not supported; chain responses with previous_response_id", param="conversation")
        if self.prompt is not None:
            raise InvalidRequest("stored prompt templates are not supported; send instructions and input", param="prompt")


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    id: str | None = Field(None, max_length=128)
    status: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str
    namespace: str | None = Field(None, max_length=128, description="The namespace tool the function belongs to (Codex's).")


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str | None = Field(None, min_length=1, max_length=128)
    """None: Codex sends some outputs with the function's name instead; they answer that function's last call (`resolve_outputs`)."""
    output: str | list[ContentPart]
    name: str | None = Field(None, max_length=128)
    namespace: str | None = Field(None, max_length=128)

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEM_TYPES: dict[str, type[MessageItem] | type[FunctionCallItem] | type[FunctionCallOutputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}
REFUSED_TYPES = {
    "input_image": "image input is not supported: the model reads text only",
    "input_file": "file input is not supported: the model reads text only",
    "input_audio": "audio input is not supported: the model reads text only",
    "reasoning": "reasoning items are not supported: the model does not reason in a separate channel",
    "item_reference": "item references are not supported; send the item itself, or chain with previous_response_id",
}


def _where(prefix: str, e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    return f"{prefix}.{loc}: {err.get('msg', 'invalid')}" if loc else f"{prefix}: {err.get('msg', 'invalid')}"


def parse_items(raw: str | list[dict[str, Any]]) -> list[Item]:
    """The request's input as items; a string is one user message. 400 naming ``input.<i>.<field>`` on the first bad one."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    items: list[Item] = []
    for i, doc in enumerate(raw):
        kind = doc.get("type", "message" if "role" in doc else None)
        if not isinstance(kind, str):
            raise InvalidRequest(f"input.{i}.type: an item needs a type (or a role, for a message)", param="input")
        if kind in REFUSED_TYPES:
            raise InvalidRequest(f"input.{i}.type: {REFUSED_TYPES[kind]}", param="input")
        if kind not in ITEM_TYPES:
            known = ", ".join(ITEM_TYPES)
            raise InvalidRequest(f"input.{i}.type: unknown item type {kind!r} (kvpool takes {known})", param="input")
        parts = doc.get("content")
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            if isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] in REFUSED_TYPES:
                raise InvalidRequest(f"input.{i}.content.{j}.type: {REFUSED_TYPES[part['type']]}", param="input")
        try:
            items.append(ITEM_TYPES[kind].model_validate({**doc, "type": kind}))
        except ValidationError as e:
            raise InvalidRequest(_where(f"input.{i}", e), param="input") from None
    return items


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


BUILT_IN = frozenset(
    {
        "web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search", "code_interpreter", "computer_use_preview",
        "image_generation", "local_shell", "mcp", "custom", "tool_search", "apply_patch", "shell",
    }
)  # fmt: skip
"""Tool types the API runs itself (or that hold no JSON Schema): kvpool cannot run them, so they are left out of the prompt."""


@dataclass
class Tools:
    """The function tools a request offers the model, whose namespace each belongs to, and the tools left out."""

    functions: list[FunctionTool] = field(default_factory=list)
    namespaces: dict[str, str] = field(default_factory=dict)
    """Function name to its namespace tool's name, for the functions a ``namespace`` tool holds."""
    left_out: list[str] = field(default_factory=list)
    """The type of each built-in tool left out, in order."""
    paths: list[str] = field(default_factory=list)
    """Where the request holds each function (``tools.4.tools.0`` for one in a namespace), for error messages."""


def parse_tools(raw: list[dict[str, Any]] | None) -> Tools:
    """Function tools as they are, a ``namespace`` tool as the functions it holds; built-in tools left out (`BUILT_IN`)."""
    tools = Tools()
    for i, doc in enumerate(raw or []):
        kind = doc.get("type")
        if kind == "namespace" and isinstance(doc.get("tools"), list) and isinstance(doc.get("name"), str):
            for j, inner in enumerate(doc["tools"]):
                tools.functions.append(_function(inner, f"tools.{i}.tools.{j}"))
                tools.namespaces[tools.functions[-1].name] = doc["name"]
                tools.paths.append(f"tools.{i}.tools.{j}")
        elif kind in BUILT_IN:
            tools.left_out.append(str(kind))
        elif kind == "function":
            tools.functions.append(_function(doc, f"tools.{i}"))
            tools.paths.append(f"tools.{i}")
        else:
            raise InvalidRequest(
                f"tools.{i}.type: {kind!r} tools are not supported: kvpool serves function tools (and namespaces of them)",
                param="tools",
            )
    return tools


def _function(doc: Any, where: str) -> FunctionTool:
    if not isinstance(doc, dict) or doc.get("type") != "function":
        got = doc.get("type") if isinstance(doc, dict) else type(doc).__name__
        raise InvalidRequest(f"{where}.type: a namespace holds function tools, got {got!r}", param="tools")
    try:
        return FunctionTool.model_validate(doc)
    except ValidationError as e:
        raise InvalidRequest(_where(where, e), param="tools") from None


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``tool_choice`` in the chat API's terms (a named function nests its name under ``function``)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}; built-in and allowed_tools choices "
        "are not supported",
        param="tool_choice",
    )
