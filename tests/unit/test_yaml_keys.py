"""A key written twice in one YAML mapping is a ConfigError naming it: PyYAML keeps the last one silently, which
would drop a cap written first."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.base.config import ConfigError
from pipeline.run.config import load_config

HEAD = """\
output_dir: runs/test
model: {profile: deepseek, path: models/tiny, build_tiny: true}
datasets:
  - {name: chat, path: prompts/chat.jsonl, format: messages}
"""

SOURCE = """\
sources:
  - kind: openrouter
    name: api
    model: moonshotai/kimi-k2.5
    budgets_usd: {chat: 5.0}
"""


def _load(tmp_path: Path, text: str):
    (tmp_path / "prompts").mkdir(exist_ok=True)
    (tmp_path / "prompts" / "chat.jsonl").write_text("{}\n")
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(path, base_dir=tmp_path)


def test_the_config_without_a_repeated_key_loads(tmp_path: Path) -> None:
    cfg = _load(tmp_path, HEAD + SOURCE)
    assert cfg.sources[0].usd_budget("chat") == 5.0


@pytest.mark.parametrize(
    ("text", "key", "lines"),
    [
        # a dollar cap pasted twice, the second unlimited: the cap would vanish without a word
        (HEAD + SOURCE + "    budgets_usd: {chat: unlimited}\n", "budgets_usd", "lines 9 and 10"),
        # a whole top-level section twice
        (HEAD + SOURCE + "datasets: []\n", "datasets", "lines 3 and 10"),
        # twice inside a flow mapping
        (HEAD + SOURCE.replace("{chat: 5.0}", "{chat: 5.0, chat: 50.0}"), "chat", "lines 9 and 9"),
    ],
)
def test_a_key_written_twice_is_refused_naming_it(tmp_path: Path, text: str, key: str, lines: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    msg = str(err.value)
    assert "not valid YAML" in msg and f"key {key!r} appears twice ({lines})" in msg


def test_a_merge_key_and_a_key_beside_it_are_not_a_repeat(tmp_path: Path) -> None:
    text = HEAD.replace("datasets:", "x-caps: &caps {chat: 5.0}\ndatasets:") + SOURCE.replace(
        "    budgets_usd: {chat: 5.0}\n", "    budgets_usd:\n      <<: *caps\n      chat: 2.0\n")
    with pytest.raises(ConfigError, match="x-caps"):  # the anchor's home is not a config key: a clear refusal
        _load(tmp_path, text)
    text = HEAD + SOURCE.replace("    budgets_usd: {chat: 5.0}\n",
                                 "    budgets_usd:\n      <<: {chat: 5.0}\n      chat: 2.0\n")
    assert _load(tmp_path, text).sources[0].usd_budget("chat") == 2.0
