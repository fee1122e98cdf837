"""``interpret`` is total: no status, body or Retry-After header makes it raise, and a Reply is always well typed."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline.generate.sources.http.wire as wire
from pipeline.generate.sources.http.wire import Failure, Reply, interpret

SETTINGS = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | \
    st.text(max_size=12) | st.sampled_from(["text", "image_url", "reasoning.text", "stop", "error", "403", ""])
keys = st.sampled_from(["type", "text", "content", "code", "message", "metadata", "reasons", "flagged_input",
                        "function", "name", "arguments", "id", "choices", "usage", "error", "cost",
                        "completion_tokens", "finish_reason", "tool_calls", "reasoning"]) | st.text(max_size=6)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner,
                                                                                                   max_size=4),
                           max_leaves=20)


def skeleton() -> dict:
    """A real success body: mutated_bodies replaces up to three of its fields by arbitrary values."""
    return {"id": "gen-1", "provider": "Alpha", "model": "m", "object": "chat.completion", "created": 1,
            "choices": [{"index": 0, "finish_reason": "tool_calls", "native_finish_reason": "stop",
                         "error": {"code": 502, "message": "x", "metadata": {"provider_name": "B"}},
                         "message": {"role": "assistant", "content": [{"type": "text", "text": "Hi"}],
                                     "reasoning": "r", "reasoning_content": "rc",
                                     "tool_calls": [{"id": "c", "type": "function",
                                                     "function": {"name": "f", "arguments": "{}"}}]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5, "cost": 0.01},
            "error": {"code": 403, "message": "m", "metadata": {"reasons": ["r"], "flagged_input": "i"}}}


def paths(node: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths(v, (*prefix, i))
    return out


SKELETON_PATHS = [p for p in paths(skeleton()) if p]


def put(body: dict, path: tuple, value: object) -> None:
    """Set ``path`` in ``body`` to ``value`` where the path still leads somewhere (earlier changes may cut it)."""
    node: object = body
    for step in path[:-1]:
        node = child(node, step)
    last = path[-1]
    if isinstance(node, dict) or isinstance(node, list) and isinstance(last, int) and last < len(node):
        node[last] = value  # type: ignore[index]


def child(node: object, step: object) -> object:
    if isinstance(node, dict):
        return node.get(step)
    if isinstance(node, list) and isinstance(step, int) and step < len(node):
        return node[step]
    return None


@st.composite
def mutated_bodies(draw: st.DrawFn) -> dict:
    body = skeleton()
    if draw(st.booleans()):
        del body["error"]  # half the time, reach the choices
    for path in draw(st.lists(st.sampled_from(SKELETON_PATHS), min_size=1, max_size=3)):
        put(body, path, draw(json_values))
    return body


def encode(value: object) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity as the stdlib writes them (orjson refuses them)


any_bytes = st.one_of(json_values.map(encode), st.dictionaries(keys, json_values, max_size=6).map(encode),
                      st.binary(max_size=64),
                      mutated_bodies().map(lambda b: encode(b)[: len(encode(b)) // 2]))
statuses = st.sampled_from([200, 400, 403, 404, 408, 429, 502, 524]) | st.integers(-5, 1000)
retry_after = st.none() | st.text(max_size=40) | st.sampled_from(["3", "1e999", "nan", "-1",
                                                                   "Wed, 21 Oct 2015 07:28:00 GMT",
                                                                   "Mon, 01 Jan 0001 00:00:00 -0000"])


@contextmanager
def stdlib_codec() -> Iterator[None]:
    original = wire.loads
    wire.loads = json.loads
    try:
        yield
    finally:
        wire.loads = original


def check(result: object) -> None:
    assert isinstance(result, Reply | Failure)
    if isinstance(result, Reply):
        c = result.completion
        assert c.content is None or isinstance(c.content, str)
        assert c.reasoning is None or isinstance(c.reasoning, str)
        assert c.tool_calls is None or (isinstance(c.tool_calls, list) and all(
            isinstance(t, dict) and isinstance(t["function"]["name"], str)
            and isinstance(t["function"]["arguments"], str) for t in c.tool_calls))
        assert isinstance(c.finish_reason, str)
        assert type(result.billed) is int and result.billed >= -1
        assert c.completion_tokens == (result.billed if result.billed >= 0 else None)
        assert type(result.cost) is float and math.isfinite(result.cost)
        assert all(isinstance(x, str) for x in (result.generation_id, result.provider, result.model))
        assert result.native_finish_reason is None or isinstance(result.native_finish_reason, str)
    else:
        assert isinstance(result.message, str) and isinstance(result.retryable, bool)
        assert result.failure_class in ("transient", "sample", "account")
        assert type(result.billed) is int and result.billed >= 0 and math.isfinite(result.cost)
        assert result.signature is None or isinstance(result.signature, str)
        assert isinstance(result.describe(), str) and isinstance(result.against_provider, bool)
        assert result.retry_after is None or (result.retry_after >= 0 and math.isfinite(result.retry_after))


def run(status: int, raw: bytes, header: str | None, stdlib: bool, as_text: bool) -> Reply | Failure:
    """``interpret`` under either codec: the stdlib one reads NaN, Infinity and integers of any size,
    which orjson refuses."""
    body = raw.decode("utf-8", "replace") if as_text else raw
    if not stdlib:
        return interpret(status, body, header, now=1445412470.0)
    with stdlib_codec():
        return interpret(status, body, header, now=1445412470.0)


@SETTINGS
@given(status=st.just(200) | statuses, raw=any_bytes, header=retry_after, stdlib=st.booleans(), as_text=st.booleans())
def test_interpret_is_total_on_any_body_and_status(status, raw, header, stdlib, as_text):
    check(run(status, raw, header, stdlib, as_text))


@SETTINGS
@given(status=st.just(200) | statuses, body=mutated_bodies(), header=retry_after, stdlib=st.booleans())
def test_interpret_is_total_on_answers_of_any_shape(status, body, header, stdlib):
    check(run(status, encode(body), header, stdlib, False))


METADATA = [("id",), ("provider",), ("model",), ("object",), ("created",), ("usage",), ("usage", "cost"),
            ("usage", "completion_tokens"), ("usage", "prompt_tokens"), ("choices", 0, "index"),
            ("choices", 0, "message", "role"), ("choices", 0, "error")]


@settings(max_examples=150, deadline=None)
@given(changes=st.lists(st.tuples(st.sampled_from(METADATA), json_values), min_size=1, max_size=4))
def test_odd_metadata_never_refuses_an_answer(changes):
    """Only what the ids are rebuilt from can make a complete answer fail; ids, usage and the like read as unknown."""
    body = skeleton()
    del body["error"]
    for path, value in changes:
        put(body, path, value)
    with stdlib_codec():
        result = interpret(200, encode(body))
    check(result)
    assert isinstance(result, Reply), result
    assert result.completion.content == "Hi" and result.completion.tool_calls[0]["function"]["name"] == "f"
