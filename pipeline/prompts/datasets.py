"""Read prompt files in the common shapes into one canonical conversation row.

Every input row ends as exactly one of: a prompt row (``sample_id``, ``dataset``,
``row_index``, ``messages`` and ``tools`` as JSON text, ``thinking``) or a
quarantine row with the reason. Parsing is pure; reading is thin.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import math
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from pipeline.base.config import DatasetConfig

log = logging.getLogger(__name__)

ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
DEFAULT_COLUMNS = {
    "messages": {"messages": "messages", "tools": "tools"},
    "sharegpt": {"conversations": "conversations", "system": "system", "tools": "tools"},
    "instruction": {"instruction": "instruction", "input": "input", "system": "system"},
    "glaive": {"system": "system", "chat": "chat"},
}


class RowError(ValueError):
    """A malformed input row; the message is the quarantine reason."""

    raw: Any = None  # the unparsed text, for a line that is not JSON


class DatasetError(ValueError):
    """A dataset file that cannot be read at all (one bad row is a RowError instead); names the file."""


@dataclass
class Prompt:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


@dataclass(frozen=True)
class Unreadable:
    """A Parquet value Python has no form for (a timestamp past year 9999): the rest of its row still reads, and
    only a format that reads its column quarantines the row (an unused column does not fail a run)."""

    type: str
    why: str

    def __str__(self) -> str:  # the quarantine's ``raw`` (json.dumps default=str)
        return f"<unreadable {self.type}: {self.why}>"


# How much of a value from the row a quarantine reason quotes (a role of a megabyte was repeated in full in every
# reason); ``raw`` keeps the row itself (its first ``RAW_CHARS`` characters).
QUOTE_CHARS = 200
REASON_CHARS = 1000
RAW_CHARS = 4000


def _clip(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, an ellipsis marking a cut."""
    return text if len(text) <= limit else text[:limit] + "…"


def _quote(value: Any) -> str:
    """A value of the row as a reason quotes it: its repr, cut to ``QUOTE_CHARS`` characters."""
    return _clip(repr(value))


def _column(row: dict[str, Any], columns: dict[str, str], field: str, required: bool = True) -> Any:
    col = columns[field]
    if col not in row or row[col] is None:
        if required:
            raise RowError(f"missing column {col!r}")
        return None
    if isinstance(row[col], Unreadable):
        raise RowError(f"column {col!r} holds a {row[col].type} value that cannot be read: {_clip(row[col].why)}")
    return row[col]


def _json_refusal(e: ValueError | RecursionError) -> str:
    """Why json.loads refused text that is not a syntax error: nesting deeper than the recursion limit, or an
    integer longer than Python's digit limit (its advice to raise the limit is no use to the file's author)."""
    return "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]


def _not_a_number(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past the range of a number JSON allows")
    return value


# JSON as RFC 8259 has it: Python's json reads NaN, Infinity and 1e400 (as inf), which no other JSON reader
# (the HTTP sources' orjson) takes back, so such a row would fail downstream on every run instead of once here.
STRICT = {"parse_constant": _not_a_number, "parse_float": _finite}


# How deep a row's JSON may nest. Past ~900 json's RecursionError decided, so a row parsed or not by the depth of
# the reader's stack (the driver's, an index task's, a read task's: one row, two ids); a fixed bound decides
# alike in every process, and at 200 the sources' orjson (254 levels) can still write the request.
MAX_DEPTH = 200
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _check_depth(text: str) -> None:
    """A ValueError for JSON text nested deeper than ``MAX_DEPTH`` (brackets inside strings not counted)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    if max(accumulate(1 if c in "[{" else -1 for c in brackets), default=0) > MAX_DEPTH:
        raise ValueError(f"nested too deeply (more than {MAX_DEPTH} levels)")


def _check_depth_at(text: str, start: int, end: int) -> None:
    """``_check_depth`` of ``text[start:end]``, copying it only when it may be too deep."""
    if text.count("[", start, end) + text.count("{", start, end) > MAX_DEPTH:
        _check_depth(text[start:end])


def _loads(text: str) -> Any:
    """``json.loads`` refusing non-finite numbers and nesting past ``MAX_DEPTH`` (a ValueError, as for a too-long
    integer)."""
    _check_depth(text)
    return json.loads(text, **STRICT)


def _maybe_json(value: Any, what: str) -> Any:
    if isinstance(value, str):
        try:
            return _loads(value)
        except json.JSONDecodeError as e:
            raise RowError(f"{what} is a string but not valid JSON: {e}") from None
        except (ValueError, RecursionError) as e:
            raise RowError(f"{what} is a string but not valid JSON: {_json_refusal(e)}") from None
    return value


def _norm_tools(tools: Any) -> list[dict[str, Any]] | None:
    if isinstance(tools, str) and not tools.strip():  # "" is how tool-less rows are often written
        return None
    tools = _maybe_json(tools, "tools")
    if tools in (None, "", []):
        return None
    if not isinstance(tools, list):
        raise RowError(f"tools must be a list, got {type(tools).__name__}")
    out = []
    for t in tools:
        if not isinstance(t, dict):
            raise RowError("each tool must be an object")
        fn = t.get("function", t)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RowError("each tool needs a function name")
        out.append({"type": "function", "function": fn})
    return out


def _norm_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """OpenAI-style calls with JSON-text arguments; a malformed call is a RowError."""
    calls = _maybe_json(calls, f"message {i} tool_calls")
    if not isinstance(calls, list):
        raise RowError(f"message {i} tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RowError(f"message {i} tool call {j} needs a function name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                value = _loads(args or "{}")
            except (ValueError, RecursionError):  # a JSONDecodeError, a too-long integer or too-deep nesting
                raise RowError(f"message {i} tool call {j} arguments are not valid JSON") from None
            if not isinstance(value, dict):  # OpenAI's arguments are an object's JSON; a template reads its keys
                raise RowError(f"message {i} tool call {j} arguments must be a JSON object, got "
                               f"{_JSON_TYPES.get(type(value), 'null')}")
            args = args or "{}"
        elif isinstance(args, dict):
            try:  # a Parquet file can hold values JSON has no form for (a date, bytes)
                args = json.dumps(args, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise RowError(f"message {i} tool call {j} arguments are not JSON: {e}") from None
        else:
            raise RowError(f"message {i} tool call {j} arguments must be an object or JSON text")
        call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else f"call_{j}"
        out.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _part_text(part: Any, i: int, j: int) -> str:
    """An OpenAI content part's text, "" for a part without any (an image); a part that is not an object (a bare
    string, which was read as "" and left the question out of the prompt) or text that is not a string is a
    RowError (a join would raise on it)."""
    if not isinstance(part, dict):
        raise RowError(f"message {i} content part {j} must be an object, got {type(part).__name__}")
    text = part.get("text", "")
    if not isinstance(text, str):
        raise RowError(f"message {i} content part {j} text must be a string, got {type(text).__name__}")
    return text


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RowError("conversation must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RowError(f"message {i} is not an object")
        role = m.get("role")
        if role is not None and not isinstance(role, str):  # a list or an object is not even hashable
            raise RowError(f"message {i} role must be a string, got {type(role).__name__}")
        if role not in ROLES:
            raise RowError(f"message {i} has unknown role {_quote(role)}")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                content = "".join(_part_text(p, i, j) for j, p in enumerate(content))
                # (all objects now) a user turn whose parts hold no text (none, an image only) lost its question
                if role == "user" and not content:
                    kinds = sorted({str(p.get("type", "?")) for p in m["content"]})
                    raise RowError(f"message {i} is a user turn with no text (parts: {', '.join(kinds) or 'none'}); "
                                   "the target is asked in text only")
            else:
                raise RowError(f"message {i} content must be text")
        if content is None and role != "assistant":  # an assistant's may be null: it made tool calls, or is dropped
            raise RowError(f"message {i} is a {role} message without content")
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.get("tool_calls"):
            if role != "assistant":
                raise RowError(f"message {i} is a {role} message with tool_calls")
            msg["tool_calls"] = _norm_tool_calls(m["tool_calls"], i)
        if m.get("name"):
            if not isinstance(m["name"], str):  # Parquet bytes, say: the id's JSON could not hold it
                raise RowError(f"message {i} name must be a string, got {type(m['name']).__name__}")
            msg["name"] = m["name"]
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    # The response is what we generate: drop trailing assistant turns.
    while out and out[-1]["role"] == "assistant":
        out.pop()
    for i, m in enumerate(out):  # OpenAI's format: an assistant message has content, tool_calls or both
        if m["content"] is None and not m.get("tool_calls"):
            raise RowError(f"message {i} is an assistant message with neither content nor tool_calls")
    if not any(m["role"] == "user" for m in out):
        raise RowError("conversation has no user message to respond to")
    if out[-1]["role"] not in ("user", "tool"):
        raise RowError(f"conversation ends with a {out[-1]['role']} message")
    return out


def _parse_messages(row: dict[str, Any], cols: dict[str, str]) -> Prompt:
    messages = _maybe_json(_column(row, cols, "messages"), "messages")
    tools = _norm_tools(_column(row, cols, "tools", required=False))
    return Prompt(_check_messages(messages), tools)


def _parse_sharegpt(row: dict[str, Any], cols: dict[str, str]) -> Prompt:
    conv = _maybe_json(_column(row, cols, "conversations"), "conversations")
    if not isinstance(conv, list):
        raise RowError("conversations must be a list")
    messages = []
    system = _column(row, cols, "system", required=False)
    if system:
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise RowError(f"turn {i} needs 'from' and 'value'")
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise RowError(f"turn {i} has unknown speaker {_quote(turn['from'])}")
        if turn["value"] is None and role != "assistant":  # a null gpt turn at the end is dropped as any other
            raise RowError(f"turn {i} ({_quote(turn['from'])}) has no value")
        messages.append({"role": role, "content": turn["value"]})
    tools = _norm_tools(_column(row, cols, "tools", required=False))
    return Prompt(_check_messages(messages), tools)


def _parse_instruction(row: dict[str, Any], cols: dict[str, str]) -> Prompt:
    instruction = _column(row, cols, "instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise RowError("instruction is empty")
    extra = _column(row, cols, "input", required=False)
    text = instruction + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
    messages = []
    system = _column(row, cols, "system", required=False)
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": text})
    return Prompt(_check_messages(messages), None)


_GLAIVE_TURN = re.compile(r"(USER|ASSISTANT|FUNCTION RESPONSE):\s*")
_GLAIVE_QUOTED_ARGS = re.compile(r"""("arguments"\s*:\s*)'(.*)'(\s*\})""", re.DOTALL)


def _json_objects(text: str, what: str) -> list[Any]:
    """Every top-level JSON object in free text, in order. Text that is no JSON is skipped; an object JSON
    cannot read (too deep, a too-long integer) is a RowError, not a definition or a call silently lost."""
    try:
        _check_depth(text)
    except ValueError as e:
        raise RowError(f"{what} holds JSON that cannot be read: {e}") from None
    dec, out, i = json.JSONDecoder(**STRICT), [], 0
    while (i := text.find("{", i)) != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        except (ValueError, RecursionError) as e:
            raise RowError(f"{what} holds JSON that cannot be read: {_json_refusal(e)}") from None
        out.append(obj)
        i = end
    return out


def _parse_glaive(row: dict[str, Any], cols: dict[str, str]) -> Prompt:
    """Glaive function-calling shape: tool JSON in the system text, a USER:/ASSISTANT: transcript."""
    system = _column(row, cols, "system")
    chat = _column(row, cols, "chat")
    if not isinstance(system, str) or not isinstance(chat, str):
        raise RowError("system and chat must be text")
    head = system.removeprefix("SYSTEM:").strip()
    tool_defs = [o for o in _json_objects(head, "system") if isinstance(o, dict) and "name" in o]
    # Glaive writes "... Use them if required -\n{...}": cut at the first definition, drop the " -".
    sys_text = head.split("{", 1)[0].rstrip().removesuffix("-").rstrip() if tool_defs else head
    messages: list[dict[str, Any]] = [{"role": "system", "content": sys_text}] if sys_text else []
    parts = _GLAIVE_TURN.split(chat)
    if len(parts) < 3:
        raise RowError("chat has no USER:/ASSISTANT: turns")
    roles = {"USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}
    n_calls = 0
    for speaker, body in zip(parts[1::2], parts[2::2], strict=True):
        body = body.replace("<|endoftext|>", "").strip()
        msg: dict[str, Any] = {"role": roles[speaker], "content": body}
        if speaker == "ASSISTANT" and body.startswith("<functioncall>"):
            # Glaive quotes the arguments JSON in single quotes: {"name": "f", "arguments": '{"a": 1}'}.
            body = _GLAIVE_QUOTED_ARGS.sub(lambda m: m[1] + json.dumps(m[2]) + m[3], body)
            calls = _json_objects(body, "assistant <functioncall>")
            if not calls or not isinstance(calls[0].get("name"), str):
                raise RowError("assistant <functioncall> holds no call JSON")
            call = calls[0]
            args = _maybe_json(call.get("arguments", {}), "function arguments")
            msg = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{n_calls}", "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}}]}
            n_calls += 1
        elif speaker == "FUNCTION RESPONSE" and n_calls:
            msg["tool_call_id"] = f"call_{n_calls - 1}"
        messages.append(msg)
    return Prompt(_check_messages(messages), _norm_tools(tool_defs))


PARSERS = {
    "messages": _parse_messages,
    "sharegpt": _parse_sharegpt,
    "instruction": _parse_instruction,
    "glaive": _parse_glaive,
}


def parse_row(row: Any, fmt: str, columns: dict[str, str] | None = None) -> Prompt:
    """Canonical prompt for one raw row; raises RowError naming what is wrong."""
    if not isinstance(row, dict):
        raise RowError(f"row is a {type(row).__name__}, not an object")
    cols = {**DEFAULT_COLUMNS[fmt], **(columns or {})}
    return PARSERS[fmt](row, cols)


def _unwritable(prompt: Prompt) -> str:
    """The first message or tool of ``prompt`` that has no UTF-8 JSON form (asked only once the whole failed)."""
    parts = [(f"message {i}", m) for i, m in enumerate(prompt.messages)]
    parts += [(f"tool {j}", t) for j, t in enumerate(prompt.tools or [])]
    for where, part in parts:
        try:
            json.dumps(part, sort_keys=True, ensure_ascii=False, allow_nan=False).encode()
        except (TypeError, ValueError):
            return where
    return "the prompt"


def sample_id(dataset: str, row_index: int, prompt: Prompt) -> str:
    """Stable id: dataset name + row index + hash of the canonical content. Content without a UTF-8 JSON form
    (a Parquet date or bytes in a tool; a lone surrogate, which a JSON \\u escape can write; a NaN or infinite
    float) is a RowError naming where it is: no later stage could write it either."""
    try:
        canon = json.dumps({"m": prompt.messages, "t": prompt.tools}, sort_keys=True, ensure_ascii=False,
                           allow_nan=False).encode()
    except UnicodeEncodeError as e:
        bad = e.object[e.start:e.end]
        raise RowError(f"{_unwritable(prompt)} holds a lone surrogate ({_quote(bad)}), not valid Unicode") from None
    except (TypeError, ValueError) as e:
        raise RowError(f"{_unwritable(prompt)} cannot be written as JSON: {e}") from None
    return f"{dataset}:{row_index}:{hashlib.sha256(canon).hexdigest()[:12]}"


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "a boolean"}
_JSON_OPENERS = {"{": "an object", '"': "a string", "t": "a boolean", "f": "a boolean", "n": "null"}
_CHUNK = 1 << 20  # bytes a JSONL file is read in: memory is a chunk and one line, whatever the file's size


def _kind(path: Path) -> str:
    """How a file is read, by its suffix in any case (``DATA.PARQUET`` read as JSONL would quarantine every line
    as garbage): ``.parquet``, ``.json``, or JSONL for any other."""
    return path.suffix.lower()


def _check_file(path: Path) -> None:
    """A folder or a missing path is a DatasetError (pyarrow would read a folder as a partitioned dataset)."""
    if path.is_dir():
        raise DatasetError(f"{path}: is a folder, expected a .jsonl, .json or .parquet file")
    if not path.exists():
        raise DatasetError(f"{path}: file not found")


def _unreadable(path: Path, e: OSError) -> DatasetError:
    return DatasetError(f"{path}: cannot be read: {e.strerror or e}")


def _read_bytes(path: Path) -> bytes:
    _check_file(path)
    try:
        return path.read_bytes()
    except OSError as e:
        raise _unreadable(path, e) from None


def _not_parquet(path: Path, e: Exception) -> DatasetError:
    """What is wrong with a file Arrow does not read as Parquet: named when its head says (a compressed file:
    Parquet compresses inside, so ``gzip rows.parquet`` makes a file Arrow calls only "not Parquet")."""
    try:
        with path.open("rb") as fh:
            head = fh.read(_HEAD)
    except OSError:
        head = b""
    named = _head_problem(head)
    named = named if named and "compressed" in named else None
    why = re.sub(r"^Could not open Parquet input source '[^']*': ", "", str(e)).strip()
    return DatasetError(f"{path}: {named}" if named else f"{path}: not a valid Parquet file: {why}")


def _cells(column: Any) -> list[Any]:
    """A Parquet column's values, each one that has no Python form as an ``Unreadable``."""
    try:
        return column.to_pylist()
    except Exception:  # OverflowError, ValueError, ArrowInvalid: a value's fault, never the file's
        pass
    out: list[Any] = []
    for i in range(len(column)):
        try:
            out.append(column[i].as_py())
        except Exception as e:
            out.append(Unreadable(str(column.type), str(e) or type(e).__name__))
    return out


def _batch_rows(batch: Any) -> list[dict[str, Any]]:
    """``batch.to_pylist()``, except that a value it cannot convert (an out-of-range date in any column) is an
    ``Unreadable`` in its row, not an error that ends the read of the whole file."""
    try:
        return batch.to_pylist()
    except Exception:  # see _cells
        columns = {name: _cells(batch.column(j)) for j, name in enumerate(batch.schema.names)}
        return [{name: cells[i] for name, cells in columns.items()} for i in range(batch.num_rows)]


def _parquet_rows(path: Path, want: Collection[int] | None = None) -> Iterator[tuple[int, Any]]:
    """Row group by row group (pyarrow batches), so a large file is never one table in memory; with ``want``
    only those rows become Python objects."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _check_file(path)
    last = max(want, default=-1) if want is not None else None
    try:
        with pq.ParquetFile(path) as f:
            at = 0
            for batch in f.iter_batches():
                if want is None:
                    yield from enumerate(_batch_rows(batch), at)
                else:
                    picked = [i - at for i in range(at, at + batch.num_rows) if i in want]
                    yield from zip((at + i for i in picked), _batch_rows(batch.take(pa.array(picked, pa.int64()))),
                                   strict=True)
                at += batch.num_rows
                if last is not None and at > last:
                    return
    except PermissionError as e:
        raise _unreadable(path, e) from None
    except (pa.ArrowException, OSError) as e:  # a corrupt footer is ArrowInvalid, corrupt metadata an OSError
        raise _not_parquet(path, e) from None


# The heads of files that are no UTF-8 text (an export compressed, or PowerShell's ``>``, which writes UTF-16): read
# as JSONL each line would be quarantined as garbage, so such a file is refused whole, naming what it is.
_NOT_UTF8 = [
    (codecs.BOM_UTF32_LE, "is UTF-32: save it as UTF-8"),  # before UTF-16's, which begins it
    (codecs.BOM_UTF32_BE, "is UTF-32: save it as UTF-8"),
    (codecs.BOM_UTF16_LE, "is UTF-16: save it as UTF-8"),
    (codecs.BOM_UTF16_BE, "is UTF-16: save it as UTF-8"),
    (b"\x1f\x8b", "is gzip-compressed: decompress it"),
    (b"\x28\xb5\x2f\xfd", "is zstd-compressed: decompress it"),
    (b"\xfd7zXZ\x00", "is xz-compressed: decompress it"),
]
_BZIP2 = re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)")
_HEAD = 10  # bytes the longest of those heads takes
# Two ASCII characters in UTF-16 with no BOM, little- or big-endian ('{"' is 7b 00 22 00): UTF-8 JSON holds no NUL.
_UTF16_NO_BOM = re.compile(rb"[\x01-\x7f]\x00[\x01-\x7f]\x00|\x00[\x01-\x7f]\x00[\x01-\x7f]")


def _head_problem(head: bytes) -> str | None:
    """What a file's first bytes say it is when it is compressed or not UTF-8 (no UTF-8 text, so no JSON, begins
    with them), or None."""
    why = next((why for magic, why in _NOT_UTF8 if head.startswith(magic)), None)
    if why is None and _BZIP2.match(head):
        why = "is bzip2-compressed: decompress it"
    if why is None and _UTF16_NO_BOM.match(head):
        why = "is UTF-16 (without a BOM): save it as UTF-8"
    return why


def _check_head(path: Path, head: bytes) -> None:
    """A DatasetError for a JSON or JSONL file whose first bytes say it is compressed or not UTF-8."""
    if (why := _head_problem(head)) is not None:
        raise DatasetError(f"{path}: {why}")


_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace, as json.loads skips it
_JSON_TOKEN = re.compile(rf"{_JSON_STRING.pattern}|[\[\]{{}}]")
# Reads over a value only to find its end: any number, no object kept.
_SKIP = json.JSONDecoder(parse_int=len, parse_float=len, parse_constant=len, object_pairs_hook=lambda _: None)


def _syntax_error(path: Path, text: str, e: json.JSONDecodeError) -> DatasetError:
    """The file's first syntax error, as json.loads names it (``e`` where that parse cannot get there)."""
    try:
        _SKIP.decode(text)
    except json.JSONDecodeError as first:
        e = first
    except (ValueError, RecursionError):
        pass
    hint = "; one JSON value per line? name the file .jsonl" if e.msg == "Extra data" else ""
    return DatasetError(f"{path}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno}{hint})")


def _value_end(path: Path, text: str, start: int) -> int:
    """Where the JSON value at ``start`` ends, read past whatever the strict parse refused in it (NaN, a too-long
    integer); a value too deep for json's recursion is followed by its brackets."""
    try:
        return _SKIP.raw_decode(text, start)[1]
    except json.JSONDecodeError as e:
        raise _syntax_error(path, text, e) from None
    except RecursionError:
        pass
    depth = 0
    for m in _JSON_TOKEN.finditer(text, start):
        depth += 1 if m[0] in "[{" else -1 if m[0] in "]}" else 0
        if depth == 0:
            return m.end()
    raise _syntax_error(path, text, json.JSONDecodeError("Unterminated array or object", text, start))


def _json_rows(path: Path, data: bytes, keep: bool = True) -> list[Any]:
    """The rows of a .json file, which holds one list; a whitespace-only file is empty, not broken.

    Each row is read by the rule a JSONL line is (``_loads``): one with NaN, Infinity, a number past a float's
    range, a too-long integer or nesting past ``MAX_DEPTH`` anywhere in it is a RowError in its place (its text
    the ``raw``), as its line in a JSONL file would be; the file's syntax is the file's (a DatasetError).

    ``keep=False`` checks the file the same way (same errors, same row count) but keeps no row: every JSON
    object parses to None as soon as it is read (``count_rows`` and ``check_dataset`` hold no rows)."""
    _check_head(path, data[:_HEAD])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DatasetError(f"{path}: not valid UTF-8 at line {line}: {e.reason}") from None
    if not text.strip():
        return []
    at = _WS.match(text).end()
    if not text.startswith("[", at):
        try:
            _SKIP.decode(text)
        except json.JSONDecodeError as e:
            raise _syntax_error(path, text, e) from None
        except (ValueError, RecursionError) as e:
            raise DatasetError(f"{path}: not valid JSON: {_json_refusal(e)}") from None
        found = _JSON_OPENERS.get(text[at], "a number")
        raise DatasetError(f"{path}: a .json dataset must hold a list of rows, found {found}")
    scan = (json.JSONDecoder(**STRICT) if keep else
            json.JSONDecoder(object_pairs_hook=lambda _: None, **STRICT)).scan_once  # raw_decode, less a call
    rows: list[Any] = []
    line, counted = 1, 0  # the line a refused row starts on, counted from where the last one started
    at = _WS.match(text, at + 1).end()
    while not (not rows and text.startswith("]", at)):
        start = at
        try:
            row, at = scan(text, start)
            _check_depth_at(text, start, at)
        except StopIteration as e:
            raise _syntax_error(path, text, json.JSONDecodeError("Expecting value", text, e.value)) from None
        except json.JSONDecodeError as e:
            raise _syntax_error(path, text, e) from None
        except (ValueError, RecursionError) as e:  # the rule a JSONL line is read by: this row's fault
            at = _value_end(path, text, start)
            line, counted = line + text.count("\n", counted, start), start
            why = f"nested too deeply (more than {MAX_DEPTH} levels)" if isinstance(e, RecursionError) \
                else _json_refusal(e)
            row = RowError(f"row is not valid JSON ({path.name} line {line}): {why}")
            row.raw = text[start:at]
        rows.append(row)
        at = _WS.match(text, at).end()
        if not text.startswith(",", at):
            break
        at = _WS.match(text, at + 1).end()
    if not text.startswith("]", at):
        raise _syntax_error(path, text, json.JSONDecodeError("Expecting ',' delimiter", text, at))
    at = _WS.match(text, at + 1).end()
    if at != len(text):
        raise _syntax_error(path, text, json.JSONDecodeError("Extra data", text, at))
    return rows


def _bad_line(reason: str, line: bytes) -> RowError:
    err = RowError(reason)
    err.raw = line.decode("utf-8", "backslashreplace")  # the bad bytes stay visible in quarantine
    return err


def _split_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """The lines of the concatenated chunks exactly as ``bytes.splitlines`` gives them (\\n, \\r\\n and \\r),
    holding one chunk and one line: a piece without its end, or ending in \\r (a \\n may open the next chunk),
    waits for the next chunk. A line longer than a chunk is kept as its chunks and joined once, when it ends
    (joined at every chunk, a 64 MiB line took seconds and a 1 GiB one, a minified JSON array, many minutes)."""
    carry: list[bytes] = []
    for chunk in chunks:
        if b"\n" not in chunk and b"\r" not in chunk:
            carry.append(chunk)
            continue
        pieces = b"".join([*carry, chunk]).splitlines(keepends=True)
        carry = [pieces.pop()] if pieces and (pieces[-1].endswith(b"\r") or not pieces[-1].endswith(b"\n")) else []
        for piece in pieces:
            yield piece[:-2] if piece.endswith(b"\r\n") else piece[:-1]
    yield from b"".join(carry).splitlines()


def _file_chunks(path: Path, size: int = _CHUNK) -> Iterator[bytes]:
    """The file's bytes in chunks, a leading UTF-8 BOM dropped (editors on Windows write one; json.loads
    refuses it). A file that begins as a compressed or UTF-16 one does is a DatasetError (``_check_head``)."""
    _check_file(path)
    try:
        with path.open("rb") as f:
            head = f.read(_HEAD)
            _check_head(path, head)
            yield head.removeprefix(codecs.BOM_UTF8)
            while chunk := f.read(size):
                yield chunk
    except OSError as e:
        raise _unreadable(path, e) from None


def _jsonl_rows(path: Path, lines: Iterator[bytes],
                want: Collection[int] | None = None) -> Iterator[tuple[int, Any]]:
    """Decoded line by line, so one line that is not UTF-8 or not JSON is one quarantined row, not a failed run.
    With ``want``, only those rows are parsed (a line is still decoded to know whether it is a row) and
    reading stops after the last of them."""
    index = 0
    last = max(want, default=-1) if want is not None else None
    for lineno, line in enumerate(lines, 1):  # \n, \r\n and \r, as text mode splits
        if last is not None and index > last:
            return
        where = f"{path.name} line {lineno}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            if want is None or index in want:
                yield index, _bad_line(f"line is not valid UTF-8 ({where}): {e.reason} at byte {e.start}", line)
            index += 1
            continue
        if not text.strip():
            continue
        if want is not None and index not in want:
            index += 1
            continue
        try:
            # A UTF-8 BOM opening a later line (files that each began with one, joined with ``cat``) is dropped as
            # the file's first is: the row reads as in its own file. A line of a BOM alone stays the (malformed)
            # row it always was, so the rows after it keep their indices and ids.
            row = _loads(text.removeprefix("\ufeff") or text)
        except json.JSONDecodeError as e:
            row = _bad_line(f"line is not valid JSON ({where}): {e.msg} (column {e.colno})", line)
        except (ValueError, RecursionError) as e:
            row = _bad_line(f"line is not valid JSON ({where}): {_json_refusal(e)}", line)
        yield index, row
        index += 1


def read_raw_rows(path: str | Path, want: Collection[int] | None = None) -> Iterator[tuple[int, Any]]:
    """(row index, row) pairs; a JSONL line that is not UTF-8 or not JSON yields a RowError in place of the row.

    Streamed: a JSONL file is read a chunk at a time and a Parquet file a row group at a time (a .json file
    holds one list, read whole). A file that cannot be read as a whole (a folder, missing, not valid JSON or
    Parquet) raises DatasetError, when the iteration reaches it. ``want``: only the rows of these indices (a
    resume that knows from the id index which rows are left), the others not parsed.
    """
    path = Path(path)
    if _kind(path) == ".parquet":
        yield from _parquet_rows(path, want)
    elif _kind(path) == ".json":
        rows = enumerate(_json_rows(path, _read_bytes(path).removeprefix(codecs.BOM_UTF8)))
        yield from rows if want is None else ((i, r) for i, r in rows if i in want)
    else:
        yield from _jsonl_rows(path, _split_lines(_file_chunks(path)), want)


def warn_empty(cfg: DatasetConfig) -> None:
    """The warning for a dataset file without rows (legal, but the user should know)."""
    log.warning("dataset %r: %s holds no rows; nothing to generate from it", cfg.name, cfg.path)


def _utf8_safe(text: str) -> str:
    """``text`` with each lone surrogate (a JSON \\u escape can write one) as its escape: UTF-8 has no form for
    it, and a quarantine shard is UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _bad_row(cfg: DatasetConfig, index: int, raw: Any, e: RowError) -> dict[str, Any]:
    if isinstance(raw, RowError):  # keep the offending line, not the error
        raw = raw.raw
    digest = hashlib.sha256(json.dumps(raw, default=str, sort_keys=True).encode()).hexdigest()[:12]
    return {
        "sample_id": f"{cfg.name}:{index}:{digest}", "dataset": cfg.name, "row_index": index,
        "stage": "read", "reason": _utf8_safe(_clip(f"malformed row: {e}", REASON_CHARS)),
        "raw": _utf8_safe(json.dumps(raw, default=str, ensure_ascii=False))[:RAW_CHARS],
    }


def iter_dataset(cfg: DatasetConfig, warn: bool = True,
                 rows: Collection[int] | None = None) -> Iterator[tuple[bool, dict[str, Any]]]:
    """``(True, prompt row)`` or ``(False, quarantine row)`` per input row, in file order, streamed (no row is
    held after it is yielded); reading stops at ``max_rows``. The ids are a function of the dataset's name,
    the row's index and its content only, so any process reading the file assigns the same ones.

    ``warn``: log ``warn_empty`` for a file without rows (a caller that reports elsewhere passes False).
    ``rows``: only the rows of these indices, the others not parsed.
    """
    n = 0
    for index, raw in read_raw_rows(cfg.path, rows):
        if cfg.max_rows is not None and index >= cfg.max_rows:
            break
        n += 1
        try:
            if isinstance(raw, RowError):
                raise raw
            p = parse_row(raw, cfg.format, cfg.columns)
            row = {
                "sample_id": sample_id(cfg.name, index, p), "dataset": cfg.name, "row_index": index,
                "messages": json.dumps(p.messages, ensure_ascii=False),
                "tools": json.dumps(p.tools, ensure_ascii=False) if p.tools else "",
                "thinking": cfg.thinking,
            }
        except RowError as e:
            yield False, _bad_row(cfg, index, raw, e)
            continue
        except Exception as e:  # a case the checks above missed is still one row's fault, not the run's
            yield False, _bad_row(cfg, index, raw, RowError(f"{type(e).__name__}: {e}"))
            continue
        yield True, row
    if not n and warn:  # max_rows > 0, so only a file without rows gets here
        warn_empty(cfg)


def load_dataset(cfg: DatasetConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(prompt rows, quarantine rows) for one configured dataset: ``iter_dataset`` collected."""
    prompts: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []
    for ok, row in iter_dataset(cfg):
        (prompts if ok else bad).append(row)
    return prompts, bad


def _parquet_footer_rows(path: Path) -> int:
    """The row count a Parquet file's footer records; its errors are the reader's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _check_file(path)
    try:
        with pq.ParquetFile(path) as f:
            return f.metadata.num_rows
    except PermissionError as e:
        raise _unreadable(path, e) from None
    except (pa.ArrowException, OSError) as e:
        raise _not_parquet(path, e) from None


def check_dataset(cfg: DatasetConfig) -> None:
    """Raise the DatasetError reading the file would raise, cheaply and holding no row: a folder or a missing
    file, a JSONL file that cannot be opened or begins as a compressed or UTF-16 file does, a Parquet footer that
    does not read, a .json file that is not one valid JSON list. A driver calls it before Ray starts; the readers
    in the workers raise the same errors, so they only meet what changed since (or a Parquet file corrupt past its
    footer)."""
    path = Path(cfg.path)
    if _kind(path) == ".parquet":
        _parquet_footer_rows(path)
    elif _kind(path) == ".json":
        _json_rows(path, _read_bytes(path).removeprefix(codecs.BOM_UTF8), keep=False)
    else:
        _check_file(path)
        try:
            with path.open("rb") as f:
                _check_head(path, f.read(_HEAD))
        except OSError as e:
            raise _unreadable(path, e) from None


def count_rows(cfg: DatasetConfig, warn: bool = True) -> int:
    """How many rows ``iter_dataset`` yields (prompt and malformed rows alike), parsing none where the file
    says (a Parquet footer) and holding none; logs ``warn_empty`` as ``load_dataset`` does (``warn``)."""
    path = Path(cfg.path)
    cap = cfg.max_rows if cfg.max_rows is not None else float("inf")
    if _kind(path) == ".parquet":
        n = _parquet_footer_rows(path)
    elif _kind(path) == ".json":
        n = len(_json_rows(path, _read_bytes(path).removeprefix(codecs.BOM_UTF8), keep=False))
    else:
        n = 0
        for line in _split_lines(_file_chunks(path)):
            if n >= cap:
                break
            try:
                n += bool(line.decode("utf-8").strip())
            except UnicodeDecodeError:
                n += 1  # a line that is not UTF-8 is a (malformed) row
    n = int(min(n, cap))
    if not n and warn:
        warn_empty(cfg)
    return n
