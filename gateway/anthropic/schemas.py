"""Anthropic Messages request bodies, as pydantic models: what ``/v1/messages`` and its token counter accept.

Strict as the OpenAI models are (`gateway.schemas`): wrong types are refused, not
coerced, and text must be valid Unicode. Blocks are told apart by their ``type``; a type
kvpool knows but cannot serve (images, documents, server tools' results) passes
validation and is refused by the conversion, which names it (`gateway.anthropic.convert`).
Fields of the API that change nothing here (``thinking``, ``service_tier``,
``container``, ...) are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.schemas import FUNCTION_NAME, MAX_TOOLS, RequestBody

TTL_S = {"5m": 300, "1h": 3600}
MAX_CACHE_CONTROLS = 4
"""Blocks a request may mark with ``cache_control`` (the top-level one included), as in Anthropic's API."""
MAX_STOP_SEQUENCES = 16
UNSUPPORTED_BLOCKS = (
    "image",
    "document",
    "search_result",
    "container_upload",
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "mcp_tool_use",
    "mcp_tool_result",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class _Block(_Strict):
    cache_control: CacheControl | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=FUNCTION_NAME)
    input: dict[str, Any]


class ToolResultText(_Strict):
    type: Literal["text"]
    text: str


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[ToolResultContent] = ""
    is_error: bool = False


class ThinkingBlock(_Block):
    """An earlier turn's thinking: dropped, as Anthropic drops it from earlier turns (this model never thinks)."""

    type: Literal["thinking", "redacted_thinking"]


class OtherBlock(_Block):
    """A block kvpool knows but cannot serve; refused by name in the conversion."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal[UNSUPPORTED_BLOCKS]  # type: ignore[valid-type]


ToolResultContent = Annotated[ToolResultText | OtherBlock, Field(discriminator="type")]
ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | OtherBlock, Field(discriminator="type")]
ToolResultBlock.model_rebuild()


class InputMessage(_Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any] | None = Field(None, description="Required of a client tool (`gateway.anthropic.convert` says so).")
    type: str | None = Field(None, description="'custom' (or none) for a client tool; server tools are not supported.")
    cache_control: CacheControl | None = None
    strict: bool | None = None


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=256)


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    format: OutputFormat | None = None


class CountTokensRequest(RequestBody):
    """``POST /v1/messages/count_tokens``: what the prompt of a message request would be."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = Field(None, description="Marks the request's last block: the whole prompt is kept.")
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _tools(self) -> CountTokensRequest:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: tool names must be unique")
        if isinstance(self.tool_choice, ToolChoiceTool) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice.name: {self.tool_choice.name!r} is not among the tools ({', '.join(names) or 'none given'})")
        if isinstance(self.tool_choice, ToolChoiceAny) and not names:
            raise ValueError("tool_choice: 'any' needs tools")
        return self


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=0, description="Required, as in Anthropic's API; 0 only fills the cache (with cache_control).")
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
