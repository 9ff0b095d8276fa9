"""Structured output: ``response_format`` JSON mode and JSON schema, enforced by llama.cpp grammars, on the real model."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway.structured import SchemaError, check_schema, schema_grammar
from tests.gateway.test_errors import assert_openai_error
from tests.helpers import SMOL, openai_client, prompt_text

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "number"},
        "is_capital": {"type": "boolean"},
        "continent": {"enum": ["Africa", "Asia", "Europe", "North America", "Oceania", "South America"]},
        "landmarks": {"type": "array", "items": {"$ref": "#/$defs/landmark"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "is_capital", "continent", "landmarks"],
    "additionalProperties": False,
    "$defs": {"landmark": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}}, "required": ["name"]}},
}


def ask(question: str, system: str = "You answer in JSON.") -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_json_schema_output_is_valid_json_matching_the_schema(smol_pool) -> None:
    client = openai_client(smol_pool)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    r = client.chat.completions.create(model=SMOL, messages=ask("Describe Paris."), response_format=fmt, temperature=0, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    doc = json.loads(choice.message.content)
    jsonschema.validate(doc, CITY)
    assert "paris" in doc["city"].lower()

    sampled = client.chat.completions.create(
        model=SMOL, messages=ask("Describe Tokyo."), response_format=fmt, temperature=1.0, seed=7, n=3, max_tokens=200
    )
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    for c in sampled.choices:
        jsonschema.validate(json.loads(c.message.content), CITY)


def test_json_mode_gives_a_json_object(smol_pool) -> None:
    client = openai_client(smol_pool)
    r = client.chat.completions.create(
        model=SMOL,
        messages=ask("Give the name and age of a person."),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    doc = json.loads(r.choices[0].message.content)
    assert isinstance(doc, dict) and doc
    stream = client.chat.completions.create(
        model=SMOL,
        messages=ask("Give the name and age of a person."),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content


@pytest.mark.fp_path
def test_the_grammar_constrains_sampling_only_so_the_prefix_is_still_reused(smol_pool) -> None:
    client = openai_client(smol_pool)
    handbook = "Facts about the harbor town. " + prompt_text(31, 400)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    first = client.chat.completions.create(
        model=SMOL, messages=ask("Describe Lisbon.", handbook), response_format=fmt, temperature=0, max_tokens=200
    )
    again = client.chat.completions.create(
        model=SMOL, messages=ask("Describe Lisbon.", handbook), response_format=fmt, temperature=0, max_tokens=200
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 2
    assert again.choices[0].message.content == first.choices[0].message.content
    jsonschema.validate(json.loads(again.choices[0].message.content), CITY)


UNSUPPORTED = [
    ({"type": "integer", "minimum": 0}, "schema.minimum"),
    ({"type": "object", "properties": {"age": {"type": "integer", "multipleOf": 2}}}, "schema.properties.age.multipleOf"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "schema.properties.a.not"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "schema.patternProperties"),
    ({"$ref": "https://example.com/schema.json"}, "schema.$ref"),
    ({"type": "string", "format": "email"}, "schema.format"),
    ({"type": "frobnicate"}, "schema.type"),
    ({"type": ["object", "null"], "properties": {"a": {}}}, "schema.type"),
    ({"type": "string", "maxLength": 100000}, "schema.maxLength"),
]


@pytest.mark.parametrize("schema,where", UNSUPPORTED, ids=[w for _, w in UNSUPPORTED])
def test_a_strict_schema_the_grammar_cannot_enforce_is_400_naming_the_part(smol_pool, schema, where: str) -> None:
    body = {
        "model": SMOL,
        "messages": ask("hi"),
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
    }
    err = assert_openai_error(smol_pool.post("/v1/chat/completions", json=body), 400, where)
    assert err["param"] == "response_format"


@pytest.mark.parametrize("schema,where", UNSUPPORTED, ids=[w for _, w in UNSUPPORTED])
def test_without_strict_what_the_grammar_cannot_enforce_is_a_hint_left_out_of_it(schema, where: str) -> None:
    loosened = check_schema(schema, "schema", strict=False)
    assert schema_grammar(loosened, strict=True)  # what is left, the grammar enforces
    node = loosened
    for part in where.split(".")[1:]:
        node = node.get(part) if isinstance(node, dict) else None
    assert node is None, f"{where} is still in the loosened schema {loosened}"


def test_without_strict_the_answer_is_served_and_keeps_what_the_grammar_enforces(smol_pool) -> None:
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "multipleOf": 1},
            "email": {"type": "string", "format": "email", "maxLength": 60},  # no rule for email: a string of at most 60
            "tags": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "string"}},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person}}
    r = openai_client(smol_pool).chat.completions.create(
        model=SMOL, messages=ask("Describe a person."), response_format=fmt, temperature=0, max_tokens=200
    )
    doc = json.loads(r.choices[0].message.content)
    assert set(doc) <= set(person["properties"]) and {"name", "age", "email"} <= set(doc)
    assert isinstance(doc["age"], int) and isinstance(doc["email"], str)


def test_bad_response_formats_are_400(smol_pool) -> None:
    def bad(fmt: object, *needles: str) -> None:
        assert_openai_error(
            smol_pool.post("/v1/chat/completions", json={"model": SMOL, "messages": ask("hi"), "response_format": fmt}), 400, *needles
        )

    bad({"type": "xml"}, "response_format.type")
    bad("json", "response_format")
    bad({"type": "json_schema"}, "json_schema")
    bad({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "name")
    bad({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}, "schema")
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    bad({"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}, "deeper")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(400)}}
    bad({"type": "json_schema", "json_schema": {"name": "x", "schema": wide}}, "larger")


def test_a_sub_schema_of_annotations_alone_is_any_value_without_strict() -> None:
    """Claude Code's Workflow tool has ``"args": {"description": ...}``: a hint, not a schema the converter knows."""
    schema = {"type": "object", "properties": {"args": {"description": "Any JSON value."}}, "required": ["args"]}
    loosened = check_schema(schema, "schema", strict=False)
    assert loosened["properties"]["args"]["description"] == "Any JSON value." and "type" in loosened["properties"]["args"]
    assert schema_grammar(loosened)
    with pytest.raises(SchemaError):
        schema_grammar(schema, strict=True)  # strict: the converter knows no such schema, a 400
