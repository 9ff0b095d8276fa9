"""OpenAI request bodies, as pydantic models: what the gateway accepts and how it checks it.

Validation is strict, as OpenAI's is: ``"stream": "yes"`` or ``"max_tokens": "5"`` are
wrong types, not values to coerce. Text must be valid Unicode: JSON can carry a lone
UTF-16 surrogate (``"\\ud800"``), which no tokenizer can encode, so it is refused with
the field it was found in.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Stop = Annotated[str | list[str] | None, Field(None)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string under ``value`` that holds a lone surrogate, if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := _lone_surrogate(item, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None


class RequestBody(BaseModel):
    """A request body of any of the APIs: strict types, unknown fields ignored, every string valid Unicode."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if (where := _lone_surrogate(data, "")) is not None:
            raise ValueError(f"{where} holds a lone UTF-16 surrogate, which is not valid Unicode text")
        return data


class _Common(RequestBody):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16, description="Choices sampled from the one evaluated prompt.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: int | None = Field(None, ge=0, lt=2**32)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    prompt_cache_key: str | None = Field(
        None, max_length=1024, description="Requests that share a prefix and this key are routed to one worker while none holds it."
    )
    top_k: int = Field(40, ge=0, description="kvpool extension: llama.cpp's top-k.")
    min_p: float = Field(0.05, ge=0.0, le=1.0, description="kvpool extension: llama.cpp's min-p.")
    repeat_penalty: float = Field(1.0, gt=0.0, description="kvpool extension: llama.cpp's repeat penalty.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not k.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError("logit_bias values lie in [-100, 100]")
        return v


MAX_PROMPTS = 32
"""Most prompts one completion request may carry; each becomes its own job."""


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        prompts = self.prompts()
        if not prompts:
            raise ValueError("prompt must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError("prompt must not be empty" if len(prompts) == 1 else f"prompt {i} is empty")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        if self.echo and self.logprobs is not None and self.stream:
            raise ValueError("echo with logprobs is not supported when streaming; ask for the whole response")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        many: list[str | list[int]] = [x for x in p if not isinstance(x, int)]
        return many or [[x for x in p if isinstance(x, int)]]  # a list of prompts, else one prompt of token ids


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = Field("response", pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``; the JSON kinds are enforced by a grammar (`gateway.structured`)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a json_schema object")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str = Field(description="The arguments, as a JSON object in a string (as OpenAI sends them).")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if self.tool_choice not in (None, "auto", "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(
                f"tool_choice names the function {self.tool_choice.function.name!r}, which is not among the tools ({', '.join(names)})"
            )
        if self.forced_tools() and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("a required or named tool_choice cannot be combined with a JSON response_format")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def tools_offered(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice not in (None, "auto", "none")

    def token_budget(self, default: int) -> int:
        for v in (self.max_completion_tokens, self.max_tokens):
            if v is not None:
                return v
        return default
