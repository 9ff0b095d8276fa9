"""The Responses API through the official openai client, on the real model: plain, streamed, tools, JSON schema, stored state.

A follow-up that names ``previous_response_id`` continues from the exact token ids the
pool evaluated and generated, so any worker resumes it from the store to the token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import llama_cpp
import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.responses_pool import Pool, responses_pool
from tests.gateway.test_sampling_api import cold_text
from tests.helpers import SMOL, THREADS, TOOLS_TEMPLATE, prompt_text, wait_settled

BRIEF = "Answer in one short sentence."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def pool(redis_server, s3_server, smollm2, tmp_path_factory) -> Iterator[Pool]:
    # A context of 4096: an agent's answer, unbounded as with OpenAI, has room to end on its own.
    with responses_pool(redis_server, s3_server, smollm2, tmp_path_factory.mktemp("responses"), workers=2, n_ctx=4096) as p:
        yield p


@pytest.fixture(scope="module")
def smol_llm(smollm2: Path) -> llama_cpp.Llama:
    """SmolLM2 in this process, with the workers' KV layout, for cold reference runs."""
    return llama_cpp.Llama(str(smollm2), n_ctx=2048, n_threads=1, n_threads_batch=THREADS, verbose=False, flash_attn=True)


@pytest.fixture(scope="module")
def tok(smollm2: Path) -> Tokenizer:
    return Tokenizer(smollm2, TOOLS_TEMPLATE.read_text())


def test_a_plain_response_is_the_chat_answer_and_is_kept(pool) -> None:
    client = pool.client()
    chat = client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "system", "content": BRIEF}, {"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=30,
    )
    wait_settled(pool.env["KVPOOL_REDIS_URL"])  # the second request may go to the other worker: the first one's state is in the store
    r = client.responses.create(model=SMOL, instructions=BRIEF, input="What is the capital of France?", temperature=0, max_output_tokens=30)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == SMOL
    assert r.status in ("completed", "incomplete")
    assert r.output_text and r.output_text == chat.choices[0].message.content
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens > 0  # the chat request evaluated the same prompt before it

    again = client.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.usage == r.usage and again.store is True
    [asked] = client.responses.input_items.list(r.id).data
    assert asked.type == "message" and asked.role == "user" and asked.content[0].text == "What is the capital of France?"


def test_a_streamed_response_sends_the_events_in_openais_order(pool) -> None:
    client = pool.client()
    ask = dict(model=SMOL, input="Name three colours.", temperature=0, max_output_tokens=24)
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    last = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    done = events[-1].response
    assert done.output_text == whole.output_text and done.usage.output_tokens == whole.usage.output_tokens
    assert events[-2].item.id == events[2].item.id == done.output[0].id
    assert client.responses.retrieve(done.id).output_text == whole.output_text


def test_a_function_call_and_its_output_continue_the_conversation(pool) -> None:
    client = pool.client()
    r = client.responses.create(
        model=SMOL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=60,
    )
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    assert "paris" in args["city"].lower()

    result = [{"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"city": "Paris", "celsius": 18})}]
    after = client.responses.create(
        model=SMOL, previous_response_id=r.id, input=result, tools=[WEATHER], temperature=0, max_output_tokens=40
    )
    assert after.output_text
    assert after.model_extra["kvpool"]["continued_tokens"] == r.usage.input_tokens + r.usage.output_tokens
    assert after.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens
    listed = client.responses.input_items.list(after.id, order="asc").data
    assert [i.type for i in listed] == ["message", "function_call", "function_call_output"]
    assert listed[1].call_id == listed[2].call_id == call.call_id


def test_a_streamed_function_call_comes_as_argument_events(pool) -> None:
    client = pool.client()
    events = list(
        client.responses.create(
            model=SMOL,
            input="What is the weather in Rome?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            temperature=0,
            max_output_tokens=60,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, delta, done, item_done = events[2:6]
    assert added.item.type == "function_call" and added.item.name == "get_weather" and added.item.arguments == ""
    assert delta.item_id == done.item_id == added.item.id and delta.delta == done.arguments
    assert json.loads(done.arguments)["city"] and item_done.item.arguments == done.arguments
    assert events[-1].response.output[0].call_id == added.item.call_id


def test_text_format_json_schema_gives_json_that_matches_it(pool) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    r = pool.client().responses.create(
        model=SMOL,
        input="Name a large city and its country, as JSON.",
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
        temperature=0,
        max_output_tokens=60,
    )
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "place"


@pytest.mark.fp_path
def test_a_follow_up_continues_the_stored_token_ids_exactly(pool, tok, smol_llm) -> None:
    client = pool.client()
    first = client.responses.create(model=SMOL, instructions=BRIEF, input="Name a fruit.", temperature=0, max_output_tokens=24)
    follow = client.responses.create(
        model=SMOL, instructions=BRIEF, input="Name another one.", previous_response_id=first.id, temperature=0, max_output_tokens=24
    )
    state, tenant = pool.state(), pool.tenant()
    a, b = state.get(tenant, first.id), state.get(tenant, follow.id)
    assert a is not None and b is not None

    # The first prompt is the chat template's rendering; the answer's ids are the ones the model generated.
    rendered = tok.render_chat([{"role": "system", "content": BRIEF}, {"role": "user", "content": "Name a fruit."}])
    assert a.tokens[: a.n_prompt] == tok.tokenize(rendered, special=True)
    assert tok.llm.detokenize(a.tokens[a.n_prompt :]).decode() == first.output_text
    # The follow-up's prompt: those very ids, then ChatML's end of turn, the new user turn and the generation prompt.
    turn = "<|im_end|>\n<|im_start|>user\nName another one.<|im_end|>\n<|im_start|>assistant\n"
    assert b.tokens[: b.n_prompt] == a.tokens + tok.llm.tokenize(turn.encode(), add_bos=False, special=True)
    assert follow.usage.input_tokens == b.n_prompt
    assert follow.model_extra["kvpool"]["continued_tokens"] == len(a.tokens)
    # ... and the answer is what the model says for that prompt, evaluated from scratch.
    assert follow.output_text == cold_text(smol_llm, b.tokens[: b.n_prompt], 24)


def test_new_instructions_render_the_conversation_again(pool, tok) -> None:
    """Instructions are not carried over (OpenAI's rule): a follow-up with other instructions cannot reuse the stored prompt."""
    client = pool.client()
    first = client.responses.create(model=SMOL, instructions=BRIEF, input="Name a river.", temperature=0, max_output_tokens=16)
    other = client.responses.create(
        model=SMOL,
        instructions="Answer in French.",
        input="Name a lake.",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=16,
    )
    assert other.model_extra["kvpool"]["continued_tokens"] == 0
    history = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Name a river."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Name a lake."},
    ]
    rendered = tok.render_chat([{**m, "tool_calls": None} for m in history])
    assert other.usage.input_tokens == len(tok.tokenize(rendered, special=True))
    dropped = client.responses.create(model=SMOL, input="And a sea?", previous_response_id=first.id, temperature=0, max_output_tokens=8)
    assert dropped.model_extra["kvpool"]["continued_tokens"] == 0 and dropped.instructions is None


def test_input_items_list_the_whole_conversation_with_cursors(pool) -> None:
    client = pool.client()
    prev = None
    for q in ("Say one.", "Say two.", "Say three."):
        prev = client.responses.create(model=SMOL, input=q, previous_response_id=prev, temperature=0, max_output_tokens=6).id
    asc = client.responses.input_items.list(prev, order="asc").data
    assert [(i.type, i.role) for i in asc] == [("message", "user"), ("message", "assistant")] * 2 + [("message", "user")]
    assert [asc[k].content[0].text for k in (0, 2, 4)] == ["Say one.", "Say two.", "Say three."]
    desc = client.responses.input_items.list(prev).data
    assert [i.id for i in desc] == [i.id for i in reversed(asc)]
    page = client.responses.input_items.list(prev, order="asc", limit=2, after=asc[1].id)
    assert [i.id for i in page.data] == [asc[2].id, asc[3].id] and page.has_more
    assert [i.id for i in client.responses.input_items.list(prev, order="asc", after=asc[1].id)] == [i.id for i in asc[2:]]


def test_the_agents_sdk_runs_an_agent_with_a_tool_against_kvpool(pool) -> None:
    """The OpenAI Agents SDK's basic agent with a function tool, pointed at kvpool by environment variables alone.

    The SDK lowercases its default model name, so this gateway serves the model under a
    lowercase name. Beside the SDK's example, the agent samples at temperature 0: at the
    SDK's default of 1, SmolLM2 now and then rambles to the end of its context.
    """
    gateway = pool.gateway_named("smollm2-135m-instruct")
    program = (
        "from agents import Agent, ModelSettings, Runner, function_tool\n"
        "@function_tool\n"
        "def get_weather(city: str) -> str:\n"
        "    '''The weather in a city.'''\n"
        "    print('[tool] get_weather', city)\n"
        "    return f'The weather in {city} is sunny, 14-20C.'\n"
        "agent = Agent(name='Hello world', instructions='You are a helpful agent.', tools=[get_weather],\n"
        "              model_settings=ModelSettings(temperature=0))\n"
        'result = Runner.run_sync(agent, input="What\'s the weather in Tokyo?")\n'
        "print('[final]', result.final_output)\n"
    )
    env = {
        **os.environ,
        "OPENAI_BASE_URL": gateway.url + "/v1",
        "OPENAI_API_KEY": "key-a",
        "OPENAI_DEFAULT_MODEL": "smollm2-135m-instruct",
        "OPENAI_AGENTS_DISABLE_TRACING": "1",
    }
    run = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=240)
    print(run.stdout)  # whether the model called the tool is the model's choice; the run must complete either way
    assert run.returncode == 0, run.stderr[-3000:]
    final = [line for line in run.stdout.splitlines() if line.startswith("[final] ")]
    assert final and final[0].removeprefix("[final] ").strip(), run.stdout


@pytest.mark.timeout(1200)  # ten worker restarts
def test_ten_turns_by_previous_response_id_alternate_workers_and_are_95_percent_cached(pool) -> None:
    """Each turn goes to the worker that did not answer the one before (that one stops for the turn): it resumes from the store."""
    client = pool.client()
    instructions = "You answer questions about these notes in a few words. Notes: " + prompt_text(21, 420)
    questions = [f"Which word is number {k}?" for k in range(1, 11)]
    prev, last, before = None, None, None
    for k, question in enumerate(questions):
        if last is not None:
            pool.stop(last)
        r = client.responses.create(
            model=SMOL, instructions=instructions, input=question, previous_response_id=prev, temperature=0, max_output_tokens=24
        )
        extra = r.model_extra["kvpool"]
        if before is not None:
            assert extra["worker"] != last
            assert extra["continued_tokens"] == before.usage.input_tokens + before.usage.output_tokens
            assert r.usage.input_tokens_details.cached_tokens >= 0.95 * r.usage.input_tokens, (k + 1, r.usage)
            assert extra["cached_from_store"] > 0
        wait_settled(pool.env["KVPOOL_REDIS_URL"])  # the answer's cells are settled and published
        if last is not None:
            pool.start(last)
        prev, last, before = r.id, extra["worker"], r
    assert before is not None and before.usage.input_tokens > 500
