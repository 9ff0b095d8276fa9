"""A JSON Schema loosened to what a grammar can enforce: for tools and non-strict ``response_format``, a schema is a hint.

Clients send tool schemas written for models that read them, not for grammars: Claude
Code's tools carry ``minimum``, ``propertyNames``, ``format: uri`` and ``maxLength`` of
tens of thousands. Refusing the request for them would refuse the client. So, unless the
request says ``strict: true`` (then `gateway.structured.check_schema` refuses, naming the
keyword), every keyword the grammar cannot enforce is left out of the grammar and kept
in the prompt, where the model still reads it:

* keywords the converter does not know (``minimum``, ``multipleOf``, ``not``,
  ``propertyNames``, ``patternProperties``, ...): dropped;
* a ``format`` with no grammar rule (``uri``, ``email``, ...): a plain string;
* ``minLength``/``maxLength``/``minItems``/``maxItems`` beyond what the grammar unrolls,
  or together with a ``pattern``, ``format`` or ``prefixItems``: dropped;
* a list of types with other keywords: one branch per type (``anyOf``);
* an unknown type, a remote ``$ref``, an unanchored ``pattern``, a malformed ``required``
  or ``enum``, an ``allOf`` of non-object schemas: dropped;
* a sub-schema that is not an object (``false`` included), or one of annotations alone: any value.

What cannot be loosened is still refused: a schema too large or nested too deep (those
limits guard the gateway, not the grammar). Integer ranges are not enforced: the
converter kvpool uses has no rule for them (the model reads them in the prompt).
"""

from __future__ import annotations

from typing import Any

ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly"}
)
SUPPORTED = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
        "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "pattern", "format", "minLength", "maxLength",
    }
)  # fmt: skip
TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
MAX_REPEAT = 1000
"""Largest minLength / maxLength / minItems / maxItems (each is unrolled into rules)."""
LENGTHS = ("minLength", "maxLength", "minItems", "maxItems")
ANY = {"type": ["string", "number", "boolean", "null", "object", "array"]}
"""Any JSON value (the converter reads ``{}`` as any object, and a schema of annotations alone as nothing it knows)."""


def loosen(node: Any, formats: frozenset[str], depth: int = 0, max_depth: int = 64) -> Any:
    """``node`` with what a grammar cannot enforce left out (a new schema; ``node`` is not changed)."""
    if depth > max_depth:
        return node  # refused by the check, which names the depth
    if not isinstance(node, dict):
        return dict(ANY)
    out = {k: v for k, v in node.items() if k in SUPPORTED or k in ANNOTATIONS}
    if not set(out) & SUPPORTED:
        return {**out, **ANY}  # annotations alone (or nothing enforceable): any value, where the converter would refuse
    _loosen_values(out, formats)
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: loosen(sub, formats, depth + 1, max_depth) for name, sub in out[key].items()}
        elif key in out:
            del out[key]
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list) and out[key]:
            out[key] = [loosen(sub, formats, depth + 1, max_depth) for sub in out[key]]
        elif key in out:
            del out[key]
    if "allOf" in out and not all(isinstance(s, dict) and ({"properties", "$ref", "anyOf"} & set(s)) for s in out["allOf"]):
        del out["allOf"]
    items = out.get("items")
    if isinstance(items, list):
        out["items"] = [loosen(sub, formats, depth + 1, max_depth) for sub in items]
    elif items is not None:
        out["items"] = loosen(items, formats, depth + 1, max_depth)
    extra = out.get("additionalProperties")
    if isinstance(extra, dict):
        out["additionalProperties"] = loosen(extra, formats, depth + 1, max_depth)
    elif extra is not None and not isinstance(extra, bool):
        del out["additionalProperties"]
    return _split_types(out)


def _loosen_values(out: dict[str, Any], formats: frozenset[str]) -> None:
    t = out.get("type")
    if isinstance(t, list):
        known = [x for x in t if isinstance(x, str) and x in TYPES]
        out["type"] = known[0] if len(known) == 1 else known
        if not known:
            del out["type"]
    elif t is not None and (not isinstance(t, str) or t not in TYPES):
        del out["type"]
    ref = out.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not ref.startswith("#/")):
        del out["$ref"]
    if "format" in out and out["format"] not in formats:
        del out["format"]
    pattern = out.get("pattern")
    if pattern is not None and not (isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$")):
        del out["pattern"]
    for key in LENGTHS:
        v = out.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_REPEAT):
            del out[key]
    if "pattern" in out or "format" in out:
        out.pop("minLength", None), out.pop("maxLength", None)
    if "prefixItems" in out:
        out.pop("minItems", None), out.pop("maxItems", None)
    if "required" in out and not (isinstance(out["required"], list) and all(isinstance(r, str) for r in out["required"])):
        del out["required"]
    if "enum" in out and not (isinstance(out["enum"], list) and out["enum"]):
        del out["enum"]


def _split_types(out: dict[str, Any]) -> dict[str, Any]:
    """A list of types with other keywords as one branch per type (the converter takes a list of types alone)."""
    types = out.get("type")
    if not isinstance(types, list):
        return out
    kept = {k: v for k, v in out.items() if k in ANNOTATIONS or k in ("$defs", "definitions")}
    rest = {k: v for k, v in out.items() if k not in kept and k != "type"}
    if not rest:
        return out
    return {**kept, "anyOf": [{"type": t, **rest} for t in types]}
