"""Pure wire rules of the HTTP source: request bodies, response interpretation, retries, redaction."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.base.config import SamplingConfig
from pipeline.checks.reconstruct import rebuild_ids
from pipeline.generate.sources.http.config import OpenRouterSourceConfig, ProviderPreferences
from pipeline.generate.sources.http.engine import Secret, request_options
from pipeline.generate.sources.http.wire import (
    FATAL_STATUS,
    RETRYABLE_STATUS,
    Failure,
    Reply,
    RequestOptions,
    backoff_s,
    billing_drift,
    build_request,
    completion_from_message,
    drift_exceeds,
    interpret,
    parse_retry_after,
    redact,
)
from pipeline.profiles import load_profile
from pipeline.profiles.base import Completion

MSGS = [{"role": "user", "content": "hi"}]
OPTS = RequestOptions(model="m", max_tokens=64, temperature=0.7, top_p=0.9, seed=5)


@pytest.fixture(scope="module")
def profile():
    return load_profile("deepseek")


def ok_body(**over) -> dict:
    body = {"id": "gen-1", "provider": "Alpha", "model": "m", "object": "chat.completion", "created": 1,
            "choices": [{"index": 0, "finish_reason": "stop", "native_finish_reason": "stop",
                         "message": {"role": "assistant", "content": "Hello", "reasoning": "Think"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8, "cost": 0.01}}
    body.update(over)
    return body


# -- requests ------------------------------------------------------------------


def test_sampling_is_always_explicit():
    body = build_request(MSGS, None, False, OPTS)
    assert {k: body[k] for k in ("temperature", "top_p", "max_tokens", "seed")} == \
        {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "seed": 5}
    assert body["stream"] is False and body["messages"] == MSGS and body["model"] == "m"


def test_reasoning_styles():
    on = RequestOptions(**{**OPTS.__dict__, "reasoning": {"effort": "high"}})
    assert build_request(MSGS, None, True, on)["reasoning"] == {"effort": "high"}
    assert build_request(MSGS, None, False, on)["reasoning"] == {"enabled": False}
    vllm = RequestOptions(**{**OPTS.__dict__, "reasoning_style": "chat_template_kwargs"})
    body = build_request(MSGS, None, True, vllm)
    assert "reasoning" not in body and body["chat_template_kwargs"]["thinking"] is True
    none = RequestOptions(**{**OPTS.__dict__, "reasoning_style": "none"})
    assert "reasoning" not in build_request(MSGS, None, True, none)


def test_tools_only_sent_when_configured():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert "tools" not in build_request(MSGS, tools, False, OPTS)
    send = RequestOptions(**{**OPTS.__dict__, "send_tools": True})
    body = build_request(MSGS, tools, False, send)
    assert body["tools"] == tools and body["tool_choice"] == "auto"


def test_provider_object_passes_through_and_exclusions_join_ignore():
    prefs = ProviderPreferences(order=["A", "B"], ignore=["C"], allow_fallbacks=False, require_parameters=True,
                                quantizations=["bf16"], data_collection="deny", sort="throughput", only=["A", "B"])
    cfg = OpenRouterSourceConfig(model="m", provider=prefs)
    opts = request_options(cfg, SamplingConfig())
    body = build_request(MSGS, None, False, opts, excluded=["D", "C"])
    assert body["provider"] == {"order": ["A", "B"], "only": ["A", "B"], "ignore": ["C", "D"],
                                "allow_fallbacks": False, "require_parameters": True,
                                "data_collection": "deny", "quantizations": ["bf16"], "sort": "throughput"}
    assert "provider" not in build_request(MSGS, None, False, OPTS)
    with pytest.raises(ValueError):
        ProviderPreferences(orders=["A"])  # unknown keys are rejected, as OpenRouter does


def test_source_sampling_overrides_run_sampling():
    cfg = OpenRouterSourceConfig(model="m", sampling=SamplingConfig(temperature=0.1, max_tokens=7))
    opts = request_options(cfg, SamplingConfig(temperature=0.9))
    assert (opts.temperature, opts.max_tokens) == (0.1, 7)


# -- responses -----------------------------------------------------------------


def test_padded_success_parses():
    raw = b"\n\n     \n" + json.dumps(ok_body()).encode()
    r = interpret(200, raw)
    assert isinstance(r, Reply)
    assert (r.provider, r.billed, r.cost, r.generation_id) == ("Alpha", 5, 0.01, "gen-1")
    assert r.completion == Completion("Think", "Hello", None, "stop", 5)


@pytest.mark.parametrize("status", sorted(RETRYABLE_STATUS))
def test_retryable_statuses(status):
    body = json.dumps({"error": {"code": status, "message": "busy", "metadata": {"provider_name": "Beta"}}})
    f = interpret(status, body.encode(), "3")
    assert isinstance(f, Failure) and f.retryable and f.status == status and f.retry_after == 3.0
    assert f.provider == "Beta"


@pytest.mark.parametrize("status", sorted(FATAL_STATUS))
def test_fatal_statuses(status):
    f = interpret(status, json.dumps({"error": {"code": status, "message": "no"}}).encode())
    assert isinstance(f, Failure) and not f.retryable


def test_non_json_error_bodies_and_garbage():
    f = interpret(502, b"<html>bad gateway</html>")
    assert isinstance(f, Failure) and f.retryable and "bad gateway" in f.message
    f = interpret(200, b'{"id": "gen-1", "choices": [')  # cut off mid-body
    assert isinstance(f, Failure) and f.retryable and f.kind == "body"
    f = interpret(200, b"   \n  ")  # padding and nothing else
    assert isinstance(f, Failure) and f.retryable


def test_errors_inside_http_200():
    err_choice = ok_body()
    err_choice["choices"][0].update(finish_reason="error", error={"code": 502, "message": "upstream died"})
    f = interpret(200, json.dumps(err_choice))
    assert isinstance(f, Failure) and f.retryable and "upstream died" in f.message
    assert f.billed == 5 and f.provider == "Alpha"  # spend in a failed answer still counts

    f = interpret(200, json.dumps(ok_body(choices=[])))
    assert isinstance(f, Failure) and f.retryable and "no choices" in f.message

    native = ok_body()
    native["choices"][0]["native_finish_reason"] = "network_error"
    f = interpret(200, json.dumps(native))
    assert isinstance(f, Failure) and f.retryable and "network_error" in f.message

    top = {"error": {"code": 402, "message": "credits"}}
    f = interpret(200, json.dumps(top))
    assert isinstance(f, Failure) and not f.retryable


def test_provider_attribution_is_neutral_for_rate_limits_and_routing():
    assert Failure("http", "x", True, 429, provider="A").against_provider is False
    assert Failure("http", "x", True, 503, provider="A").against_provider is False
    assert Failure("http", "x", True, 502, provider="A").against_provider is True
    assert Failure("in_band", "x", True, 200, provider="A").against_provider is True
    assert Failure("network", "x", True).against_provider is False  # nobody to blame


def test_missing_usage_is_reported_as_unknown():
    r = interpret(200, json.dumps(ok_body(usage=None)))
    assert isinstance(r, Reply) and r.billed == -1


def test_completion_from_message_variants():
    assert completion_from_message({"reasoning_content": "r", "content": None}, "stop") == \
        Completion("r", None, None, "stop")
    assert completion_from_message({"reasoning": None, "reasoning_content": "r2", "content": ""}, "length",
                                   {"completion_tokens": 3}) == Completion("r2", "", None, "length", 3)
    c = completion_from_message({"content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}, "tool_calls")
    assert c.tool_calls == [{"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]


def test_every_reasoning_field_rebuilds_the_engine_ids(profile):
    """OpenRouter's reasoning, vLLM's reasoning_content, and no reasoning parser at all give the same ids."""
    engine_ids = profile.encode("Let me think.") + [profile.think_end_id] + profile.encode("Answer.") + \
        [profile.eot_id]
    messages = [{"content": "Answer.", "reasoning": "Let me think."},
                {"content": "Answer.", "reasoning_content": "Let me think."},
                {"content": "Let me think.</think>Answer."}]
    for m in messages:
        r = interpret(200, json.dumps(ok_body(choices=[{"index": 0, "finish_reason": "stop",
                                                        "message": {"role": "assistant", **m}}],
                                              usage={"completion_tokens": len(engine_ids)})))
        assert isinstance(r, Reply) and r.completion.completion_tokens == len(engine_ids)
        assert rebuild_ids(profile, r.completion, True).ids == engine_ids


def test_raw_tool_markers_rebuild_as_special_ids(profile):
    text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    ids = rebuild_ids(profile, Completion(None, text, None, "stop"), False).ids
    assert profile.tool_section_begin_id in ids and profile.tool_section_end_id in ids
    structured = Completion(None, "", [{"id": "c", "type": "function",
                                        "function": {"name": "f", "arguments": "{}"}}], "tool_calls")
    assert rebuild_ids(profile, structured, False).ids == ids


def test_billing_drift():
    assert billing_drift(10, -1) is None
    assert billing_drift(10, 12) == -2
    assert not drift_exceeds(-2, 12, 8, 0.05)
    assert drift_exceeds(20, 10, 8, 0.05)
    assert not drift_exceeds(9, 1000, 8, 0.05)  # 9 tokens of 1000 is a tokenizer difference


# -- retries -------------------------------------------------------------------


def test_retry_after_forms():
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("0.5") == 0.5
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(10.0)
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0


@given(attempt=st.integers(0, 40), seed=st.integers(0, 2**32), retry_after=st.none() | st.floats(0, 1e6))
def test_backoff_bounds(attempt, seed, retry_after):
    rng = random.Random(seed)
    d = backoff_s(attempt, rng, base=0.5, cap=30.0, retry_after=retry_after, max_retry_after=60.0)
    if retry_after is None:
        assert 0.0 <= d <= min(30.0, 0.5 * 2**attempt)
    else:
        assert min(retry_after, 60.0) <= d <= min(retry_after, 60.0) + 0.5


def test_backoff_grows_and_jitters():
    rng = random.Random(0)
    means = [sum(backoff_s(a, rng, base=1.0, cap=1e9) for _ in range(400)) / 400 for a in range(5)]
    assert all(b > a for a, b in zip(means, means[1:], strict=False))
    assert len({round(backoff_s(3, rng, base=1.0, cap=100), 6) for _ in range(20)}) > 15


# -- secrets -------------------------------------------------------------------


def test_redaction():
    key = "sk-or-v1-0123456789abcdef"
    text = f"401 for Authorization: Bearer {key}; key={key}; other sk-or-v1-zzzz and bearer abc.def"
    out = redact(text, [key])
    assert key not in out and "sk-or-v1-zzzz" not in out and "abc.def" not in out
    assert redact("nothing secret", [key, None, ""]) == "nothing secret"


def test_secret_never_shows_itself():
    s = Secret("sk-or-v1-supersecret")
    assert "supersecret" not in repr(s) and "supersecret" not in str(s) and "supersecret" not in f"{s}"
    import pickle

    with pytest.raises(TypeError):
        pickle.dumps(s)


# -- odd shapes, moderation, config errors ---------------------------------------


def with_message(**fields) -> dict:
    body = ok_body()
    body["choices"][0]["message"] = {"role": "assistant", **fields}
    return body


@pytest.mark.parametrize("body,field", [
    (ok_body(choices={"0": {"message": {"content": "x"}}}), "choices is an object, expected a list"),
    (ok_body(choices=["x"]), "choices[0] is a string, expected an object"),
    (ok_body(choices=[{"finish_reason": ["stop"], "message": {"content": "x"}}]), "choices[0].finish_reason is a list"),
    (ok_body(choices=[{"finish_reason": "stop", "message": "x"}]), "choices[0].message is a string"),
    (with_message(content=5), "choices[0].message.content is a number"),
    (with_message(content="x", reasoning={"text": "r"}), "choices[0].message.reasoning is an object"),
    (with_message(content=None, reasoning=None, reasoning_content=True), "message.reasoning_content is a boolean"),
    (with_message(content="", tool_calls={"id": "c"}), "choices[0].message.tool_calls is an object, expected a list"),
    (with_message(content="", tool_calls=["f()"]), "choices[0].message.tool_calls[0] is a string"),
    (with_message(content="", tool_calls=[{"id": "c", "function": "f"}]), "tool_calls[0].function is a string"),
    (with_message(content="", tool_calls=[{"function": {"name": 3}}]), "tool_calls[0].function.name is a number"),
    (with_message(content=[{"type": "image_url", "image_url": {"url": "u"}}]), "content[0] is a 'image_url' part"),
    (with_message(content=[{"type": "text", "text": "a"}, "b"]), "content[1] is a string, expected a content part"),
    (with_message(content=[{"type": "text", "text": None}]), "content[0].text is null"),
])
def test_wrong_shapes_are_sample_failures_naming_the_field_retried_first(body, field):
    """One provider's malformed answer: retried first (a retry may be routed to another provider), judged by the
    config streak only when it repeats, under one signature for every prompt answered so."""
    f = interpret(200, json.dumps(body))
    assert isinstance(f, Failure) and f.failure_class == "sample" and not f.retryable, f
    assert f.shape and f.retry_first and f.signature and f.signature.startswith("200 "), f
    assert field in f.message
    assert (f.billed, f.cost, f.provider) == (5, 0.01, "Alpha")  # what the answer cost is still counted


def test_non_object_json_body_is_a_sample_failure_with_unknown_bill():
    f = interpret(200, b"[1, 2]")
    assert isinstance(f, Failure) and f.failure_class == "sample" and f.maybe_billed and "a list" in f.message
    f = interpret(200, b"null")
    assert isinstance(f, Failure) and f.failure_class == "transient" and f.maybe_billed


def test_content_parts_join_into_the_content_string():
    body = with_message(content=[{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
                        reasoning=[{"type": "reasoning.text", "text": "Th"}, {"type": "text", "text": "ink"}])
    r = interpret(200, json.dumps(body))
    assert isinstance(r, Reply) and r.completion == Completion("Think", "Hello", None, "stop", 5)
    r = interpret(200, json.dumps(with_message(content=[], reasoning_content=[{"type": "text", "text": "r"}])))
    assert isinstance(r, Reply) and (r.completion.content, r.completion.reasoning) == ("", "r")
    f = interpret(200, json.dumps(with_message(content="x", reasoning=[{"type": "reasoning.encrypted", "data": "z"}])))
    assert isinstance(f, Failure) and f.failure_class == "sample" and "reasoning[0]" in f.message


@pytest.mark.parametrize("tokens", ["5", [5], {"n": 5}, True, -3, 5.5, 10**12, None])
def test_odd_usage_counts_are_an_unknown_bill(tokens):
    r = interpret(200, json.dumps(ok_body(usage={"completion_tokens": tokens, "cost": 0.01})))
    assert isinstance(r, Reply) and r.billed == -1 and r.completion.completion_tokens is None
    body = ok_body(choices=[], usage={"completion_tokens": tokens})
    f = interpret(200, json.dumps(body))
    assert isinstance(f, Failure) and f.billed == 0 and f.maybe_billed  # the engine keeps the whole reservation


@pytest.mark.parametrize("cost", ["0.01", [1], {"usd": 1}, True, -1.0, None])
def test_odd_costs_read_as_zero_and_keep_the_count(cost):
    r = interpret(200, json.dumps(ok_body(usage={"completion_tokens": 5, "cost": cost})))
    assert isinstance(r, Reply) and (r.billed, r.cost) == (5, 0.0)


def test_non_finite_and_huge_numbers_from_a_lenient_codec(monkeypatch):
    import pipeline.generate.sources.http.wire as wire

    monkeypatch.setattr(wire, "loads", json.loads)  # the stdlib codec reads NaN, Infinity and big integers
    raw = json.dumps(ok_body(usage={"completion_tokens": float("nan"), "cost": float("inf")}))
    r = interpret(200, raw)
    assert isinstance(r, Reply) and (r.billed, r.cost) == (-1, 0.0)
    r = interpret(200, json.dumps(ok_body(usage={"completion_tokens": 10**400, "cost": 10**400})))
    assert isinstance(r, Reply) and (r.billed, r.cost) == (-1, 0.0)
    f = interpret(200, json.dumps({"error": {"code": float("inf"), "message": [[[]]]}}))
    assert isinstance(f, Failure) and f.status is None and f.retryable
    assert isinstance(interpret(200, "[" * 100_000 + "]" * 100_000), Failure)  # too deep for the parser


def test_odd_metadata_is_unknown_not_refused():
    r = interpret(200, json.dumps(ok_body(id={"x": 1}, provider=["A"], model=None)))
    assert isinstance(r, Reply) and (r.generation_id, r.provider, r.model) == ("", "", "")
    body = ok_body()
    body["choices"][0]["native_finish_reason"] = {"x": 1}
    r = interpret(200, json.dumps(body))
    assert isinstance(r, Reply) and r.native_finish_reason is None
    for err in ("boom", ["a"], {"code": "502", "message": {"detail": "x"}, "metadata": "m"}):
        f = interpret(502, json.dumps({"error": err}))
        assert isinstance(f, Failure) and f.retryable and f.status == 502
    f = interpret(200, json.dumps({"error": {"code": "402", "message": None, "metadata": [1]}}))
    assert isinstance(f, Failure) and f.failure_class == "account"


MODERATION = {"error": {"code": 403, "message": "Your chosen model requires moderation and your input was flagged",
                        "metadata": {"reasons": ["violence", "harassment"], "flagged_input": "x" * 5000,
                                     "provider_name": "Alpha"}}}


def test_moderation_refuses_one_prompt_not_the_account():
    f = interpret(403, json.dumps(MODERATION))
    assert isinstance(f, Failure) and f.failure_class == "sample" and f.klass == "sample" and not f.retryable
    assert "violence, harassment" in f.message and f.provider == "Alpha"
    assert "x" * 61 not in f.message and "x" * 60 in f.message  # the prompt is clipped, not copied
    assert f.signature is None
    in_band = interpret(200, json.dumps(MODERATION))
    assert isinstance(in_band, Failure) and in_band.failure_class == "sample" and "violence" in in_band.message
    choice_err = ok_body()
    choice_err["choices"][0].update(finish_reason="error", error=MODERATION["error"])
    f = interpret(200, json.dumps(choice_err))
    assert isinstance(f, Failure) and f.failure_class == "sample" and "harassment" in f.message
    plain = interpret(403, json.dumps({"error": {"code": 403, "message": "Key disabled"}}))
    assert plain.failure_class == "account" and plain.klass is None


@pytest.mark.parametrize("status", [408, 504, 524])
def test_proxy_timeouts_keep_their_reservation(status):
    f = interpret(status, json.dumps({"error": {"code": status, "message": "Provider timed out"}}))
    assert isinstance(f, Failure) and f.retryable and f.failure_class == "transient" and f.maybe_billed


@pytest.mark.parametrize("status", [429, 500, 502, 503, 529])
def test_other_retryable_errors_bill_nothing(status):
    assert not interpret(status, json.dumps({"error": {"code": status, "message": "busy"}})).maybe_billed


def test_404_is_a_client_error_with_a_stable_signature():
    a = interpret(404, json.dumps({"error": {"code": 404, "message": "No endpoints found for tiny/x-1."}}))
    assert isinstance(a, Failure) and not a.retryable and a.failure_class == "sample"
    assert a.signature == "404 no endpoints found for #"
    in_band = interpret(200, json.dumps({"error": {"code": 404, "message": "No endpoints found for tiny/x-1."}}))
    assert isinstance(in_band, Failure) and not in_band.retryable and in_band.signature == a.signature


def test_signatures_collapse_what_varies_per_prompt():
    def sig(status: int, message: str) -> str | None:
        return interpret(status, json.dumps({"error": {"code": status, "message": message}})).signature

    one = sig(400, "Request req-163840 rejected: top_k 200312 is out of range")
    two = sig(400, "Request req-99 rejected: top_k 170001 is out of range")
    assert one == two and one.startswith("400 ") and "163840" not in one
    # a prompt too long for the model: one signature for every prompt, so max_tokens past the context (every
    # prompt refused) halts as a config error, while a long prompt among answered ones is its own fault
    assert sig(400, "This endpoint's maximum context length is 163840 tokens. You requested 200312 tokens.") == \
        sig(400, "This endpoint's maximum context length is 163840 tokens. You requested 200145 tokens.") is not None
    assert not interpret(400, json.dumps({"error": {"code": 400, "message": "Provider returned error"}})).retryable
    for vague in ("Provider returned error", "Bad Request"):  # no detail: retried before any verdict
        f = interpret(400, json.dumps({"error": {"code": 400, "message": vague, "metadata": {"provider_name": "P"}}}))
        assert f.failure_class == "sample" and f.signature and f.retry_first
    assert not interpret(400, json.dumps({"error": {"code": 400, "message": "Unknown parameter foo"}})).retry_first
    for status in (204, 302, 600):  # neither a client error nor a server's: says nothing of the prompt or config
        f = interpret(status, b"")
        assert f.failure_class == "transient" and f.signature is None
    assert sig(422, 'Invalid value "abc-1" for field tools') == sig(422, 'Invalid value "zz" for field tools')
    assert sig(400, "provider: unrecognized keys ['orderr']") != sig(404, "provider: unrecognized keys ['orderr']")
    assert sig(400, "Unknown parameter foo") != sig(400, "Unknown parameter bar")
    for status in (401, 402, 403, 408, 429, 500, 502):
        assert sig(status, "x") is None
    assert interpret(200, b'{"id": "gen-1", "choices": [').signature is None
    assert Failure("network", "refused", True).signature is None


@pytest.mark.parametrize("pad", [470, 480, 490, 495, 499])
def test_a_key_echoed_where_the_message_is_cut_leaves_no_part_of_it(pad):
    """The key is blanked before the message is clipped: a cut through it would leave its first characters,
    which no exact match finds afterwards."""
    key = "local-gw-7f3a9c2e1b8d4a6f0e5c"
    body = json.dumps({"error": {"code": 401, "message": "x" * pad + f" invalid api key: {key}"}})
    for status, raw in ((401, body), (200, body)):
        f = interpret(status, raw, secrets=(key,))
        assert isinstance(f, Failure) and key[:6] not in f.message, f.message


@pytest.mark.parametrize("code", [400, 402, 429, 500, 502, 503, 529])
def test_an_error_inside_a_200_body_bills_what_its_status_would(code):
    """Once whitespace padding has gone out, OpenRouter can tell a provider's 429/502/503 only inside a 200 body,
    with no Retry-After. The same error is then billed as its HTTP status would be (nothing): charging it as a
    maybe-billed answer kept a whole reservation per rate-limited request and drained the budget."""
    raw = b"\n" + b" " * 63 + json.dumps({"error": {"code": code, "message": "Provider returned error",
                                                   "metadata": {"provider_name": "Alpha"}}}).encode()
    f = interpret(200, raw)
    assert isinstance(f, Failure) and f.status == code and f.provider == "Alpha" and f.retry_after is None
    assert not f.maybe_billed and (f.billed, f.cost) == (0, 0.0)
    assert f.retryable == (code in RETRYABLE_STATUS)
    status = interpret(code, json.dumps({"error": {"code": code, "message": "Provider returned error"}}))
    assert (f.retryable, f.failure_class, f.maybe_billed) == (status.retryable, status.failure_class,
                                                              status.maybe_billed)


@pytest.mark.parametrize("error", [{"code": 524, "message": "Provider timed out"},
                                   {"code": 408, "message": "timeout"}, {"message": "no code"},
                                   {"code": "x", "message": "odd code"}])
def test_an_error_inside_a_200_body_without_a_bill_or_a_plain_code_keeps_its_reservation(error):
    """A proxy timeout (the origin may have finished and billed) or an error that says no status: unknown bill."""
    f = interpret(200, json.dumps({"error": error}))
    assert isinstance(f, Failure) and f.retryable and f.maybe_billed
    billed = interpret(200, json.dumps({"error": error, "usage": {"completion_tokens": 9, "cost": 0.2}}))
    assert isinstance(billed, Failure) and (billed.billed, billed.cost, billed.maybe_billed) == (9, 0.2, False)


def test_reasoning_sent_only_in_reasoning_details_is_read(profile):
    """Some providers send ``reasoning: null`` with the text in ``reasoning_details`` (reasoning.text parts):
    the text is the reasoning; summaries and encrypted parts are not the model's tokens and are left out."""
    details = [{"type": "reasoning.text", "text": "Th", "format": "unknown", "index": 0},
               {"type": "reasoning.encrypted", "data": "zz", "index": 1},
               {"type": "reasoning.summary", "summary": "a summary", "index": 2},
               {"type": "reasoning.text", "text": "ink", "index": 3}]
    r = interpret(200, json.dumps(with_message(content="Hello", reasoning=None, reasoning_details=details)))
    assert isinstance(r, Reply) and r.completion == Completion("Think", "Hello", None, "stop", 5)
    assert completion_from_message({"reasoning_details": details, "content": "x"}, "stop").reasoning == "Think"
    # reasoning, when sent, wins; details that hold no text, or are not a list of parts, add nothing
    r = interpret(200, json.dumps(with_message(content="Hello", reasoning="Own", reasoning_details=details)))
    assert isinstance(r, Reply) and r.completion.reasoning == "Own"
    for odd in ([{"type": "reasoning.encrypted", "data": "zz"}], "text", [1, {"type": "reasoning.text"}], None):
        r = interpret(200, json.dumps(with_message(content="Hello", reasoning=None, reasoning_details=odd)))
        assert isinstance(r, Reply) and r.completion.reasoning is None, odd
    ids = rebuild_ids(profile, interpret(200, json.dumps(with_message(
        content="Hello", reasoning=None, reasoning_details=details))).completion, True).ids
    assert ids[:ids.index(profile.think_end_id)] == profile.encode("Think")

