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

        with pytest.raises(errors.UnauthorizedResponseError):
            with openrouter.OpenRouter(api_key="wrong", server_url=url, retry_config=no_retry) as bad:
                bad.chat.send(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4)
        err = client.chat.send(model="tiny", messages=[{"role": "user", "content": "x [[fault:always-200-error]]"}],
                               max_tokens=4)
        assert err.choices[0].finish_reason == "error"
        empty = client.chat.send(model="tiny", max_tokens=4,
                                 messages=[{"role": "user", "content": "x [[fault:always-empty-choices]]"}])
        assert empty.choices == []
    # a provider's error as an HTTP status: only without padding (after it, the status is already 200)
    with serve_in_thread(ServerConfig(api_key_env=KEY_ENV), hf_backend) as (url, server), \
            openrouter.OpenRouter(api_key=KEY, server_url=url, retry_config=no_retry) as client:
        with pytest.raises(errors.TooManyRequestsResponseError) as e429:
            client.chat.send(model="tiny", messages=[{"role": "user", "content": "x [[fault:always-429]]"}],
                             max_tokens=4)
        assert e429.value.data.error.code == 429
        with pytest.raises(errors.BadGatewayResponseError):
            client.chat.send(model="tiny", messages=[{"role": "user", "content": "x [[fault:always-502]]"}],
                             max_tokens=4)


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
        # routing that leaves no provider is a request error (a config's), not a 503 worth retrying
        status, _, raw = post(url, chat("hi", provider={"ignore": list(cfg.providers)}))
        assert status == 404 and json.loads(raw)["error"]["message"].startswith("No allowed providers")
        status, _, raw = post(url, chat("hi", provider={"only": ["Nobody"]}))
        assert status == 404 and json.loads(raw)["error"]["metadata"]["requested_providers"] == ["Nobody"]
        assert post(url, chat("hi [[fault:always-503]]"))[0] == 503

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


def test_provider_errors_after_padding_come_in_a_200_body(profile):
    """Once padding has gone out the status is 200: a provider's 429/502/503 (and a flaky provider's 502) come as
    ``{"error": ...}`` in the body, with no Retry-After; checks made before any provider is called (request,
    credits, routing, moderation) still answer with their status, before any padding."""
    cfg = ServerConfig(padding=32, retry_after_s=2, flaky_providers={"Beta": 1.0}, providers=("Alpha", "Beta"))
    with serve_in_thread(cfg, CannedBackend(1, profile)) as (url, server):
        for code in (429, 502, 503):
            status, headers, raw = post(url, chat(f"hi [[fault:always-{code}]]", provider={"only": ["Alpha"]}),
                                        key=None)
            assert status == 200 and raw[:32].strip() == b"" and "Retry-After" not in headers, (code, headers)
            err = json.loads(raw)["error"]
            assert err["code"] == code and err["metadata"]["provider_name"] == "Alpha", err
            f = interpret(status, raw)
            assert isinstance(f, Failure) and f.retryable and f.status == code and not f.maybe_billed
        status, _, raw = post(url, chat("hi", provider={"only": ["Beta"]}), key=None)
        assert status == 200 and json.loads(raw)["error"]["metadata"]["provider_name"] == "Beta"  # flaky: 502
        assert server.counts["status_502"] == 2 and server.counts.get("billed_completion_tokens", 0) == 0
        for marker, code in (("moderation", 403), ("402", 402), ("context", 400)):
            status, _, raw = post(url, chat(f"hi [[fault:{marker}]]"), key=None)
            assert status == code and raw[:1] == b"{", marker  # refused before the padding
        assert post(url, chat("hi", provider={"only": ["Nobody"]}), key=None)[0] == 404
    # no padding: the statuses themselves; a 429 carries Retry-After unless it is configured away
    for over, header in (({"retry_after_s": 2}, "2"), ({"retry_after_s": None}, None)):
        with serve_in_thread(ServerConfig(**over), CannedBackend(1, profile)) as (url, _):
            status, headers, raw = post(url, chat("hi [[fault:always-429]]"), key=None)
            assert status == 429 and headers.get("Retry-After") == header and json.loads(raw)["error"]["code"] == 429
    assert parse_args(["--no-retry-after"])[0].retry_after_s is None
    assert parse_args(["--retry-after", "3"])[0].retry_after_s == 3


def test_credit_check_weighs_max_tokens_against_what_is_left(profile):
    """OpenRouter refuses (402) a request whose max_tokens could cost more than the credit left, before
    generating; without max_tokens it assumes the model's most."""
    cfg = ServerConfig(credits_tokens=100, max_output_tokens=4096)
    with serve_in_thread(cfg, CannedBackend(1, profile)) as (url, server):
        status, _, raw = post(url, chat("hi", max_tokens=101), key=None)
        assert status == 402 and "can only afford 100" in json.loads(raw)["error"]["message"]
        assert interpret(status, raw).failure_class == "account"
        body = chat("hi")
        del body["max_tokens"]
        status, _, raw = post(url, body, key=None)
        assert status == 402 and "up to 4096 tokens" in json.loads(raw)["error"]["message"]
        assert server.counts.get("billed_completion_tokens", 0) == 0 and not server.generations
        status, _, raw = post(url, chat("hi", max_tokens=100), key=None)  # fits: served and billed
        assert status == 200
        left = 100 - server.counts["billed_completion_tokens"]
        assert post(url, chat("hi", max_tokens=left + 1), key=None)[0] == 402
        assert post(url, chat("hi", max_tokens=left), key=None)[0] == 200
    assert parse_args(["--credits", "5", "--max-output-tokens", "64"])[0].max_output_tokens == 64


BAD_REQUESTS = [
    ({"reasoning": {"effort": "high", "max_tokens": 100}}, "not both"),
    ({"reasoning": {"effrot": "high"}}, "unrecognized keys ['effrot']"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"enabled": "yes"}}, "reasoning.enabled"),
    ({"reasoning": "high"}, "reasoning: expected an object"),
    ({"provider": {"ignore": "Alpha"}}, "provider.ignore"),
    ({"provider": {"only": "Beta"}}, "provider.only"),
    ({"provider": {"order": [1]}}, "provider.order"),
    ({"provider": {"sort": "cheapest"}}, "provider.sort"),
    ({"provider": {"data_collection": "maybe"}}, "provider.data_collection"),
    ({"provider": {"quantizations": ["fp9"]}}, "provider.quantizations"),
    ({"provider": {"allow_fallbacks": "no"}}, "provider.allow_fallbacks"),
    ({"provider": {"max_price": {"completion": "abc"}}}, "max_price.completion"),
    ({"provider": {"max_price": {"completion": None}}}, "max_price.completion"),
    ({"provider": {"max_price": {"completion": -5}}}, "max_price.completion"),
    ({"provider": {"max_price": {"bogus": 1}}}, "max_price: unrecognized keys"),
    ({"provider": {"max_price": 3}}, "max_price: expected an object"),
    ({"temperature": 7}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 3}, "top_p"),
    ({"temperature": True}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stream": True}, "stream"),
    ({"messages": ["hello"]}, "messages[0]: expected an object"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": []}, "messages"),
]


@pytest.mark.parametrize(("over", "why"), BAD_REQUESTS)
def test_requests_the_real_api_refuses_get_its_json_400(profile, over, why):
    with serve_in_thread(ServerConfig(), CannedBackend(1, profile)) as (url, server):
        status, headers, raw = post(url, {**chat("hi"), **over}, key=None)
        assert status == 400 and headers["Content-Type"].startswith("application/json"), raw
        err = json.loads(raw)["error"]
        assert err["code"] == 400 and why in err["message"], err
        assert server.counts.get("billed_completion_tokens", 0) == 0
        assert interpret(status, raw).failure_class == "sample"


def test_the_clients_own_requests_are_valid(profile):
    """Every request shape the HTTP source builds (reasoning per style and thinking, routing preferences, the
    max_price of a dollar cap) passes the stand-in's validation and is served."""
    from pipeline.base.config import SamplingConfig
    from pipeline.generate.sources.http.config import OpenRouterSourceConfig
    from pipeline.generate.sources.http.engine import max_price, request_options
    from pipeline.generate.sources.http.wire import build_request

    sampling = SamplingConfig(temperature=0.6, top_p=0.95, max_tokens=32, seed=3)
    provider = {"order": ["Alpha", "Beta"], "allow_fallbacks": True, "require_parameters": True,
                "data_collection": "deny", "quantizations": ["int4", "fp8", "bf16"], "sort": "price",
                "max_price": {"prompt": 5, "completion": 10.5, "request": 0, "image": 0}}
    configs = [{}, {"reasoning": {"enabled": True, "effort": "high"}}, {"reasoning": {"max_tokens": 64}},
               {"reasoning": {"enabled": True, "exclude": True}}, {"reasoning_style": "chat_template_kwargs"},
               {"reasoning_style": "none"}, {"provider": provider}, {"provider": {"only": ["Gamma"]}}]
    with serve_in_thread(ServerConfig(), CannedBackend(1, profile)) as (url, server):
        for over in configs:
            cfg = OpenRouterSourceConfig.model_validate({"model": "tiny", "base_url": url,
                                                         "api_key_required": False, **over})
            opts = request_options(cfg, sampling)
            for thinking in (True, False):
                body = build_request([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "hi"}], None, thinking, opts, excluded=["Beta"])
                capped = dict(body, provider={**body.get("provider", {}),
                                              "max_price": max_price((3e-6, 4e-6), (body.get("provider") or {})
                                                                     .get("max_price"))})
                for b in (body, capped):
                    status, _, raw = post(url, b, key=None)
                    assert status == 200 and isinstance(interpret(status, raw), Reply), (over, thinking, b, raw)


def test_a_short_max_tokens_cuts_the_canned_text_to_what_is_billed(profile):
    """A max_tokens under the canned answer cuts its ids there: the text sent rebuilds to the billed count, and
    prompt tokens are the rendered prompt's (not a word count)."""
    backend = CannedBackend(1, profile)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}]
    with serve_in_thread(ServerConfig(), backend) as (url, _):
        for thinking in (True, False):
            rendered = len(profile.render_prompt(messages, None, thinking).ids)
            for limit in (1, 3, 12, backend.n_reasoning + 3, 200):
                body = chat("x", messages=messages, max_tokens=limit, reasoning={"enabled": thinking})
                status, _, raw = post(url, body, key=None)
                answer = json.loads(raw)
                usage = answer["usage"]
                assert status == 200 and usage["prompt_tokens"] == rendered, usage
                rebuilt = rebuild_from_response(profile, answer, thinking)
                assert len(rebuilt.ids) == usage["completion_tokens"] == min(limit, usage["completion_tokens"])
                cut = usage["completion_tokens"] == limit < 200
                assert answer["choices"][0]["finish_reason"] == ("length" if cut else "stop"), (limit, answer)
                if thinking:
                    reasoning_ids = rebuilt.ids.index(profile.think_end_id) if profile.think_end_id in rebuilt.ids \
                        else len(rebuilt.ids)
                    assert usage["completion_tokens_details"]["reasoning_tokens"] == reasoning_ids


def test_irregular_but_real_answer_shapes(profile):
    """A provider's own finish word, reasoning only in reasoning_details, no usage, usage without cost: each a
    billed success, as a provider or an OpenAI-compatible gateway sends it."""
    cfg = ServerConfig(providers=("Alpha", "Beta", "Gamma"))
    with serve_in_thread(cfg, CannedBackend(1, profile)) as (url, server):
        natives = set()
        for who in cfg.providers:
            for limit in (64, 3):
                choice = json.loads(post(url, chat("hi [[fault:always-native-finish]]", max_tokens=limit,
                                                   provider={"only": [who]}), key=None)[2])["choices"][0]
                assert choice["finish_reason"] == ("stop" if limit == 64 else "length")
                natives.add(choice["native_finish_reason"])
        assert {"end_turn", "max_tokens", "STOP", "MAX_TOKENS"} <= natives

        thinking = {"reasoning": {"enabled": True}, "max_tokens": 64}
        answer = json.loads(post(url, chat("hi [[fault:always-reasoning-details]]", **thinking), key=None)[2])
        message = answer["choices"][0]["message"]
        assert message["reasoning"] is None and message["reasoning_details"][0]["type"] == "reasoning.text"
        assert message["reasoning_details"][0]["text"] == CannedBackend(1, profile).reasoning
        r = interpret(200, json.dumps(answer))
        assert isinstance(r, Reply) and r.completion.reasoning == message["reasoning_details"][0]["text"]

        before = server.counts["billed_completion_tokens"]
        answer = json.loads(post(url, chat("hi [[fault:always-no-usage]]"), key=None)[2])
        assert "usage" not in answer and answer["choices"][0]["message"]["content"]
        assert server.counts["billed_completion_tokens"] > before  # billed all the same
        r = interpret(200, json.dumps(answer))
        assert isinstance(r, Reply) and r.billed == -1 and not r.cost_known

        usage = json.loads(post(url, chat("hi [[fault:always-no-cost]]"), key=None)[2])["usage"]
        assert "cost" not in usage and usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 0
    assert parse_args(["--fault-no-usage", "0.1", "--fault-native-finish", "0.2"])[0].rates == \
        {"no-usage": 0.1, "native-finish": 0.2}


def test_a_model_folders_generation_config_does_not_leak_into_generation(tiny_target, hf_backend, tmp_path):
    """transformers fills what ``generate`` is not given from the folder's generation_config.json; a provider
    applies only the sampling it is sent, so such a file must not change the ids."""
    import shutil

    p = hf_backend.profile
    prompts = [p.render_prompt([{"role": "user", "content": f"Prompt {i}"}], None, True).ids for i in range(3)]
    cases = [(prompt, temperature, seed) for prompt in prompts for temperature, seed in ((0.0, None), (1.0, 7))]
    honest = [hf_backend._generate_ids(prompt, 12, t, 1.0, seed) for prompt, t, seed in cases]
    folder = tmp_path / "leaky"
    shutil.copytree(tiny_target, folder)
    (folder / "generation_config.json").write_text(json.dumps(  # among them: every honest answer's first token banned
        {"eos_token_id": p.eot_id, "do_sample": True, "repetition_penalty": 1.5, "no_repeat_ngram_size": 1,
         "suppress_tokens": sorted({ids[0] for ids in honest if ids})}))
    leaky = TransformersBackend(str(folder))
    try:
        assert [leaky._generate_ids(prompt, 12, t, 1.0, seed) for prompt, t, seed in cases] == honest
    finally:
        leaky.close()
