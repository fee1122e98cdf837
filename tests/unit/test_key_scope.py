"""Which API key a source may send, and where: the default variable only to openrouter.ai over https, a
named variable to its own base_url, and never a key over plain http off this machine."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError

from pipeline.generate.sources.http.config import (
    OpenRouterSourceConfig,
    base_url_problem,
    is_loopback_host,
    normalised_base_url,
)


def src(**kw) -> OpenRouterSourceConfig:
    return OpenRouterSourceConfig(model="m", **kw)


@pytest.mark.parametrize(("kw", "expected"), [
    ({}, "OPENROUTER_API_KEY"),  # default variable, OpenRouter over https
    ({"base_url": "https://OpenRouter.AI/api/v1"}, "OPENROUTER_API_KEY"),  # hosts are case-insensitive
    ({"base_url": "https://openrouter.ai./api/v1"}, "OPENROUTER_API_KEY"),  # the same host, fully qualified
    ({"base_url": "https://gateway.example/v1"}, None),  # default variable, another host: no key
    ({"base_url": "https://openrouter.ai.evil.com/api/v1"}, None),  # not OpenRouter's host
    ({"base_url": "https://evilopenrouter.ai/api/v1"}, None),
    ({"base_url": "https://evil.com/openrouter.ai/api/v1"}, None),
    ({"base_url": "http://127.0.0.1:8000/v1"}, None),  # a local server does not get the OpenRouter key
    ({"base_url": "https://gateway.example/v1", "api_key_env": "GATEWAY_KEY"}, "GATEWAY_KEY"),
    ({"base_url": "https://gateway.example/v1", "api_key_env": "OPENROUTER_API_KEY"}, "OPENROUTER_API_KEY"),
    ({"base_url": "http://127.0.0.1:8000/v1", "api_key_env": "LOCAL_KEY"}, "LOCAL_KEY"),
    ({"base_url": "http://localhost:8000/v1", "api_key_env": "LOCAL_KEY"}, "LOCAL_KEY"),
    ({"base_url": "http://127.3.4.5/v1", "api_key_env": "LOCAL_KEY"}, "LOCAL_KEY"),  # all of 127.0.0.0/8
    ({"base_url": "http://[::1]:8000/v1", "api_key_env": "LOCAL_KEY"}, "LOCAL_KEY"),
    ({"api_key_required": False}, None),  # no key wanted, no variable named: nothing sent
    ({"api_key_required": False, "base_url": "http://127.0.0.1:1/v1"}, None),
    ({"api_key_required": False, "api_key_env": "K"}, "K"),  # named: sent when set, not required
])
def test_key_env(kw, expected):
    assert src(**kw).key_env() == expected


@pytest.mark.parametrize("kw", [
    {"base_url": "http://gateway.example/v1", "api_key_env": "GATEWAY_KEY"},
    {"base_url": "http://10.0.0.5:8000/v1", "api_key_env": "K"},  # private network is still a network
    {"base_url": "http://10.0.0.5:8000/v1", "api_key_env": "K", "api_key_required": False},
    {"base_url": "http://openrouter.ai/api/v1"},  # the default variable to OpenRouter, in clear
    {"base_url": "http://localhost.evil.com/v1", "api_key_env": "K"},
    {"base_url": "http://128.0.0.1/v1", "api_key_env": "K"},
])
def test_a_key_over_plain_http_off_this_machine_is_refused_with_the_reason(kw):
    with pytest.raises(ValidationError) as err:
        src(**kw)
    msg = str(err.value)
    assert "plain http" in msg and "not a loopback host" in msg and "use https" in msg


def test_plain_http_without_any_key_is_allowed():
    """A keyless server on the network (default variable, not OpenRouter) gets no key, so nothing to refuse."""
    s = src(base_url="http://10.0.0.5:8000/v1", api_key_required=False)
    assert s.key_env() is None


@pytest.mark.parametrize(("url", "reason"), [
    ("https://openrouter.ai@evil.com/api/v1", "user info"),  # reads as OpenRouter, goes to evil.com
    ("https://user:secret@openrouter.ai/api/v1", "user info"),
    ("ftp://openrouter.ai/api/v1", "must start with https://"),
    ("openrouter.ai/api/v1", "must start with https://"),
    ("https:///api/v1", "has no host"),
    ("https://openrouter.ai:port/api/v1", "not a valid URL"),
    ("http://[::1/v1", "not a valid URL"),
])
def test_unusable_base_urls_are_refused(url, reason):
    assert reason in (base_url_problem(url) or "")
    with pytest.raises(ValidationError) as err:
        src(base_url=url)
    assert reason in str(err.value)
    assert "secret" not in str(err.value)  # the refused URL is never echoed: it may hold a credential


def test_key_env_stays_safe_after_assignment():
    """Validators do not re-run on assignment; key_env() itself never sends a key in clear off the machine."""
    s = src(api_key_env="K")
    s.base_url = "http://gateway.example/v1"
    assert s.key_env() is None
    s.base_url = "https://openrouter.ai@evil.com/v1"
    assert s.key_env() is None


def test_whether_the_variable_was_named_survives_pickling():
    """Ray ships the config to the source actors by pickle: the default stays the default there."""
    default = pickle.loads(pickle.dumps(src(base_url="https://gateway.example/v1")))
    named = pickle.loads(pickle.dumps(src(base_url="https://gateway.example/v1", api_key_env="G")))
    assert (default.key_env(), named.key_env()) == (None, "G")


def test_loopback_and_normalisation_helpers():
    assert all(map(is_loopback_host, ["127.0.0.1", "127.255.0.9", "::1", "localhost"]))
    assert not any(map(is_loopback_host, ["128.0.0.1", "10.0.0.1", "localhost.evil.com", "", "::2"]))
    assert normalised_base_url("HTTPS://OpenRouter.ai.:443/api/v1/") == "https://openrouter.ai/api/v1"
    assert normalised_base_url("http://[::1]:8000/v1") == "http://[::1]:8000/v1"
