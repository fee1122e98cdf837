"""The HTTP source's config: a key that would never be sent, credentials written into `headers`, the URL its
requests go to, and the settings a resume must keep (extra_body)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pipeline.base.config import ConfigError
from pipeline.generate.sources.http.config import OpenRouterSourceConfig
from pipeline.run.config import load_config
from pipeline.run.manifest import differences, run_manifest


def _config(tmp_path: Path, **source: object) -> Path:
    cfg = {"output_dir": "out", "model": {"profile": "deepseek"}, "datasets": [{"name": "chat", "path": "c.jsonl"}],
           "sources": [{"kind": "openrouter", "name": "api", "model": "x/y", "budgets": {"chat": 1000}, **source}]}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _error(tmp_path: Path, **source: object) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(_config(tmp_path, **source), base_dir=tmp_path, check_paths=False)
    return str(err.value)


# -- a key that is required must be one that goes out ---------------------------------------


@pytest.mark.parametrize("url", ["https://gateway.example.com/v1", "http://127.0.0.1:8000/v1",
                                 "https://openrouter.ai.evil.com/api/v1"])
def test_another_endpoint_that_needs_a_key_must_name_its_variable(tmp_path, url):
    """The default OPENROUTER_API_KEY only ever goes to openrouter.ai: such a source passed `check` and then
    halted in its actors with a false "OPENROUTER_API_KEY is not set"."""
    msg = _error(tmp_path, base_url=url)
    assert "source 'api'" in msg and "set api_key_env: <VAR> for this endpoint, or api_key_required: false" in msg
    for fix in ({"api_key_env": "GATEWAY_KEY"}, {"api_key_required": False}):
        src = load_config(_config(tmp_path, base_url=url, **fix), base_dir=tmp_path, check_paths=False).sources[0]
        assert src.key_env() == fix.get("api_key_env")
    assert load_config(_config(tmp_path), base_dir=tmp_path, check_paths=False).sources[0].key_env() == \
        "OPENROUTER_API_KEY"


def test_the_key_error_never_echoes_the_url(tmp_path):
    """A base_url may carry a secret in its query (errors never echo it): the message names the host only."""
    msg = _error(tmp_path, base_url="https://gw.example.com/v1?sig=s3cr3t")
    assert "gw.example.com" in msg and "s3cr3t" not in msg


@pytest.mark.parametrize("name", ["", "$GATEWAY_KEY", "sk-or-v1-abc", "1KEY", "MY KEY"])
def test_api_key_env_must_be_a_variable_name(name):
    with pytest.raises(ValidationError, match="is not an environment variable name"):
        OpenRouterSourceConfig(model="m", base_url="https://gw.example.com/v1", api_key_env=name)


# -- credentials never sit in headers ---------------------------------------------------------


@pytest.mark.parametrize("header", ["Authorization", "authorization", "Proxy-Authorization", "api-key",
                                    "X-API-Key", "x-goog-api-key", "X-Auth-Token", "Cookie", "X-Secret"])
@pytest.mark.parametrize("url", ["http://10.0.0.5:8000/v1", "https://gateway.example.com/v1",
                                 "http://127.0.0.1:8000/v1"])
def test_a_credential_in_headers_is_refused_wherever_it_would_go(header, url):
    """Over plain http off this machine it would cross the network in clear (the key check looked only at
    api_key_env); anywhere else it is still a secret written into a committed config file."""
    with pytest.raises(ValidationError) as err:
        OpenRouterSourceConfig(model="m", base_url=url, api_key_required=False, headers={header: "Bearer sk-1"})
    msg = str(err.value)
    assert f"['{header}'] would carry a credential" in msg and "api_key_env" in msg and "sk-1" not in msg
    ordinary = {"HTTP-Referer": "https://example.org", "X-Title": "eagle3", "OpenAI-Organization": "org-1"}
    assert OpenRouterSourceConfig(model="m", base_url=url, api_key_required=False, headers=ordinary).headers == \
        ordinary


# -- the request URL -----------------------------------------------------------------------------


@pytest.mark.parametrize(("base", "url"), [
    ("https://openrouter.ai/api/v1", "https://openrouter.ai/api/v1/chat/completions"),
    ("https://openrouter.ai/api/v1/", "https://openrouter.ai/api/v1/chat/completions"),
    ("https://gw.example.com/v1?api-version=2024-06-01",
     "https://gw.example.com/v1/chat/completions?api-version=2024-06-01"),
    ("https://gw.example.com/v1/?a=1&b=2#frag", "https://gw.example.com/v1/chat/completions?a=1&b=2"),
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/chat/completions"),
])
def test_chat_completions_is_appended_to_the_path_and_the_query_kept(base, url):
    """A gateway's `?api-version=...` became `...?api-version=.../chat/completions`."""
    from pipeline.generate.sources.http.engine import chat_completions_url

    assert chat_completions_url(base) == url


def test_the_engine_posts_to_that_url():
    from pipeline.generate.sources.http.engine import HttpEngine, Secret

    cfg = OpenRouterSourceConfig(model="m", base_url="https://gw.example.com/v1?api-version=2024-06-01",
                                 api_key_env="GW_KEY", default_budget=10)
    engine = HttpEngine(cfg, profile=None, ledger=None, api_key=Secret(""))  # type: ignore[arg-type]
    assert engine.url == "https://gw.example.com/v1/chat/completions?api-version=2024-06-01"


# -- extra_body is part of what a sample was made with ------------------------------------------------


def test_a_changed_extra_body_stops_a_resume(tmp_path):
    """extra_body carries decoding settings (top_k, repetition_penalty, stop): a resume with other ones would mix
    two distributions in one training set."""
    def manifest(**source: object) -> dict:
        return run_manifest(load_config(_config(tmp_path, **source), base_dir=tmp_path, check_paths=False))

    old = manifest(extra_body={"top_k": 1, "repetition_penalty": 1.5})
    assert old["sources"][0]["extra_body"] == {"top_k": 1, "repetition_penalty": 1.5}
    assert differences(old, manifest(extra_body={"top_k": 40, "repetition_penalty": 1.5})) == \
        ["sources.api.extra_body.top_k: 1 -> 40"]
    assert differences(old, manifest(extra_body={"repetition_penalty": 1.5, "top_k": 1})) == []
    # a key added or taken away changes the request as much as a changed value (one-sided keys are skipped only
    # among a source's own fields, which pipeline versions record differently)
    assert differences(old, manifest(extra_body={"top_k": 1})) == \
        ["sources.api.extra_body.repetition_penalty: 1.5 -> '<absent>'"]
    assert differences(old, manifest(extra_body={"top_k": 1, "repetition_penalty": 1.5, "min_p": 0.1})) == \
        ["sources.api.extra_body.min_p: '<absent>' -> 0.1"]


def test_a_manifest_written_before_extra_body_was_recorded_still_resumes(tmp_path):
    cfg = load_config(_config(tmp_path), base_dir=tmp_path, check_paths=False)
    new = run_manifest(cfg)
    assert new["sources"][0]["extra_body"] == {}
    old = {**new, "sources": [{k: v for k, v in new["sources"][0].items() if k != "extra_body"}]}
    assert differences(old, new) == []
