"""Files a run cannot read end with one clear line (exit 2), naming the file and what to do: a config that is
not UTF-8, a corrupt manifest, a corrupt budget journal, a foreign or corrupt shard. Never a traceback, and
never a silent reset (a budget journal read as empty would spend its budget twice)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.base.config import ConfigError, UnreadableFile
from pipeline.base.layout import RunLayout
from pipeline.base.records import read_rows, read_samples
from pipeline.generate.ledger import read_journal
from pipeline.run.cli import main
from pipeline.run.config import load_config
from pipeline.run.manifest import check_or_write_manifest


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-test")  # `check` asks for it, as a local Ray's run does
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = {"output_dir": str(tmp_path / "out"), "model": {"profile": "deepseek"},
           "datasets": [{"name": "chat", "path": str(tmp_path / "chat.jsonl")}],
           "sources": [{"kind": "openrouter", "name": "api", "model": "m", "budgets": {"chat": 100}}],
           "training": None}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    (tmp_path / "out").mkdir()
    return path


def _check(config: Path, capsys: pytest.CaptureFixture) -> tuple[int, list[str]]:
    code = main(["check", str(config)])
    err = capsys.readouterr().err
    return code, [ln for ln in err.splitlines() if ln.strip()]


def _layout(config: Path) -> RunLayout:
    return RunLayout(config.parent / "out")


def test_a_clean_folder_checks_ok(config, capsys):
    layout = _layout(config)
    layout.samples.mkdir()
    pq.write_table(pa.table({"sample_id": ["a"]}), layout.samples / "s-0.parquet")
    layout.ledger("api").write_text('{"chat": 10}')
    assert _check(config, capsys) == (0, [])


def test_config_not_utf8(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"output_dir: \xff\xfe\n")
    code, lines = _check(path, capsys)
    assert code == 2 and len(lines) == 1
    assert str(path) in lines[0] and "not UTF-8" in lines[0] and "offset 12" in lines[0]


@pytest.mark.parametrize("content", [b'{"profile": "deeps', b"[1, 2]", b"\xff\xfe{}", b""])
def test_corrupt_manifest(config, capsys, content):
    layout = _layout(config)
    layout.manifest.write_bytes(content)
    code, lines = _check(config, capsys)
    assert code == 2 and len(lines) == 1, lines
    assert str(layout.manifest) in lines[0] and "move it aside" in lines[0]
    # the run's own check (before Ray) raises the same: a ConfigError, so `run` prints one line and exits 2
    cfg = load_config(config)
    with pytest.raises(UnreadableFile, match="move it aside"):
        check_or_write_manifest(cfg, layout.root, has_samples=True)
    assert layout.manifest.read_bytes() == content  # left as it was for the user to look at


@pytest.mark.parametrize("content", [
    b'{"chat": 12',  # cut off mid-write by an older writer
    b"[12]",
    b'{"chat": -3}',
    b'{"chat": "12"}',
    b'{"chat": 1.5}',
    b'{"chat": true}',
    b'{"#format": 2, "tokens": {"chat": 5}, "usd": {"chat": "x"}}',
    b'{"#format": 2, "tokens": [5], "usd": {}}',
    b'{"#format": 2, "tokens": {"chat": 5}, "usd": {"chat": -0.5}}',
    b"\xff",
])
def test_corrupt_ledger_journal_is_never_read_as_no_spend(config, capsys, content):
    journal = _layout(config).ledger("api")
    journal.write_bytes(content)
    with pytest.raises(UnreadableFile) as err:
        read_journal(str(journal))
    assert isinstance(err.value, ConfigError) and str(journal) in str(err.value)
    assert "moving it aside forgets that spend" in str(err.value)
    code, lines = _check(config, capsys)
    assert code == 2 and len(lines) == 1 and str(journal) in lines[0], lines


def test_readable_ledger_journals(tmp_path):
    v1, v2 = tmp_path / "v1.json", tmp_path / "v2.json"
    v1.write_text('{"chat": 12, "math": 0}')
    v2.write_text('{"#format": 2, "tokens": {"chat": 7}, "usd": {"chat": 0.25}}')
    assert read_journal(str(v1)) == {"chat": 12, "math": 0}
    assert read_journal(str(v2)) == {"chat": 7}
    assert read_journal(str(tmp_path / "absent.json")) == {} and read_journal(None) == {}


@pytest.mark.parametrize("folder", ["samples", "quarantine"])
def test_a_file_in_a_shard_folder_that_is_not_parquet(config, capsys, folder):
    where = getattr(_layout(config), folder)
    where.mkdir()
    pq.write_table(pa.table({"sample_id": ["a"]}), where / "a.parquet")
    (where / "b.parquet").write_text("not parquet at all\n")
    with pytest.raises(UnreadableFile, match="not a readable parquet file") as err:
        read_rows(where, ["sample_id"])
    assert str(where / "b.parquet") in str(err.value)
    code, lines = _check(config, capsys)
    assert code == 2 and len(lines) == 1 and str(where / "b.parquet") in lines[0], lines


def test_a_foreign_parquet_names_its_missing_columns(tmp_path):
    pq.write_table(pa.table({"sample_id": ["a"], "other": [1]}), tmp_path / "x.parquet")
    with pytest.raises(UnreadableFile) as err:
        read_rows(tmp_path, ["sample_id", "dataset", "source"])
    assert str(tmp_path / "x.parquet") in str(err.value) and "['dataset', 'source']" in str(err.value)


def test_read_samples_keeps_the_first_copy_of_each_sample_id(tmp_path):
    pq.write_table(pa.table({"sample_id": ["a", "b", "a"], "n": [1, 2, 3]}), tmp_path / "s-1.parquet")
    pq.write_table(pa.table({"sample_id": ["b", "c"], "n": [4, 5]}), tmp_path / "s-2.parquet")
    pq.write_table(pa.table({"sample_id": ["c", "d"], "n": [6, 7]}), tmp_path / "s-0.parquet")  # sorts first
    rows, dropped = read_samples(tmp_path, ["sample_id", "n"])
    assert rows == [{"sample_id": "c", "n": 6}, {"sample_id": "d", "n": 7}, {"sample_id": "a", "n": 1},
                    {"sample_id": "b", "n": 2}]
    assert dropped == 3
    only_n, dropped = read_samples(tmp_path, ["n"])  # sample_id read to dedup, not returned
    assert only_n == [{"n": 6}, {"n": 7}, {"n": 1}, {"n": 2}] and dropped == 3
    assert read_samples(tmp_path / "absent", ["sample_id"]) == ([], 0)


def test_the_manifest_written_by_a_run_reads_back(config):
    cfg = load_config(config)
    out = Path(cfg.output_dir)
    written = check_or_write_manifest(cfg, out, has_samples=False)
    assert check_or_write_manifest(cfg, out, has_samples=True) == written
    assert json.loads(RunLayout(out).manifest.read_text()) == written
