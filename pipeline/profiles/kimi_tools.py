"""Kimi-K2.5's TypeScript-style tool declaration (the ``tools_ts_str`` its chat template prints).

K2.5's tokenizer code turns the OpenAI ``tools`` list into TypeScript-like
declarations before rendering, and engines serving K2.5 (vLLM through that
tokenizer, SGLang's renderer) pass the result to the template as
``tools_ts_str``; the compact-JSON branch of the template is only a fallback.
The prompt ids equal the engine's only if the profile writes the same text:

    # Tools

    ## functions
    namespace functions {
    // DESCRIPTION
    type NAME = (_: {
      // field description
      // maxLength: 10
      required_field: string,
      optional_field?: number
    }) => any;
    }

Fields: required ones first, each group sorted by name; ``integer`` reads
``number``; enums print as unions of literals; ``$defs`` become interfaces;
a ``$ref`` to ``#`` makes the parameters an ``interface parameters``.
"""

from __future__ import annotations

import json
from typing import Any

INDENT = "  "
CONSTRAINTS = {
    "string": ("maxLength", "minLength", "pattern"),
    "number": ("maximum", "minimum"),
    "integer": ("maximum", "minimum"),
    "array": ("minItems", "maxItems"),
}
UNION_NAMES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null",
               "object": "{}", "array": "Array<any>"}


def _comment(text: str, indent: str = "") -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


class _Schemas:
    """Named ``$defs`` seen while walking a function's parameters, and whether ``#`` is referenced."""

    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}
        self.self_ref = False


def _kind(schema: Any) -> str:
    if isinstance(schema, bool):
        return "any" if schema else "null"
    if "$ref" in schema:
        return "ref"
    if "anyOf" in schema:
        return "anyOf"
    if "enum" in schema:
        return "enum"
    if "type" in schema:
        t = schema["type"]
        return "union" if isinstance(t, list) else t
    if schema == {}:
        return "any"
    raise ValueError(f"unsupported JSON schema: {schema!r}")


def _doc(schema: Any, indent: str) -> str:
    """Comment lines above a field: its description, then its constraints (sorted by key)."""
    if not isinstance(schema, dict):
        return ""
    lines = []
    if schema.get("description"):
        lines.append(_comment(schema["description"], indent))
    keys = CONSTRAINTS.get(_kind(schema), ())
    found = sorted((k, schema[k]) for k in keys if k in schema)
    if found:
        lines.append(indent + "// " + ", ".join(f"{k}: {v}" for k, v in found))
    return "".join(line + "\n" for line in lines)


def _walk_defs(schema: Any, seen: _Schemas) -> None:
    """Register ``$defs`` of every object schema and note self references, as a full parse would."""
    if isinstance(schema, dict):
        if schema.get("$ref") == "#":
            seen.self_ref = True
        if isinstance(schema.get("$defs"), dict) and _kind_or_none(schema) == "object":
            seen.defs.update(schema["$defs"])
        for key, value in schema.items():
            if key != "$defs":
                _walk_defs(value, seen)
    elif isinstance(schema, list):
        for value in schema:
            _walk_defs(value, seen)


def _kind_or_none(schema: dict[str, Any]) -> str | None:
    try:
        return _kind(schema)
    except ValueError:
        return None


def _field(name: str, schema: Any, optional: bool, indent: str) -> str:
    text = _doc(schema, indent)
    default = schema.get("default") if isinstance(schema, dict) else None
    if default is not None:
        shown = repr(default) if isinstance(default, (int, float, bool)) else json.dumps(default, ensure_ascii=False)
        text += f"{indent}// Default: {shown}\n"
    return text + f"{indent}{name}{'?' if optional else ''}: {_type(schema, indent)}"


def _object(schema: dict[str, Any], indent: str, ordered: bool = True) -> str:
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    names = list(props)
    if ordered:
        names = sorted(n for n in names if n in required) + sorted(n for n in names if n not in required)
    fields = [_field(n, props[n], n not in required, indent + INDENT) for n in names] if "properties" in schema else []
    extra = schema.get("additionalProperties")
    if extra is not None:
        shown = "any" if extra is True else "never" if extra is False else _type(extra, indent + INDENT)
        fields.append(f"{indent}{INDENT}[k: string]: {shown}")
    if not fields:
        return "{}"
    return "{\n" + ",\n".join(fields) + "\n" + indent + "}"


def _type(schema: Any, indent: str) -> str:
    kind = _kind(schema)
    if kind in ("any", "null") and isinstance(schema, bool):
        return kind
    if kind == "ref":
        ref = schema["$ref"]
        return "parameters" if ref == "#" else ref.split("/")[-1]
    if kind == "anyOf":
        return " | ".join(_type(s, indent) for s in schema["anyOf"])
    if kind == "enum":
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in schema["enum"])
    if kind == "union":
        return " | ".join(UNION_NAMES[t] for t in schema["type"])
    if kind == "object":
        return _object(schema, indent)
    if kind == "array":
        item = schema.get("items") or {}
        doc = _doc(item, indent + INDENT)
        if doc:
            return f"Array<\n{doc}{indent}{INDENT}{_type(item, indent + INDENT)}\n{indent}>"
        return f"Array<{_type(item, indent)}>"
    return "number" if kind == "integer" else kind


def function_declaration(function: dict[str, Any]) -> str:
    """One function as ``[interfaces] [// description] type NAME = (_: PARAMS) => any;``."""
    params = function.get("parameters") or {}
    seen = _Schemas()
    seen.defs.update(params.get("$defs") or {})  # the parameters are an object whatever their "type" says
    _walk_defs(params, seen)
    parts = []
    if seen.self_ref:
        body = ",\n".join(
            _field(n, p, n not in set(params.get("required") or []), INDENT)
            for n, p in (params.get("properties") or {}).items()
        )
        parts.append("interface parameters {" + (f"\n{body}\n" if body else "") + "}")
    for name, schema in seen.defs.items():
        desc = _comment(schema["description"]) + "\n" if isinstance(schema, dict) and schema.get("description") else ""
        parts.append(f"{desc}interface {name} {_type(schema, '')}")
    interfaces = "\n".join(parts)
    signature = "parameters" if seen.self_ref else _object(params, "")
    description = function.get("description")
    type_def = f"type {function.get('name', 'function')} = (_: {signature}) => any;"
    return "\n".join(p for p in (interfaces, _comment(description) if description else "", type_def) if p)


def tools_typescript(tools: list[dict[str, Any]] | None) -> str:
    """The whole declaration for an OpenAI ``tools`` list ("" when there are no function tools)."""
    functions = [function_declaration(t["function"]) for t in tools or [] if t.get("type") == "function"
                 and t.get("function")]
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
