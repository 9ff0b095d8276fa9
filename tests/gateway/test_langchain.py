"""langchain-openai's ChatOpenAI against a real pool: structured output three ways, tools, a streamed tool call."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from tests.helpers import SMOL

langchain_openai = pytest.importorskip("langchain_openai")


class City(BaseModel):
    """A city and the country it lies in."""

    name: str = Field(max_length=40, description="The city's name")
    country: str = Field(max_length=40, description="The country the city lies in")
    is_capital: bool = Field(description="Whether it is the country's capital")


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=40, description="The city, e.g. Paris")


@pytest.fixture
def chat(smol_tools_pool) -> langchain_openai.ChatOpenAI:
    return langchain_openai.ChatOpenAI(
        model=SMOL,
        base_url=smol_tools_pool.url + "/v1",
        api_key=smol_tools_pool.api_key,
        temperature=0,
        max_tokens=120,
        max_retries=0,
        timeout=120,
    )


QUESTION = "Tell me about Paris, the capital of France."


def test_invoke_stream_and_batch(chat) -> None:
    answer = chat.invoke("Say hello.")
    assert answer.content and answer.usage_metadata["input_tokens"] > 0
    assert "".join(c.content for c in chat.stream("Say hello.")) == answer.content
    assert [m.content for m in chat.batch(["Say hello.", "Say hello."])] == [answer.content] * 2


def test_structured_output_by_json_schema(chat) -> None:
    city = chat.with_structured_output(City, method="json_schema").invoke(QUESTION)
    assert isinstance(city, City) and "paris" in city.name.lower()


def test_structured_output_by_json_mode(chat) -> None:
    doc = chat.with_structured_output(City.model_json_schema(), method="json_mode").invoke(QUESTION + " Answer in JSON.")
    assert isinstance(doc, dict) and doc


def test_structured_output_by_function_calling(chat) -> None:
    city = chat.with_structured_output(City, method="function_calling").invoke(QUESTION)
    assert isinstance(city, City) and "paris" in city.name.lower()


def test_bind_tools_gives_tool_calls(chat) -> None:
    message = chat.bind_tools([GetWeather], tool_choice="any").invoke("What is the weather in Paris?")
    assert message.tool_calls and {c["name"] for c in message.tool_calls} == {"GetWeather"}  # parallel calls are allowed
    assert "paris" in message.tool_calls[0]["args"]["city"].lower()
    assert message.tool_calls[0]["id"].startswith("call_")


def test_a_streamed_tool_call(chat) -> None:
    bound = chat.bind_tools([GetWeather], tool_choice="GetWeather", parallel_tool_calls=False)
    gathered = None
    chunks = 0
    for chunk in bound.stream("What is the weather in Rome?"):
        gathered = chunk if gathered is None else gathered + chunk
        chunks += 1
    assert chunks > 1 and gathered is not None
    assert [c["name"] for c in gathered.tool_calls] == ["GetWeather"]
    assert "rome" in gathered.tool_calls[0]["args"]["city"].lower()
    assert gathered.response_metadata.get("finish_reason") == "tool_calls"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_bind_tools_on_the_default_model_gives_a_tool_call(smol_pool) -> None:
    """SmolLM2 as it ships (a ChatML template without tools): no template file to set."""
    chat = langchain_openai.ChatOpenAI(
        model=SMOL, base_url=smol_pool.url + "/v1", api_key=smol_pool.api_key, temperature=0, max_retries=0, timeout=120
    )
    message = chat.bind_tools([add], tool_choice="any", parallel_tool_calls=False).invoke("What is 2+3?")
    [call] = message.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"} and all(isinstance(v, int) for v in call["args"].values())
    free = chat.bind_tools([add]).invoke("What is 2+3?")  # auto: the model may answer in text; what it may not get is a 400
    assert free.content or free.tool_calls
