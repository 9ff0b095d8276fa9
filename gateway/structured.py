"""JSON Schema to a llama.cpp grammar (GBNF), for ``response_format`` and tool calls.

The conversion is llama-cpp-python's `SchemaConverter` (a port of llama.cpp's
``json_schema_to_grammar.py``). It ignores keywords it does not know, so its output would
quietly fail to match such a schema; every keyword is checked here first. Under
``strict: true`` a schema using one the grammar cannot enforce is refused, naming where it
is; otherwise the schema is a hint, loosened to what the grammar can enforce
(`gateway.loosen`). The grammar is then parsed by llama.cpp itself against the model's
vocabulary, so a job never reaches a worker with a grammar that would fail there.

Every JSON string a grammar accepts is one strict JSON parsers accept: its characters
exclude U+0000-U+001F (raw control characters, a newline among them, must be escaped in
JSON), as llama.cpp's own converter has them (`Converter`).
"""

from __future__ import annotations

import json
from typing import Any

import llama_cpp
from llama_cpp.llama_grammar import STRING_FORMAT_RULES, SchemaConverter

from gateway.errors import InvalidRequest
from gateway.loosen import ANNOTATIONS, MAX_REPEAT, SUPPORTED, TYPES, loosen

MAX_SCHEMA_BYTES = 64 * 1024
"""Largest schema accepted, as compact JSON."""
MAX_DEPTH = 16
"""Deepest nesting of sub-schemas accepted."""
MAX_GRAMMAR_BYTES = 512 * 1024
"""Largest grammar a schema may expand to (``maxLength`` and ``maxItems`` unroll)."""
FORMATS = frozenset({k.removesuffix("-string") for k in STRING_FORMAT_RULES if k.endswith("-string")} | {"uuid"})
JSON_CHAR = r'[^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
"""A character of a JSON string: any but a quote, a backslash or a control character, or an escape."""
PATTERN_DOT = r'[^"\\\x00-\x1F]'
"""``.`` in a ``pattern``: any character that may stand unescaped in a JSON string."""


class Converter(SchemaConverter):
    """llama-cpp-python's converter with JSON strings that strict parsers accept (its ``char`` lets control characters in)."""

    SAFE = {"char": JSON_CHAR, "dot": PATTERN_DOT}

    def __init__(self) -> None:
        super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)  # type: ignore[no-untyped-call]

    def _add_rule(self, name: str, rule: str) -> str:
        name_out: str = super()._add_rule(name, self.SAFE.get(name, rule))  # type: ignore[no-untyped-call]
        return name_out


class SchemaError(InvalidRequest):
    """The schema cannot be enforced by a grammar: a 400 naming ``where``, its path in the request, and the top-level field as param."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}", param=where.split(".", 1)[0])
        self.where = where


def check_schema(schema: Any, where: str = "schema", *, strict: bool = True) -> Any:
    """The schema the grammar enforces: ``schema`` itself under ``strict`` (what the converter would ignore or mishandle
    is refused, naming the first such place), else ``schema`` loosened to what it can enforce (`gateway.loosen`)."""
    if len(json.dumps(schema, separators=(",", ":"))) > MAX_SCHEMA_BYTES:
        raise SchemaError(where, f"the schema is larger than {MAX_SCHEMA_BYTES} bytes")
    if not strict:
        schema = loosen(schema, FORMATS, max_depth=MAX_DEPTH)
    _check(schema, where, 0)
    return schema


def _check(node: Any, where: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise SchemaError(where, f"the schema nests deeper than {MAX_DEPTH} levels")
    if isinstance(node, bool):
        if node is False:
            raise SchemaError(where, "the schema 'false' matches nothing")
        return
    if not isinstance(node, dict):
        raise SchemaError(where, f"a schema must be an object, got {type(node).__name__}")
    for key in node:
        if key not in SUPPORTED and key not in ANNOTATIONS:
            raise SchemaError(f"{where}.{key}", f"'{key}' is not supported by kvpool's grammar-constrained decoding")
    _check_values(node, where)
    for key, sub in _children(node, where):
        _check(sub, f"{where}.{key}", depth + 1)


def _check_values(node: dict[str, Any], where: str) -> None:
    t = node.get("type")
    types = t if isinstance(t, list) else [t] if t is not None else []
    for one in types:
        if one not in TYPES:
            raise SchemaError(f"{where}.type", f"unknown type {one!r}")
    if isinstance(t, list) and set(node) & (SUPPORTED - {"type", "$defs", "definitions"}):
        raise SchemaError(f"{where}.type", "a list of types together with other keywords is not supported; use anyOf")
    ref = node.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not ref.startswith("#/")):
        raise SchemaError(f"{where}.$ref", f"only local references ('#/...') are supported, got {ref!r}")
    fmt = node.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise SchemaError(f"{where}.format", f"format {fmt!r} is not supported (supported: {', '.join(sorted(FORMATS))})")
    if ("pattern" in node or "format" in node) and ({"minLength", "maxLength"} & set(node)):
        raise SchemaError(where, "minLength/maxLength together with pattern or format is not supported")
    if "pattern" in node and not (isinstance(node["pattern"], str) and node["pattern"].startswith("^") and node["pattern"].endswith("$")):
        raise SchemaError(f"{where}.pattern", "a pattern must be a string anchored with ^ and $")
    for key in ("minLength", "maxLength", "minItems", "maxItems"):
        v = node.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_REPEAT):
            raise SchemaError(f"{where}.{key}", f"must be an integer in [0, {MAX_REPEAT}]")
    if "required" in node and not (isinstance(node["required"], list) and all(isinstance(r, str) for r in node["required"])):
        raise SchemaError(f"{where}.required", "must be a list of property names")
    if "enum" in node and not (isinstance(node["enum"], list) and node["enum"]):
        raise SchemaError(f"{where}.enum", "must be a non-empty list")
    if isinstance(node.get("prefixItems"), list) and {"minItems", "maxItems"} & set(node):
        raise SchemaError(where, "minItems/maxItems together with prefixItems is not supported")


def _children(node: dict[str, Any], where: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key in ("properties", "$defs", "definitions"):
        if key in node:
            if not isinstance(node[key], dict):
                raise SchemaError(f"{where}.{key}", "must be an object")
            out += [(f"{key}.{name}", sub) for name, sub in node[key].items()]
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if key in node:
            if not isinstance(node[key], list) or not node[key]:
                raise SchemaError(f"{where}.{key}", "must be a non-empty list of schemas")
            out += [(f"{key}.{i}", sub) for i, sub in enumerate(node[key])]
    for sub in node.get("allOf", []):
        if not (isinstance(sub, dict) and ("properties" in sub or "$ref" in sub or "anyOf" in sub)):
            raise SchemaError(f"{where}.allOf", "only allOf of object schemas (with properties or $ref) is supported")
    items = node.get("items")
    if isinstance(items, list):
        out += [(f"items.{i}", sub) for i, sub in enumerate(items)]
    elif items is not None:
        out.append(("items", items))
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        out.append(("additionalProperties", extra))
    elif extra is not None and not isinstance(extra, bool):
        raise SchemaError(f"{where}.additionalProperties", "must be a boolean or a schema")
    return out


def schema_rules(schema: Any, name: str, converter: SchemaConverter | None = None, where: str = "schema") -> tuple[SchemaConverter, str]:
    """Add ``schema``'s rules to a converter under ``name``; returns the converter and the rule name."""
    conv = converter or Converter()
    try:
        resolved = conv.resolve_refs(schema if isinstance(schema, dict) else {}, "input")
        return conv, conv.visit(resolved, name)
    except (AssertionError, ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        raise SchemaError(where, f"cannot be turned into a grammar: {e or type(e).__name__}") from None


def schema_grammar(schema: Any, where: str = "schema", *, strict: bool = True) -> str:
    """The GBNF (root rule ``root``) for output matching ``schema``, found at ``where`` in the request (loosened unless ``strict``)."""
    schema = check_schema(schema, where, strict=strict)
    conv, _ = schema_rules(schema, "", where=where)
    grammar: str = conv.format_grammar()
    return grammar


def json_object_grammar() -> str:
    """Any JSON object (``response_format: json_object``)."""
    conv, _ = schema_rules({"type": "object"}, "")
    grammar: str = conv.format_grammar()
    return grammar


def verify_grammar(vocab: Any, grammar: str, param: str) -> None:
    """Parse ``grammar`` with llama.cpp against the model's vocabulary; 400 when it does not parse or is too large."""
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(f"{param}: the schema expands to a grammar larger than {MAX_GRAMMAR_BYTES} bytes; simplify it", param=param)
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    if not sampler:
        raise InvalidRequest(f"{param}: the grammar built from the schema does not parse in llama.cpp", param=param)
    llama_cpp.llama_sampler_free(sampler)


def response_grammar(fmt: Any, vocab: Any) -> str | None:
    """The grammar a chat request's ``response_format`` asks for (None for plain text); 400 naming what cannot be enforced."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_object_grammar()
    schema, strict = fmt.json_schema.schema_, fmt.json_schema.strict is True
    where = "response_format.json_schema.schema"
    grammar = json_object_grammar() if schema is True or schema == {} else schema_grammar(schema, where, strict=strict)
    verify_grammar(vocab, grammar, "response_format")
    return grammar
