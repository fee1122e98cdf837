"""`pipeline check CONFIG` says what `run` would refuse before Ray starts, without writing anything: the output
folder, a missing API key on a local Ray, a prompt file that does not read, a folder of samples made with other
settings. A config `check` passes is one `run` starts on."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.base.layout import RunLayout
from pipeline.run.cli import main


def _config(tmp_path: Path, **edits) -> Path:
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = {"output_dir": str(tmp_path / "out"), "model": {"profile": "deepseek"},
           "datasets": [{"name": "chat", "path": str(tmp_path / "chat.jsonl")}],
           "sources": [{"kind": "openrouter", "name": "api", "model": "m", "budgets": {"chat": 100}}],
           "training": None, **edits}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _check(path: Path, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main(["check", str(path)])
    return code, capsys.readouterr().err.strip()


@pytest.fixture(autouse=True)
def key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-test")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_a_config_run_would_start_on_checks_ok_and_writes_nothing(tmp_path, capsys):
    path = _config(tmp_path)
    assert _check(path, capsys) == (0, "")
    assert not (tmp_path / "out").exists()  # check creates no folder


def test_a_missing_api_key_on_a_local_ray(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY")
    code, err = _check(_config(tmp_path), capsys)
    assert code == 2 and "environment variable OPENROUTER_API_KEY is not set" in err
    assert code == 2 and _check(_config(tmp_path, ray={"address": "auto"}), capsys)[0] == 0  # a cluster's own env


@pytest.mark.parametrize(("content", "name", "why"), [(b"{not json", "chat.json", "not valid JSON"),
                                                      (b"PAR1 but not parquet", "chat.parquet", "chat.parquet")])
def test_a_prompt_file_that_does_not_read(tmp_path, capsys, content, name, why):
    (tmp_path / name).write_bytes(content)
    path = _config(tmp_path, datasets=[{"name": "chat", "path": str(tmp_path / name)}])
    code, err = _check(path, capsys)
    assert code == 2 and err.startswith("input error:") and why in err and len(err.splitlines()) == 1


def test_an_output_dir_that_is_a_file_or_under_one(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    code, err = _check(_config(tmp_path, output_dir=str(tmp_path / "file")), capsys)
    assert code == 2 and "is a file, not a folder" in err
    code, err = _check(_config(tmp_path, output_dir=str(tmp_path / "file" / "out")), capsys)
    assert code == 2 and "a part of the path is a file" in err


def test_a_folder_of_samples_made_with_other_settings(tmp_path, capsys):
    path = _config(tmp_path)
    layout = RunLayout(tmp_path / "out")
    layout.samples.mkdir(parents=True)
    pq.write_table(pa.table({"sample_id": ["a"]}), layout.samples / "s-0.parquet")
    assert main(["check", str(path)]) == 0
    from pipeline.run.config import load_config
    from pipeline.run.manifest import run_manifest

    manifest = run_manifest(load_config(path))
    manifest["sampling"]["temperature"] = 0.123  # the folder's samples were made at another temperature
    layout.manifest.write_text(json.dumps(manifest))
    capsys.readouterr()
    code, err = _check(path, capsys)
    assert code == 2 and err.startswith("refusing to resume:") and "sampling.temperature" in err
