"""Offline hidden-state shards: exact round trip, atomic writes, resume, and the training loop reading them."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.base.config import UnreadableFile
from pipeline.hidden.extract import capture, load_target
from pipeline.hidden.shards import (
    INDEX,
    _load_shard_block,
    build_index,
    completed_sample_ids,
    from_bf16_bits,
    load_index,
    quarantined_ids,
    read_hidden_shards,
    remove_stale_temps,
    shard_files,
    shard_meta,
    to_bf16_bits,
    write_shard,
    write_shards,
)

AUX = [1, 2, 3]
H = 128


@pytest.fixture(scope="module")
def rows(tiny_target) -> list[dict]:
    """Real captured rows from the tiny target."""
    model = load_target(str(tiny_target))[0]
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 120_000, n).tolist() for n in (40, 9, 25, 3, 31, 17, 12)]
    out = []
    for j, (s, (aux, final)) in enumerate(zip(seqs, capture(model, seqs, AUX), strict=True)):
        mask = np.zeros(len(s), np.int8)
        mask[len(s) // 2:] = 1
        out.append({"sample_id": f"s{j}", "input_ids": np.asarray(s, np.int64), "loss_mask": mask,
                    "aux_hidden": aux, "final_hidden": final})
    return out


def _by_id(rows):
    return {r["sample_id"]: r for r in rows}


def test_fp32_round_trip_is_exact_and_carries_the_convention(rows, tmp_path):
    index = write_shards(rows, tmp_path, shard_meta(AUX, H), samples_per_shard=3)
    assert sorted(e["samples"] for e in index["shards"]) == [1, 3, 3]
    assert index["samples"] == 7 and index["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert index["meta"]["convention"] == "vllm:input_of_layer" and index["meta"]["aux_layer_ids"] == AUX
    assert 4 * H * 4 <= index["bytes_per_token"] < 4 * H * 4 * 1.2
    back = _by_id(read_hidden_shards(tmp_path))
    assert back.keys() == _by_id(rows).keys()
    for r in rows:
        b = back[r["sample_id"]]
        for k in ("input_ids", "loss_mask", "aux_hidden", "final_hidden"):
            np.testing.assert_array_equal(b[k], r[k])
        assert b["aux_hidden"].dtype == np.float32 and b["input_ids"].dtype == np.int64


def test_target_ids_travel_with_the_shard_when_the_extraction_computed_them(rows, tmp_path):
    """Extraction's full-vocab argmax column round-trips; shards written without it still read (training
    then computes it)."""
    rng = np.random.default_rng(1)
    with_ids = [{**r, "target_ids": rng.integers(0, 129_280, len(r["input_ids"])).astype(np.int32)} for r in rows]
    write_shards(with_ids, tmp_path / "with", shard_meta(AUX, H), samples_per_shard=4)
    back = _by_id(read_hidden_shards(tmp_path / "with"))
    for r in with_ids:
        np.testing.assert_array_equal(back[r["sample_id"]]["target_ids"], r["target_ids"])
    write_shards(rows, tmp_path / "without", shard_meta(AUX, H), samples_per_shard=4)
    assert all("target_ids" not in b for b in read_hidden_shards(tmp_path / "without"))
    # the index says which shards carry them; a block is read with the column only when all do (one schema)
    assert all(e["target_ids"] for e in load_index(tmp_path / "with")["shards"])
    assert not any(e["target_ids"] for e in load_index(tmp_path / "without")["shards"])
    shard = str(tmp_path / "with" / load_index(tmp_path / "with")["shards"][0]["file"])
    block = {"path": np.array([shard]), "skip": np.array(["[]"])}
    assert "target_ids" in _load_shard_block({**block, "target_ids": np.array([True])}).column_names
    assert "target_ids" not in _load_shard_block({**block, "target_ids": np.array([False])}).column_names
    bad = [{**with_ids[0], "target_ids": with_ids[0]["target_ids"][:-1]}]
    with pytest.raises(ValueError, match="target_ids and input_ids lengths differ"):
        write_shards(bad, tmp_path / "bad", shard_meta(AUX, H), samples_per_shard=4)


def test_bf16_shards_halve_the_bytes_and_round_to_nearest(rows, tmp_path):
    fp32 = write_shards(rows, tmp_path / "f", shard_meta(AUX, H, "float32"), 4)
    bf16 = write_shards(rows, tmp_path / "b", shard_meta(AUX, H, "bfloat16"), 4)
    assert bf16["bytes_per_token"] < 0.55 * fp32["bytes_per_token"]
    back = _by_id(read_hidden_shards(tmp_path / "b"))
    for r in rows:
        want = torch.from_numpy(r["aux_hidden"]).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(back[r["sample_id"]]["aux_hidden"], want)
    x = np.array([1.0, -2.5, 3.1415927, 1e-30, 65504.0, -1e30], np.float32)
    np.testing.assert_array_equal(from_bf16_bits(to_bf16_bits(x)), torch.from_numpy(x).bfloat16().float().numpy())


def test_a_half_written_shard_is_never_visible(rows, tmp_path):
    meta = shard_meta(AUX, H)
    entry = write_shard(rows[:3], tmp_path, meta)
    full = (tmp_path / entry["file"]).read_bytes()
    (tmp_path / f".shard-deadbeef.arrow.tmp{os.getpid()}").write_bytes(full[: len(full) // 2])
    assert [f.name for f in shard_files(tmp_path)] == [entry["file"]]
    assert completed_sample_ids(tmp_path) == {"s0", "s1", "s2"}
    assert len(list(read_hidden_shards(tmp_path))) == 3
    assert remove_stale_temps(tmp_path) == 1 and not list(tmp_path.glob(".*tmp*"))


def test_a_restart_skips_samples_in_complete_shards_and_repairs_the_index(rows, tmp_path):
    meta = shard_meta(AUX, H)
    write_shards(rows[:4], tmp_path, meta, samples_per_shard=2)
    before = {f.name: f.stat().st_mtime_ns for f in shard_files(tmp_path)}
    (tmp_path / INDEX).unlink()  # crashed between a shard's rename and the index update
    index = write_shards(rows, tmp_path, meta, samples_per_shard=2)
    after = {f.name: f.stat().st_mtime_ns for f in shard_files(tmp_path)}
    assert {k: after[k] for k in before} == before, "complete shards are not rewritten"
    assert len(after) == 4 and index["samples"] == 7
    assert json.loads((tmp_path / INDEX).read_text())["samples"] == 7
    write_shard(rows[5:7], tmp_path, meta)  # a shard the index does not list yet
    assert load_index(tmp_path)["shards"] == build_index(tmp_path)["shards"]


@pytest.mark.parametrize("content", ['{"format": "eagle3-hidden-shards/1", "shar', "[]", "\x00" * 64,
                                     '{"format": "eagle3-hidden-shards/1", "meta": {}, "shards": [{"file": 3}]}'])
def test_a_corrupt_or_foreign_index_is_rebuilt_from_the_shards(rows, tmp_path, content):
    """index.json is derived from the shards: one that does not read as an index is rebuilt, not reported."""
    index = write_shards(rows, tmp_path, shard_meta(AUX, H), samples_per_shard=3)
    (tmp_path / INDEX).write_text(content)
    assert load_index(tmp_path)["shards"] == index["shards"]
    assert json.loads((tmp_path / INDEX).read_text())["samples"] == 7
    assert sorted(r["sample_id"] for r in read_hidden_shards(tmp_path)) == [f"s{i}" for i in range(7)]


def _damaged_shard(folder, kind: str):
    if kind == "truncated":  # copied in part, or cut by a disk error
        f = shard_files(folder)[0]
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        return f
    f = folder / "shard-zzzz.arrow"  # another Arrow file under a shard's name
    table = pa.table({"x": [1, 2]})
    with pa.OSFile(str(f), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return f


@pytest.mark.parametrize("kind", ["truncated", "foreign"])
def test_a_damaged_shard_is_an_unreadable_file_naming_it(rows, tmp_path, kind):
    """Every reader of the folder stops with one line naming the file and what to do, not an Arrow traceback."""
    write_shards(rows, tmp_path, shard_meta(AUX, H), samples_per_shard=3)
    bad = _damaged_shard(tmp_path, kind)
    readers = {"completed_sample_ids": completed_sample_ids, "build_index": build_index, "load_index": load_index,
               "read_hidden_shards": lambda d: list(read_hidden_shards(d))}
    for name, read in readers.items():
        with pytest.raises(UnreadableFile) as e:
            read(tmp_path)
        msg = str(e.value)
        assert msg.startswith(f"{bad}: ") and "move it away or delete it" in msg and "\n" not in msg, name


def test_a_corrupt_quarantine_file_is_an_unreadable_file_naming_it(tmp_path):
    (tmp_path / "q-0.parquet").write_bytes(b"not parquet")
    with pytest.raises(UnreadableFile, match=str(tmp_path / "q-0.parquet")):
        quarantined_ids(tmp_path)


def test_a_sample_in_two_shards_is_read_once(rows, tmp_path):
    meta = shard_meta(AUX, H)
    write_shard(rows[:3], tmp_path, meta)
    write_shard(rows[2:5], tmp_path, meta)  # a retried batch grouped differently
    ids = [r["sample_id"] for r in read_hidden_shards(tmp_path)]
    assert sorted(ids) == ["s0", "s1", "s2", "s3", "s4"]
    assert build_index(tmp_path)["samples"] == 5


def test_shards_with_another_convention_or_width_are_refused(rows, tmp_path):
    write_shard(rows[:2], tmp_path, shard_meta(AUX, H))
    write_shard(rows[2:4], tmp_path, shard_meta([0, 1, 2], H))
    with pytest.raises(ValueError, match="does not match"):
        build_index(tmp_path)
    with pytest.raises(ValueError, match="shapes"):
        write_shard(rows[:1], tmp_path / "w", shard_meta(AUX, 64))


def test_the_training_loop_trains_from_shards(rows, tmp_path, tiny_target):
    from training.config import DraftTrainConfig
    from training.train import train_loop
    from training.vocab import build_vocab_mapping

    write_shards(rows, tmp_path / "shards", shard_meta(AUX, H), samples_per_shard=3)
    vocab = build_vocab_mapping(read_hidden_shards(tmp_path / "shards"), 129_280, 64)
    cfg = DraftTrainConfig(steps=2, batch_tokens=128, max_len=64, ttt_steps=2, draft_vocab_size=64,
                           warmup_steps=0, checkpoint_every=100, aux_layer_ids=AUX, shuffle_buffer=4)
    _, metrics = train_loop(cfg, tiny_target, tmp_path / "drafter",
                            lambda epoch: read_hidden_shards(tmp_path / "shards"), vocab)
    assert metrics["step"] == 2 and np.isfinite(metrics["loss"]) and metrics["tokens"] > 0
