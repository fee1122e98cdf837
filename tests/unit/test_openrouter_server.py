"""The local OpenRouter-compatible server: wire fidelity (official SDK parses it), real usage, faults."""

from __future__ import annotations

import http.client
import json
import os
import random
import urllib.error
import urllib.request

import pytest

from pipeline.checks.reconstruct import rebuild_from_response, rebuild_ids
from pipeline.demo.openrouter_server import (
    ANSWER_VARIANTS,
    CannedBackend,
    ServerConfig,
    TransformersBackend,
    answer_variant,
    draw_fault,
    flagged_excerpt,
    make_backend,
    parse_args,
    route,
    sized_text,
    split_generated,
)
from pipeline.generate.sources.http.wire import Failure, Reply, interpret
from pipeline.profiles import load_profile
from pipeline.profiles.base import Completion
from tests.helpers.server import serve_in_thread

KEY_ENV = "OPENROUTER_TEST_SERVER_KEY"
KEY = "sk-or-v1-servertest-0123456789abcdef"
os.environ.setdefault(KEY_ENV, KEY)


@pytest.fixture(scope="module")
def hf_backend(tiny_target):
    be = TransformersBackend(str(tiny_target))
    yield be
    be.close()


@pytest.fixture(scope="module")
def profile():
    return load_profile("deepseek")


def post(url: str, body: dict, key: str | None = KEY) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url + "/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def chat(content: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 16,
            "temperature": 1.0, "top_p": 1.0, "seed": 1, **extra}


def test_official_sdk_parses_responses_and_generation_stats(hf_backend):
    import openrouter
    from openrouter import errors
    from openrouter.utils import BackoffStrategy, RetryConfig

    no_retry = RetryConfig("none", BackoffStrategy(1, 1, 1.0, 1), False)
    cfg = ServerConfig(api_key_env=KEY_ENV, padding=32)
    with serve_in_thread(cfg, hf_backend) as (url, server), \
            openrouter.OpenRouter(api_key=KEY, server_url=url, retry_config=no_retry) as client:
        r = client.chat.send(model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=12,
                             temperature=1.0, top_p=1.0, seed=3, reasoning={"enabled": True},
                             provider={"order": ["Beta"], "allow_fallbacks": False})
        assert r.object == "chat.completion" and r.id.startswith("gen-")
        msg = r.choices[0].message
        assert isinstance(msg.reasoning, str) and r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
        g = client.generations.get_generation(id=r.id)
        assert g.data.provider_name == "Beta"
        assert g.data.native_tokens_completion == r.usage.completion_tokens
        assert g.data.native_tokens_reasoning == r.usage.completion_tokens_details.reasoning_tokens

        with pytest.raises(errors.TooManyRequestsResponseError) as e429:
            client.chat.send(model="tiny", messages=[{"role": "user", "content": "x [[fault:always-429]]"}],
                             max_tokens=4)
        assert e429.value.data.error.code == 429
        with pytest.raises(errors.BadGatewayResponseError):
            client.chat.send(model="tiny", messages=[{"role": "user", "content": "x [[fault:always-502]]"}],
                             max_tokens=4)
        with pytest.raises(errors.UnauthorizedResponseError):
            with openrouter.OpenRouter(api_key="wrong", server_url=url, retry_config=no_retry) as bad:
                bad.chat.send(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4)
        err = client.chat.send(model="tiny", messages=[{"role": "user", "content": "x [[fault:always-200-error]]"}],
                               max_tokens=4)
        assert err.choices[0].finish_reason == "error"
        empty = client.chat.send(model="tiny", max_tokens=4,
                                 messages=[{"role": "user", "content": "x [[fault:always-empty-choices]]"}])
        assert empty.choices == []


def test_usage_is_counted_by_the_real_tokenizer_and_rebuild_matches(hf_backend):
    """The served split, rebuilt by the client's rule, gives back the ids the model generated."""
    p = hf_backend.profile
    exact = 0
    for i in range(5):
        rendered = p.render_prompt([{"role": "user", "content": f"Prompt {i}"}], None, True)
        ids = hf_backend._generate_ids(rendered.ids, 16, 1.0, 1.0, i)
        g = split_generated(p, ids, True, tools_sent=False, prompt_tokens=len(rendered.ids))
        assert g.completion_tokens == len(ids) and g.prompt_tokens == len(rendered.ids)
        assert g.reasoning_tokens == (ids.index(p.think_end_id) if p.think_end_id in ids else len(ids))
        c = Completion(g.reasoning, g.content, g.tool_calls, g.finish_reason, g.completion_tokens)
        rebuilt = rebuild_ids(p, c, True).ids
        if p.encode(p.decode(ids)) == ids:
            assert rebuilt == ids
            exact += 1
        else:  # random weights can emit non-canonical BPE sequences; text cannot carry those exactly
            assert abs(len(rebuilt) - len(ids)) <= 2
    assert exact >= 2


def test_tool_sections_stay_raw_without_tools_and_parse_with_them(profile):
    section = profile.render_tool_calls([{"function": {"name": "f", "arguments": "{\"a\": 1}"}}])
    ids = profile.encode("why") + [profile.think_end_id] + profile.encode("ok" + section) + [profile.eot_id]
    raw = split_generated(profile, ids, True, tools_sent=False, prompt_tokens=1)
    assert raw.tool_calls is None and raw.content == "ok" + section and raw.finish_reason == "stop"
    parsed = split_generated(profile, ids, True, tools_sent=True, prompt_tokens=1)
    assert parsed.content == "ok" and parsed.finish_reason == "tool_calls"
    assert parsed.tool_calls[0]["function"] == {"name": "f", "arguments": "{\"a\": 1}"}


def test_routing_rules():
    rng = random.Random(0)
    provs = ("A", "B", "C")
    assert route(provs, {"order": ["C", "A"]}, rng) == "C"
    assert route(provs, {"order": ["X"], "allow_fallbacks": False}, rng) is None
    assert route(provs, {"order": ["X"]}, rng) in provs
    assert route(provs, {"only": ["B"]}, rng) == "B"
    assert route(provs, {"ignore": ["A", "B", "C"]}, rng) is None
    assert {route(provs, {"ignore": ["B"]}, rng) for _ in range(50)} == {"A", "C"}
    assert route(provs, {"sort": "price", "ignore": ["A"]}, rng) == "B"


def test_fault_draw_follows_rates():
    rng = random.Random(1)
    draws = [draw_fault({"429": 0.3, "cutoff": 0.2}, rng) for _ in range(4000)]
    assert abs(draws.count("429") / 4000 - 0.3) < 0.03 and abs(draws.count("cutoff") / 4000 - 0.2) < 0.03
    assert set(draws) == {"429", "cutoff", None}


def test_fault_shapes_on_the_wire(profile):
    cfg = ServerConfig(api_key_env=KEY_ENV, retry_after_s=2, timeout_s=0.2, miscount_providers=("Beta",),
                       corrupt_providers=("Gamma",), providers=("Alpha", "Beta", "Gamma"))
    with serve_in_thread(cfg, CannedBackend(1, profile)) as (url, server):
        status, headers, raw = post(url, chat("hi [[fault:always-429]]"))
        assert status == 429 and headers["Retry-After"] == "2" and json.loads(raw)["error"]["code"] == 429
        status, _, raw = post(url, chat("hi [[fault:always-502]]"))
        assert status == 502 and json.loads(raw)["error"]["metadata"]["provider_name"] in cfg.providers
        status, _, raw = post(url, chat("hi [[fault:always-timeout]]"))
        assert status == 408
        for code in (400, 401, 402, 403):
            assert post(url, chat(f"hi [[fault:{code}]]"))[0] == code
        status, _, raw = post(url, chat("hi [[fault:echo-key]]"))
        assert status == 401 and KEY in raw.decode()  # the careless gateway the client must redact
        assert post(url, chat("hi"), key="sk-or-v1-wrong")[0] == 401
        assert post(url, chat("hi", provider={"orderr": ["A"]}))[0] == 400  # unknown routing keys rejected
        assert post(url, chat("hi", provider={"ignore": list(cfg.providers)}))[0] == 503

        body = json.loads(post(url, chat("hi [[fault:always-native-error]]"))[2])
        assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["native_finish_reason"] == "error"
        body = json.loads(post(url, chat("hi [[fault:always-null-content]]"))[2])
        assert body["choices"][0]["message"]["content"] is None
        body = json.loads(post(url, chat("hi [[fault:always-empty-content]]"))[2])
        assert body["choices"][0]["message"]["content"] == ""
        with pytest.raises((http.client.IncompleteRead, ConnectionError)):
            post(url, chat("hi [[fault:always-cutoff]]"))

        honest = json.loads(post(url, chat("hi", provider={"only": ["Alpha"]}))[2])
        miscount = json.loads(post(url, chat("hi", provider={"only": ["Beta"]}))[2])
        corrupt = json.loads(post(url, chat("hi", provider={"only": ["Gamma"]}))[2])
        assert honest["provider"] == "Alpha"
        assert miscount["usage"]["completion_tokens"] == honest["usage"]["completion_tokens"] // 3
        assert "<｜User｜>" in corrupt["choices"][0]["message"]["content"]

        status, _, raw = post(url, chat("hi", reasoning={"enabled": True}, max_tokens=64))
        body = json.loads(raw)
        assert body["choices"][0]["message"]["reasoning"] and body["usage"]["completion_tokens_details"][
            "reasoning_tokens"] > 0
        gen = urllib.request.Request(url + f"/generation?id={body['id']}", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(gen, timeout=10) as r:
            data = json.loads(r.read())["data"]
        assert data["native_tokens_completion"] == body["usage"]["completion_tokens"]
        assert data["provider_name"] == body["provider"]
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(urllib.request.Request(url + "/generation?id=gen-nope",
                                                          headers={"Authorization": f"Bearer {KEY}"}), timeout=10)


def test_padding_precedes_the_json(profile):
    with serve_in_thread(ServerConfig(padding=40, timeout_s=0.2), CannedBackend(1, profile)) as (url, _):
        status, _, raw = post(url, chat("hi"), key=None)
        assert status == 200 and raw[:40].strip() == b"" and raw[40:41] == b"{"
        json.loads(raw)  # whitespace before the object is legal JSON
        status, _, raw = post(url, chat("hi [[fault:always-timeout]]"), key=None)
        assert status == 200 and raw.strip()  # late but whole: the stall happens after the padding


def test_shape_faults_are_billed_and_read_as_the_client_should(profile):
    """Each odd shape is a billed generation; the client reads it as a reply, a sample failure or an unknown bill."""
    with serve_in_thread(ServerConfig(api_key_env=KEY_ENV), CannedBackend(1, profile)) as (url, server):
        def billed() -> int:
            return server.counts.get("billed_completion_tokens", 0)

        status, _, raw = post(url, chat("hi"))
        normal = json.loads(raw)
        per = normal["usage"]["completion_tokens"]
        assert status == 200 and billed() == per > 0

        status, _, raw = post(url, chat("hi [[fault:always-content-parts]]"))
        parts = json.loads(raw)["choices"][0]["message"]["content"]
        assert status == 200 and len(parts) > 1 and all(p["type"] == "text" for p in parts)
        assert "".join(p["text"] for p in parts) == normal["choices"][0]["message"]["content"]
        r = interpret(status, raw)
        assert isinstance(r, Reply) and r.completion.content == normal["choices"][0]["message"]["content"]
        assert billed() == 2 * per

        status, _, raw = post(url, chat("hi [[fault:always-choices-object]]"))
        assert status == 200 and isinstance(json.loads(raw)["choices"], dict) and billed() == 3 * per
        f = interpret(status, raw)
        assert isinstance(f, Failure) and f.failure_class == "sample" and f.billed == per and not f.maybe_billed

        status, _, raw = post(url, chat("hi [[fault:always-usage-string]]"))
        assert json.loads(raw)["usage"]["completion_tokens"] == str(per) and billed() == 4 * per
        r = interpret(status, raw)
        assert isinstance(r, Reply) and r.billed == -1  # unknown: the engine charges the whole reservation

        generations = len(server.generations)
        status, _, raw = post(url, chat("hi [[fault:always-proxy-524]]"))
        assert status == 524 and json.loads(raw)["error"]["code"] == 524
        assert billed() == 5 * per and len(server.generations) == generations + 1  # the origin finished and billed
        f = interpret(status, raw)
        assert isinstance(f, Failure) and f.retryable and f.maybe_billed
        assert server.counts["fault_proxy-524"] == 1 and server.counts["status_524"] == 1


def test_proxy_timeout_after_padding_is_told_in_the_body(profile):
    with serve_in_thread(ServerConfig(padding=8), CannedBackend(1, profile)) as (url, server):
        status, _, raw = post(url, chat("hi [[fault:always-proxy-524]]"), key=None)
        assert status == 200 and json.loads(raw)["error"]["code"] == 524
        assert server.counts["billed_completion_tokens"] > 0
        f = interpret(status, raw)
        assert isinstance(f, Failure) and f.retryable and f.maybe_billed


def test_moderation_flags_one_input_and_bills_nothing(profile):
    long_prompt = "tell me something awful " * 20 + "[[fault:moderation]]"
    with serve_in_thread(ServerConfig(api_key_env=KEY_ENV), CannedBackend(1, profile)) as (url, server):
        status, _, raw = post(url, chat(long_prompt))
        meta = json.loads(raw)["error"]["metadata"]
        assert status == 403 and meta["reasons"] == ["violence"] and meta["provider_name"] in server.cfg.providers
        assert meta["flagged_input"] == flagged_excerpt(long_prompt) and len(meta["flagged_input"]) <= 100
        assert server.counts.get("billed_completion_tokens", 0) == 0 and not server.generations
        f = interpret(status, raw)
        assert isinstance(f, Failure) and f.failure_class == "sample" and "violence" in f.message
        status, _, raw = post(url, chat("hi [[fault:403]]"))
        assert status == 403 and interpret(status, raw).failure_class == "account"  # not moderation: the account
    assert flagged_excerpt("short") == "short"


def test_unknown_models_get_404_and_are_not_billed(profile):
    cfg = ServerConfig(api_key_env=KEY_ENV, known_models=("tiny",))
    with serve_in_thread(cfg, CannedBackend(1, profile)) as (url, server):
        status, _, raw = post(url, chat("hi", model="tiny/typo"))
        assert status == 404 and json.loads(raw)["error"] == {"code": 404,
                                                               "message": "No endpoints found for tiny/typo."}
        assert server.counts.get("billed_completion_tokens", 0) == 0
        f = interpret(status, raw)
        assert isinstance(f, Failure) and f.failure_class == "sample" and f.signature
        assert post(url, chat("hi"))[0] == 200  # chat() asks for "tiny"
    assert parse_args(["--known-models", "a,b"])[0].known_models == ("a", "b")
    assert parse_args([])[0].known_models == ()
    assert parse_args(["--fault-usage-string", "0.2"])[0].rates == {"usage-string": 0.2}


@pytest.mark.parametrize("profile_name", ["deepseek", "qwen3"])  # qwen3 pads </think> with newlines
def test_long_answers_are_about_n_tokens_billed_exactly_and_vary_by_prompt(profile_name):
    """--answer-tokens: every answer's billed count is what the client's rebuild of its text gives back, the
    whole answer (reasoning, </think>, content, end of turn) is within a few tokens of N, and prompts differ."""
    p = load_profile(profile_name)
    n = 600
    with serve_in_thread(ServerConfig(), CannedBackend(1, p, answer_tokens=n)) as (url, server):
        contents, billed = set(), 0
        for thinking in (True, False):
            for i in range(6):
                reasoning = {"enabled": thinking}
                status, _, raw = post(url, chat(f"question {i}", max_tokens=4 * n, reasoning=reasoning), key=None)
                body = json.loads(raw)
                usage, message = body["usage"], body["choices"][0]["message"]
                assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
                assert abs(usage["completion_tokens"] - n) <= 4, usage
                rebuilt = rebuild_from_response(p, body, thinking)
                assert len(rebuilt.ids) == usage["completion_tokens"] and rebuilt.billed_delta == 0
                assert rebuilt.ids[-1] == p.eot_id
                if thinking:
                    assert message["reasoning"] and usage["completion_tokens_details"]["reasoning_tokens"] == \
                        rebuilt.ids.index(p.think_end_id) > n // 3
                else:
                    assert message["reasoning"] is None and usage["completion_tokens_details"]["reasoning_tokens"] == 0
                contents.add(message["content"])
                billed += usage["completion_tokens"]
        assert len(contents) >= 8  # not one answer for all: the prompt picks one of ANSWER_VARIANTS
        again = json.loads(post(url, chat("question 0", max_tokens=4 * n, reasoning={"enabled": True}), key=None)[2])
        first = json.loads(post(url, chat("question 0", max_tokens=4 * n, reasoning={"enabled": True}), key=None)[2])
        assert again["choices"][0]["message"] == first["choices"][0]["message"]  # deterministic per prompt
        billed += 2 * first["usage"]["completion_tokens"]
        assert server.counts["billed_completion_tokens"] == billed  # the server's own bill: the usage it sent

        # max_tokens below the answer: its ids cut there, billed exactly the limit, rebuilt to the same count
        status, _, raw = post(url, chat("question 1", max_tokens=n // 4, reasoning={"enabled": True}), key=None)
        cut = json.loads(raw)
        assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == n // 4
        assert len(rebuild_from_response(p, cut, True).ids) == n // 4


def test_long_answer_text_fits_its_size_and_default_answer_is_unchanged(profile):
    for n in (1, 7, 300, 2000):
        got = len(profile.encode(sized_text(profile, n, seed=5)))
        assert n - 3 <= got <= n
    assert sized_text(profile, 300, seed=5) == sized_text(profile, 300, seed=5) != sized_text(profile, 300, seed=6)
    variants = {answer_variant({"messages": [{"role": "user", "content": f"q{i}"}], "seed": 0}) for i in range(200)}
    assert len(variants) > ANSWER_VARIANTS // 2 and all(0 <= v < ANSWER_VARIANTS for v in variants)

    canned = CannedBackend(1, profile)  # no --answer-tokens: the one short answer, counted as before
    assert canned.content == "Here is a short canned answer from the load-test server."
    assert canned.n_content == len(profile.encode(canned.content)) + 1
    assert canned.n_reasoning == len(profile.encode(canned.reasoning))
    with serve_in_thread(ServerConfig(), canned) as (url, _):
        body = json.loads(post(url, chat("hi", max_tokens=64, reasoning={"enabled": True}), key=None)[2])
    assert body["choices"][0]["message"]["content"] == canned.content
    assert body["usage"]["completion_tokens"] == canned.n_reasoning + 1 + canned.n_content

    assert parse_args(["--no-model", "--answer-tokens", "2000"])[1].answer_tokens == 2000
    assert parse_args([])[1].answer_tokens is None
    for bad in (["--answer-tokens", "0"], ["--answer-tokens", "x"], ["--model-dir", "m", "--answer-tokens", "5"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert make_backend(None, "deepseek", 1, True, 50).answer_tokens == 50
    with pytest.raises(ValueError):
        CannedBackend(1, None, answer_tokens=10)  # sizing needs the tokenizer
