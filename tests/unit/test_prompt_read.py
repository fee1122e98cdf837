"""Prompts read in the Ray workers (#26): the same ids and quarantine rows the driver made, blocks of
``block_rows`` rows, skip and only honoured, a broken file failing with the driver's own DatasetError, and a
driver that holds counts, not rows."""

from __future__ import annotations

import json
import logging
import math
import pickle
import random
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.base.config import DatasetConfig, UnreadableFile
from pipeline.base.layout import RunLayout
from pipeline.base.records import QUARANTINE_SCHEMA, quarantine_row, read_rows
from pipeline.prompts.datasets import (
    DatasetError,
    _split_lines,
    check_dataset,
    count_rows,
    iter_dataset,
    load_dataset,
)
from pipeline.prompts.read import (
    PROMPT_SCHEMA,
    TO_DO,
    PromptSet,
    index_dataset,
    index_prompts,
    pass_dataset,
    prompt_dataset,
    read_finished_ids,
    reroute_prompts,
    row_blocks,
    todo_rows,
)
from pipeline.run.config import load_config

ROOT = Path(__file__).resolve().parents[2]
MALFORMED = ROOT / "tests" / "data" / "malformed_messages.jsonl"


def _user(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def _datasets(tmp_path: Path) -> list[DatasetConfig]:
    """A JSONL file with every line ending, a BOM, blank and broken lines; a .json list; a Parquet file with a
    bad row; the shipped malformed fixture; a file capped by max_rows; an empty file."""
    lines = [json.dumps(_user(f"j{i}")).encode() for i in range(30)]
    lines[3], lines[11] = b'{"messages": [oops', b'{"messages": "caf\xe9"}'
    ends = [b"\n", b"\r\n", b"\r"]
    jsonl = tmp_path / "lines.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + b"".join(ln + ends[i % 3] + (b"  \n" if i % 7 == 0 else b"")
                                                 for i, ln in enumerate(lines)))
    as_json = tmp_path / "list.json"
    as_json.write_text(json.dumps([{"instruction": f"q{i}"} for i in range(9)] + [{"instruction": ""}]))
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([_user(f"p{i}") | {"tools": None} for i in range(12)]
                                        + [{"messages": [], "tools": None}]), parquet, row_group_size=5)
    capped = tmp_path / "capped.jsonl"
    capped.write_text("".join(json.dumps(_user(f"c{i}")) + "\n" for i in range(20)))
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    return [DatasetConfig(name="lines", path=str(jsonl)),
            DatasetConfig(name="list", path=str(as_json), format="instruction", thinking=False),
            DatasetConfig(name="pq", path=str(parquet)),
            DatasetConfig(name="mal", path=str(MALFORMED)),
            DatasetConfig(name="capped", path=str(capped), max_rows=7),
            DatasetConfig(name="empty", path=str(empty))]


@pytest.fixture
def run_cfg(tmp_path: Path):
    cfg = load_config(ROOT / "configs" / "tiny_formats.yaml", base_dir=ROOT, check_paths=False)
    cfg.output_dir = str(tmp_path / "out")
    cfg.datasets = _datasets(tmp_path)
    return cfg


# ------------------------------------------------------------------ the streaming reader (no Ray)


def test_split_lines_is_bytes_splitlines_whatever_the_chunks():
    rng = random.Random(0)
    alphabet = [b"a", b"\n", b"\r", b"\r\n", b"\xff", b" ", b"\x0b", b"\x85"]
    for _ in range(3000):
        data = b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        size = rng.randint(1, 6)
        chunks = [b""] + [data[i:i + size] for i in range(0, len(data), size)]
        assert list(_split_lines(iter(chunks))) == data.splitlines(), (data, size)


def test_iter_dataset_is_load_dataset_streamed(tmp_path):
    for d in _datasets(tmp_path):
        rows = list(iter_dataset(d, warn=False))
        good, bad = load_dataset(d)
        assert [r for ok, r in rows if ok] == good and [r for ok, r in rows if not ok] == bad, d.name
        assert count_rows(d) == len(good) + len(bad)
    lines = load_dataset(_datasets(tmp_path)[0])
    assert len(lines[0]) == 28 and [b["row_index"] for b in lines[1]] == [3, 11]
    assert "(lines.jsonl line 5)" in lines[1][0]["reason"]  # line 5 of the file: a blank line came before


def test_reading_stops_at_max_rows(tmp_path):
    d = _datasets(tmp_path)[4]
    assert [r["row_index"] for _, r in iter_dataset(d)] == list(range(7))
    assert count_rows(d) == 7


def test_an_empty_file_warns_once_where_asked(tmp_path, caplog):
    d = _datasets(tmp_path)[5]
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        assert list(iter_dataset(d, warn=False)) == []
        assert caplog.records == []
        assert list(iter_dataset(d)) == [] and count_rows(d) == 0
    assert [r.getMessage() for r in caplog.records] == [f"dataset 'empty': {d.path} holds no rows; nothing to "
                                                        "generate from it"] * 2


@pytest.mark.parametrize(("name", "content"), [
    ("rows.json", b'[{"instruction": "a"},\n {oops}]'),
    ("rows.json", b'{"rows": []}'),
    ("rows.json", b"null"),
    ("rows.json", b'[{"instruction": "\xff"}]'),
    ("rows.json", b"[" * 100_000),  # never closed, too deep for json to say where
    ("rows.json", b'[{"instruction": "a", "n": NaN}, {oops}]'),  # a syntax error after a row refused alone
    ("rows.jsonl", b"\x1f\x8b\x08\x00" + b"\0" * 16),  # gzip
    ("rows.jsonl", '{"instruction": "a"}\r\n'.encode("utf-16")),  # PowerShell's >
    ("rows.json", b"\x1f\x8b\x08\x00" + b"\0" * 16),
    ("rows.parquet", b"not parquet at all"),
    ("rows.parquet", b""),
    ("rows.parquet", b"PAR1" + b"\0" * 64 + b"PAR1"),
])
def test_check_dataset_raises_what_reading_raises(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    d = DatasetConfig(name="x", path=str(path), format="instruction")
    with pytest.raises(DatasetError) as read:
        load_dataset(d)
    for cheap in (check_dataset, count_rows):
        with pytest.raises(DatasetError) as checked:
            cheap(d)
        assert str(checked.value) == str(read.value)


def test_check_dataset_passes_a_readable_file_and_names_a_missing_one(tmp_path):
    for d in _datasets(tmp_path):
        check_dataset(d)
    with pytest.raises(DatasetError, match="file not found"):
        check_dataset(DatasetConfig(name="x", path=str(tmp_path / "gone.jsonl")))


def test_todo_rows_and_blocks(tmp_path):
    d = _datasets(tmp_path)[0]
    good = load_dataset(d)[0]
    skip = {good[0]["sample_id"], good[5]["sample_id"], "lines:3:nothing"}
    assert list(todo_rows(d, skip)) == [r for r in good if r["sample_id"] not in skip]
    only = {good[9]["sample_id"], good[2]["sample_id"], good[5]["sample_id"], "pq:0:elsewhere"}
    assert [r["sample_id"] for r in todo_rows(d, skip, only)] == [good[2]["sample_id"], good[9]["sample_id"]]
    assert list(todo_rows(d, set(), {"pq:0:elsewhere"})) == []
    blocks = list(row_blocks(iter(good), 8))
    assert [b.num_rows for b in blocks] == [8, 8, 8, 4] and all(b.schema == PROMPT_SCHEMA for b in blocks)
    assert [r for b in blocks for r in b.to_pylist()] == good


def test_finished_ids_are_read_rows_ids(tmp_path):
    layout = RunLayout(tmp_path)
    layout.samples.mkdir()
    layout.quarantine.mkdir()
    pq.write_table(pa.table({"sample_id": ["a", "b"], "n": [1, 2]}), layout.samples / "s-1.parquet")
    pq.write_table(pa.table({"sample_id": ["b", "c"]}), layout.quarantine / "q-1.parquet")
    assert read_finished_ids(layout) == {"a", "b", "c"}
    assert read_finished_ids(RunLayout(tmp_path / "none")) == set()
    for bad, content in (("x.parquet", None), ("y.parquet", b"not parquet")):
        path = layout.quarantine / bad
        if content is None:
            pq.write_table(pa.table({"other": [1]}), path)
        else:
            path.write_bytes(content)
        with pytest.raises(UnreadableFile) as old:
            read_rows(layout.quarantine, ["sample_id"])
        with pytest.raises(UnreadableFile) as new:
            read_finished_ids(layout)
        assert str(new.value) == str(old.value) and str(path) in str(new.value)
        path.unlink()


def _old_quarantine(datasets: list[DatasetConfig], done: set[str], worn: dict) -> list[dict]:
    """What read_prompts wrote before #26 (one shard), from load_dataset on the driver."""
    prompts, bad_rows = [], []
    for d in datasets:
        rows, bad = load_dataset(d)
        prompts += [r for r in rows if r["sample_id"] not in done]
        bad_rows += [b for b in bad if b["sample_id"] not in done]
    bad_rows += [dict(p, **worn[p["sample_id"]]) for p in prompts if p["sample_id"] in worn]
    return [quarantine_row({k: v for k, v in b.items() if k not in ("stage", "reason")}, b["stage"], b["reason"])
            for b in bad_rows]


def _by_id(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: r["sample_id"])


def test_index_dataset_writes_what_read_prompts_wrote(tmp_path):
    """The index task's body, in this process: the quarantine rows of the old driver, one dataset a shard."""
    datasets = _datasets(tmp_path)
    good = load_dataset(datasets[0])[0]
    bad_mal = load_dataset(datasets[3])[1]
    done = {good[0]["sample_id"], bad_mal[0]["sample_id"]}
    worn = {good[1]["sample_id"]: {"stage": "generate", "source": "api", "reason": "api: transient failures in 2 "
                                                                                   "runs (last: 503)"},
            good[0]["sample_id"]: {"stage": "generate", "source": "api", "reason": "finished first"}}
    out = RunLayout(tmp_path / "o").quarantine
    counts: Counter = Counter()
    for d in datasets:
        counts.update(index_dataset(d, RunLayout(tmp_path / "o"), done, worn, keep_index=False))
    written = [r for f in sorted(out.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert _by_id(written) == _by_id(_old_quarantine(datasets, done, worn))
    assert all(pq.read_schema(f) == QUARANTINE_SCHEMA for f in out.glob("*.parquet"))
    assert len(list(out.glob("*.parquet"))) == 4  # lines (a bad line and the worn prompt), list, pq, mal
    rows = {f"{d.name}.rows": sum(map(len, load_dataset(d))) for d in datasets}
    assert {k: v for k, v in counts.items() if k != TO_DO} == rows
    assert counts[TO_DO] == sum(len(load_dataset(d)[0]) for d in datasets) - 2  # one done, one worn out


def test_the_index_pass_writes_nothing_into_a_folder_whose_lock_is_not_the_runs(tmp_path):
    """A frozen driver's index task after another run took the folder over: its quarantine shards and id index
    are fenced by the lock (as the writer's shards are), so it raises LockLost and writes nothing."""
    from pipeline.base.run_lock import LockLost, RunLock

    d = _datasets(tmp_path)[3]  # the shipped malformed rows: the pass has quarantine rows to write
    layout = RunLayout(tmp_path / "o")
    with RunLock.for_folder(layout.root, settle_s=0) as lock:
        with pytest.raises(LockLost):
            index_dataset(d, layout, set(), {}, token="the-frozen-driver's")
        assert not list(layout.quarantine.glob("*.parquet")) and not layout.prompt_index(d.name).exists()
        counts = index_dataset(d, layout, set(), {}, token=lock.token)
    assert counts[f"{d.name}.rows"] > 0 and list(layout.quarantine.glob("*.parquet"))
    assert layout.prompt_index(d.name).exists()


def test_the_index_pass_quarantines_rows_with_a_lone_surrogate(tmp_path):
    """A JSON \\u escape can write a lone surrogate, which UTF-8 (so a Parquet shard) has no form for: the
    quarantine shard holds it escaped, readable back to the row, and the good row beside it is left to do."""
    lines = [json.dumps(_user("ok")), '{"messages": [{"role": "bogus", "content": "\\ud800"}]}',
             '{"messages": [{"role": "user", "content": "hi \\ud800"}]}']
    path = tmp_path / "s.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    layout = RunLayout(tmp_path / "o")
    counts = index_dataset(DatasetConfig(name="s", path=str(path)), layout, set(), {}, keep_index=False)
    assert counts == Counter({"s.rows": 3, TO_DO: 1})
    written = sorted((r for f in layout.quarantine.glob("*.parquet") for r in pq.read_table(f).to_pylist()),
                     key=lambda r: r["row_index"])
    assert [(r["row_index"], r["stage"]) for r in written] == [(1, "read"), (2, "read")]
    assert "unknown role 'bogus'" in written[0]["reason"] and "lone surrogate" in written[1]["reason"]
    for r, line in zip(written, lines[1:], strict=True):
        assert json.loads(json.loads(r["detail"])["raw"]) == json.loads(line)


def _index_all(datasets: list[DatasetConfig], tmp_path: Path, done: set[str], worn: dict) -> Counter:
    counts: Counter = Counter()
    layout = RunLayout(tmp_path / "out")
    for d in datasets:
        counts.update(index_dataset(d, layout, done, worn))
    return counts


def test_a_resume_counts_from_the_id_index_without_parsing_the_files(tmp_path, monkeypatch):
    """The first pass writes each file's ids; a second one with more rows done counts the same figures as a
    full pass would, from the index alone, and writes no quarantine row again."""
    import pipeline.prompts.read as read

    datasets = _datasets(tmp_path)
    first = _index_all(datasets, tmp_path, set(), {})
    layout = RunLayout(tmp_path / "out")
    assert all(layout.prompt_index(d.name).is_file() for d in datasets)
    index = pq.read_table(layout.prompt_index("lines"))
    assert index.column("sample_id").to_pylist() == [r["sample_id"] for _, r in iter_dataset(datasets[0])]
    assert index.column("ok").to_pylist() == [ok for ok, _ in iter_dataset(datasets[0])]
    quarantined = {r["sample_id"] for r in read_rows(layout.quarantine, ["sample_id"])}
    assert quarantined
    done = quarantined | {r["sample_id"] for d in datasets for r in load_dataset(d)[0][::3]}
    expected = Counter({k: v for k, v in first.items() if k != TO_DO})
    expected[TO_DO] = sum(len([r for r in load_dataset(d)[0] if r["sample_id"] not in done]) for d in datasets)
    shards = sorted(layout.quarantine.glob("*.parquet"))

    def no_parse(*a, **k):
        raise AssertionError("the file was parsed again")

    monkeypatch.setattr(read, "iter_dataset", no_parse)
    assert _index_all(datasets, tmp_path, done, {}) == expected
    assert sorted(layout.quarantine.glob("*.parquet")) == shards


def test_the_id_index_is_not_trusted_for_a_changed_file_or_settings(tmp_path, monkeypatch):
    import pipeline.prompts.read as read

    d = _datasets(tmp_path)[4]  # capped.jsonl: 20 rows, max_rows 7
    parses = []
    real = read.iter_dataset
    monkeypatch.setattr(read, "iter_dataset", lambda *a, **k: parses.append(1) or real(*a, **k))
    path = RunLayout(tmp_path / "out").prompt_index(d.name)

    def to_do(cfg: DatasetConfig) -> int:
        return _index_all([cfg], tmp_path, set(), {})[TO_DO]

    assert (to_do(d), to_do(d), len(parses)) == (7, 7, 1)  # written, then trusted
    wider = d.model_copy(update={"max_rows": 12})  # other settings: other ids; the index is written for them
    assert (to_do(wider), to_do(wider), len(parses)) == (12, 12, 2)
    with open(d.path, "a") as f:  # the file changes (its size and mtime)
        f.write(json.dumps(_user("new")) + "\n")
    assert (to_do(wider), to_do(wider), len(parses)) == (12, 12, 3)
    for junk in (b"", b"not parquet", None):  # a torn or foreign index file is no index
        if junk is None:
            pq.write_table(pa.table({"sample_id": ["x"]}), path)
        else:
            path.write_bytes(junk)
        assert to_do(d) == 7
    assert len(parses) == 6


def test_a_worn_or_malformed_row_left_to_do_is_read_from_the_file(tmp_path):
    """The index holds ids, not rows: a prompt worn out since the last pass (or a malformed row whose
    quarantine shard is gone) is quarantined from the file, as without an index."""
    datasets = _datasets(tmp_path)
    _index_all(datasets, tmp_path, set(), {})
    layout = RunLayout(tmp_path / "out")
    shutil.rmtree(layout.quarantine)
    good = load_dataset(datasets[0])[0]
    worn = {good[1]["sample_id"]: {"stage": "generate", "source": "api", "reason": "api: transient failures"}}
    counts = _index_all(datasets, tmp_path, set(), worn)
    written = {r["sample_id"]: r["stage"] for r in read_rows(layout.quarantine, ["sample_id", "stage"])}
    assert written == {q["sample_id"]: q["stage"] for q in _old_quarantine(datasets, set(), worn)}
    assert counts[TO_DO] == sum(len(load_dataset(d)[0]) for d in datasets) - 1


def test_a_resumed_read_parses_only_the_rows_the_id_index_says_are_left(tmp_path, monkeypatch):
    """Every format (JSONL with blank, broken and non-UTF-8 lines, .json, Parquet in row groups, max_rows): with
    the index, the read yields exactly what it yields without one, and parses only the rows left to do; a
    re-route pass's ``only`` stops at its last row; an index that no longer holds is not used."""
    import pipeline.prompts.datasets as datasets_mod

    datasets = _datasets(tmp_path)
    _index_all(datasets, tmp_path, set(), {})
    layout = RunLayout(tmp_path / "out")
    parsed = []
    real = datasets_mod.parse_row
    monkeypatch.setattr(datasets_mod, "parse_row", lambda raw, *a: parsed.append(1) or real(raw, *a))
    for d in datasets:
        good = load_dataset(d)[0]
        skip = {r["sample_id"] for r in good[::3]} | {r["sample_id"] for r in good[1::3]}  # two thirds done
        only = {r["sample_id"] for r in good[2:5]}
        parsed.clear()
        plain = list(todo_rows(d, skip))
        full = len(parsed)
        parsed.clear()
        assert list(todo_rows(d, skip, index=layout.prompt_index(d.name))) == plain
        assert len(parsed) == len(plain) and (not good or len(parsed) < full), d.name
        assert list(todo_rows(d, skip, only, layout.prompt_index(d.name))) == list(todo_rows(d, skip, only))
    d = datasets[0]
    with open(d.path, "ab") as f:  # the file changed: the index is not used, every row is parsed again
        f.write(json.dumps(_user("late")).encode() + b"\n")
    good = load_dataset(d)[0]
    parsed.clear()
    assert [r["sample_id"] for r in todo_rows(d, set(), index=layout.prompt_index(d.name))] == \
        [r["sample_id"] for r in good]
    assert len(parsed) == len(good)  # every row of the file (its two broken lines never reach parse_row)


# ------------------------------------------------------------------ in Ray (the session's cluster)


def _blocks(ds) -> list[pa.Table]:
    import ray

    return ray.get(ds.to_arrow_refs())


def test_prompt_dataset_reads_the_driver_rows_in_blocks(ray_session, run_cfg):
    ray = ray_session
    good = {d.name: load_dataset(d)[0] for d in run_cfg.datasets}
    skip = {good["lines"][4]["sample_id"], good["pq"][0]["sample_id"]}
    ds = prompt_dataset(run_cfg, ray.put(skip), None, 4).materialize()
    # one task per file, the repartition fused into it: a read that asks no CPU (prompt_dataset's docstring)
    assert "MapBatches(_read_blocks)->StreamingRepartition" in ds.stats()
    blocks = [b for b in _blocks(ds) if b.num_rows]
    assert all(b.schema == PROMPT_SCHEMA for b in blocks)
    expected = {name: [r for r in rows if r["sample_id"] not in skip] for name, rows in good.items()}
    got: dict[str, list[dict]] = {}
    for b in blocks:
        assert 0 < b.num_rows <= 4
        assert len(set(b.column("dataset").to_pylist())) == 1  # a block holds one file's rows
        got.setdefault(b.column("dataset")[0].as_py(), []).extend(b.to_pylist())
    assert got == {name: rows for name, rows in expected.items() if rows}  # same ids, same file order
    assert len(blocks) == sum(math.ceil(len(rows) / 4) for rows in expected.values())
    # from_items's schema for the same dicts: the stages see the columns and types they saw before
    assert pass_dataset(expected["lines"], 4).schema().base_schema == PROMPT_SCHEMA


def test_a_reroute_pass_reads_only_its_ids(ray_session, run_cfg):
    ray = ray_session
    good = {d.name: load_dataset(d)[0] for d in run_cfg.datasets}
    only = {good["lines"][7]["sample_id"], good["list"][2]["sample_id"], good["lines"][1]["sample_id"]}
    skip = ray.put({good["lines"][1]["sample_id"]})
    prompts = PromptSet(run_cfg, skip, 99).restrict(only)
    assert len(prompts) == 3
    rows = [r for b in _blocks(pass_dataset(prompts, 2)) for r in b.to_pylist()]
    assert sorted(r["sample_id"] for r in rows) == sorted(only - {good["lines"][1]["sample_id"]})
    assert reroute_prompts(good["lines"], only) == [good["lines"][1], good["lines"][7]]  # the list path


def test_index_prompts_counts_in_tasks_and_quarantines_as_before(ray_session, run_cfg):
    layout = RunLayout(run_cfg.output_dir)
    good = load_dataset(run_cfg.datasets[2])[0]
    worn = {good[3]["sample_id"]: {"stage": "generate", "source": "api", "reason": "api: worn"}}
    counts = index_prompts(run_cfg, layout, ray_session.put(set()), worn)
    written = [r for f in sorted(layout.quarantine.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert _by_id(written) == _by_id(_old_quarantine(run_cfg.datasets, set(), worn))
    assert [k for k in counts if k != TO_DO] == [f"{d.name}.rows" for d in run_cfg.datasets]
    assert counts["empty.rows"] == 0 and counts["capped.rows"] == 7
    assert counts[TO_DO] == sum(len(load_dataset(d)[0]) for d in run_cfg.datasets) - 1


@pytest.mark.parametrize("content", [b'[{"messages": ', b"not parquet at all", None])
def test_a_broken_file_fails_the_index_pass_with_its_own_error(ray_session, run_cfg, tmp_path, content, monkeypatch):
    """The CLI maps the class to exit 2 and prints the message: a RayTaskError would be neither. The other
    dataset's task is not cancelled: Ray 2.60 aborts the whole driver process when a cancel meets a task's reply
    on its way (it killed the test session this way, at random)."""
    import ray

    cancelled: list[object] = []
    monkeypatch.setattr(ray, "cancel", lambda ref, **kw: cancelled.append(ref))
    name = "broken.parquet" if content == b"not parquet at all" else "broken.json"
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    d = DatasetConfig(name="broken", path=str(path))
    run_cfg.datasets = [run_cfg.datasets[0], d]
    with pytest.raises(DatasetError) as driver:
        load_dataset(d)
    with pytest.raises(DatasetError) as tasks:
        index_prompts(run_cfg, RunLayout(run_cfg.output_dir), set(), {})
    assert type(tasks.value) is DatasetError and str(tasks.value) == str(driver.value)
    assert cancelled == []


def test_read_prompts_holds_counts_not_rows(ray_session, run_cfg, tmp_path):
    from pipeline.run.job import read_prompts

    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps(_user("x" * 200 + str(i))) + "\n" for i in range(3000)))
    run_cfg.datasets.append(DatasetConfig(name="big", path=str(big)))
    layout = RunLayout(run_cfg.output_dir)
    layout.samples.mkdir(parents=True)
    first = load_dataset(run_cfg.datasets[0])[0][:2]
    pq.write_table(pa.table({"sample_id": [r["sample_id"] for r in first]}), layout.samples / "s.parquet")
    prompts, index = read_prompts(run_cfg, layout)
    to_do = sum(len(load_dataset(d)[0]) for d in run_cfg.datasets) - 2
    # a resume: the index pass was waited for, the count is exact
    assert isinstance(prompts, PromptSet) and len(prompts) == to_do and not prompts.estimated
    assert index.ready() and index.counts()["big.rows"] == 3000 and index.counts()[TO_DO] == to_do
    assert len(pickle.dumps(prompts)) < 20_000  # the config and an object ref; the rows are ~700 kB
    assert len(_blocks(prompts.dataset(16))) >= math.ceil(to_do / 16)


def test_a_fresh_run_reads_while_the_index_pass_counts(ray_session, run_cfg):
    """Nothing finished: the run does not wait for the index pass. Its to-do count is the files' row count
    (malformed rows included: the upper bound), the read yields exactly the good rows, and the pass's own
    count and quarantine, when waited for, are those of a run that waited."""
    from pipeline.run.job import read_prompts

    layout = RunLayout(run_cfg.output_dir)
    good = {d.name: load_dataset(d)[0] for d in run_cfg.datasets}
    bad = sum(len(load_dataset(d)[1]) for d in run_cfg.datasets)
    prompts, index = read_prompts(run_cfg, layout)
    assert prompts.estimated and len(prompts) == sum(count_rows(d) for d in run_cfg.datasets)
    assert len(prompts) == sum(map(len, good.values())) + bad and bad > 0
    rows = [r for b in _blocks(prompts.dataset(8)) for r in b.to_pylist()]
    assert sorted(r["sample_id"] for r in rows) == sorted(r["sample_id"] for g in good.values() for r in g)
    counts = index.counts()
    assert counts[TO_DO] == sum(map(len, good.values())) and index.ready()
    written = [r for f in sorted(layout.quarantine.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert _by_id(written) == _by_id(_old_quarantine(run_cfg.datasets, set(), {}))
    # a re-route pass's set is exact (its ids are named)
    assert not prompts.restrict({rows[0]["sample_id"]}).estimated
