"""Offline hidden-state shards under Ray: resumable extraction feeding Ray Train, and the shards-mode run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.base.layout import RunLayout
from pipeline.hidden.shards import (
    INDEX,
    completed_sample_ids,
    extract_to_shards,
    hidden_shards_dataset,
    read_hidden_shards,
    shard_files,
)

AUX = [1, 2, 3]
H = 128
REPO = Path(__file__).resolve().parents[2]


def _samples_parquet(path: Path, start: int, n: int, tiny_target: Path) -> None:
    from pipeline.base.records import SAMPLE_SCHEMA, empty_sample
    from pipeline.profiles import load_profile

    profile = load_profile("deepseek", str(tiny_target))
    convs = [json.loads(line) for line in (REPO / "data/prompts/chat.jsonl").open()]
    out = []
    for k in range(start, start + n):
        r = profile.render_prompt(convs[k]["messages"], None, True)
        s = empty_sample({"sample_id": f"chat:{k}", "dataset": "chat", "row_index": k, "messages": "[]",
                          "thinking": True, "prompt_ids": r.ids, "prompt_assistant_mask": r.assistant_mask})
        s["output_ids"] = profile.encode(f"Thinking {k}.</think>Answer {k}." + profile.eot_text)
        s["source"] = "test"
        out.append(s)
    pq.write_table(pa.Table.from_pylist(out, schema=SAMPLE_SCHEMA), path)


@pytest.mark.slow
def test_extract_to_shards_resumes_and_feeds_ray_train(tmp_path, tiny_target, ray_session):
    from training.data import to_sample
    from training.train import as_dataset, vocab_from_dataset

    samples, shards, quarantine = tmp_path / "samples", tmp_path / "hidden", tmp_path / "quarantine"
    samples.mkdir()
    _samples_parquet(samples / "a.parquet", 0, 6, tiny_target)
    kw = dict(model_dir=str(tiny_target), aux_layer_ids=AUX, max_len=38, too_long="quarantine", batch_tokens=512,
              layout=RunLayout(tmp_path), samples_per_shard=2, num_cpus=0.5,
              extractor_kwargs={"stats_dir": str(tmp_path / "stats")})
    first = extract_to_shards(samples, shards, **kw)
    too_long = {r["sample_id"] for r in pq.read_table(quarantine).to_pylist()}
    assert too_long and first["samples"] + len(too_long) == 6 and first["written_now"] == first["samples"]
    kept = {f.name: f.stat().st_mtime_ns for f in shard_files(shards)}

    _samples_parquet(samples / "b.parquet", 6, 4, tiny_target)
    (shards / ".shard-cut.arrow.tmp1").write_bytes(b"ARROW1 half a shard")
    (shards / INDEX).unlink()
    second = extract_to_shards(samples, shards, **kw)
    assert second["resumed_done"] == first["samples"] and second["resumed_quarantined"] == len(too_long)
    assert second["written_now"] + first["samples"] == second["samples"]
    assert kept == {f.name: f.stat().st_mtime_ns for f in shard_files(shards) if f.name in kept}
    assert not list(shards.glob(".*tmp*"))
    all_q = pq.read_table(quarantine).column("sample_id").to_pylist()
    assert len(all_q) == len(set(all_q)), "a resumed run does not re-quarantine"
    assert second["samples"] + len(set(all_q)) == 10

    ds = as_dataset(hidden_shards_dataset(shards))
    stored = sorted(r["sample_id"] for r in ds.iter_rows())
    assert stored == sorted(completed_sample_ids(shards)) and len(stored) == second["samples"]
    vocab = vocab_from_dataset(ds, 129_280, 32)
    assert int(vocab.t2d.sum()) == 32
    sample = to_sample(next(iter(ds.iter_rows())), 512, lambda f: np.zeros(len(f), np.int64))
    assert sample.aux_hidden.shape[1] == 3 * H and sample.loss_mask.any()
    # stream mode counts the draft vocab from the samples (the stream is not read for it): same tokens, same
    # masks, same truncation and quarantine as the extraction stage
    from pipeline.hidden.handoff import draft_vocab_from_samples
    from training.vocab import count_loss_masked_tokens

    wide = vocab_from_dataset(ds, 129_280, 256)
    from_samples = draft_vocab_from_samples(RunLayout(tmp_path), 129_280, 256, 38, "quarantine")
    assert torch.equal(from_samples.d2t, wide.d2t) and torch.equal(from_samples.t2d, wide.t2d)
    assert count_loss_masked_tokens(ds.iter_rows(), 129_280).sum() > 0

    # Ray Train over the shards without materializing: every epoch re-reads them
    from training.config import DraftTrainConfig
    from training.train import train_drafter

    cfg = DraftTrainConfig(steps=6, batch_tokens=128, max_len=64, draft_vocab_size=32, aux_layer_ids=AUX,
                           ttt_steps=2, warmup_steps=1, checkpoint_every=3, materialize=False)
    result = train_drafter(hidden_shards_dataset(shards), cfg, tiny_target, tmp_path / "train")
    log = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 7)) and result.metrics["step"] == 6
    assert log[-1]["epoch"] >= 1, "6 steps of 128 tokens cycle the shards more than once"
    assert (result.export_dir / "model.safetensors").exists()


@pytest.mark.slow
def test_shards_mode_run_trains_on_all_but_the_held_out_samples(tmp_path, repo_root, clean_target, ray_session):
    """The main job with ``extraction.mode: shards``: every passed sample is extracted to shards, the held-out
    ones are left out of training (the saved draft vocabulary is the one of the other rows) and measured after."""
    from pipeline.base.config import ChecksConfig, DatasetConfig
    from pipeline.generate.sources.engines.config import TransformersSourceConfig
    from pipeline.run.config import RunConfig
    from pipeline.run.job import run
    from training.heldout import is_held_out
    from training.train import VOCAB_FILE, load_vocab
    from training.vocab import build_vocab_mapping

    fraction = 0.3
    lenient = ChecksConfig(**dict.fromkeys(("structure", "roundtrip_rebuilt", "tool_semantics", "repetition",
                                            "max_length"), "flag"))
    cfg = RunConfig(
        output_dir=str(tmp_path / "run"), model={"profile": "deepseek", "path": str(clean_target)},
        sampling={"temperature": 0.0, "max_tokens": 12},
        datasets=[DatasetConfig(name="chat", path=str(repo_root / "data/prompts/chat.jsonl"), max_rows=12,
                                checks=lenient)],
        sources=[TransformersSourceConfig(name="hf", dtype="float32", num_cpus=0.5, batch_size=4)],
        extraction={"mode": "shards", "samples_per_shard": 4, "num_cpus": 0.5, "max_len": 512},
        training={"steps": 4, "batch_tokens": 512, "max_len": 256, "ttt_steps": 2, "draft_vocab_size": 48,
                  "checkpoint_every": 2, "warmup_steps": 1, "heldout_fraction": fraction},
    )
    report = run(cfg)
    passed = {r["sample_id"] for r in pq.read_table(tmp_path / "run" / "samples").to_pylist()}
    assert report["passed"] == len(passed) == 12
    held = {s for s in passed if is_held_out(s, fraction)}
    assert 0 < len(held) < len(passed)
    assert completed_sample_ids(tmp_path / "run" / "hidden") == passed  # held-out samples are extracted too
    h = report["training"]["heldout"]
    assert h["samples"] == len(held) and h["k"] == 3 and h["acceptance_length"] >= 1.0
    rows = list(read_hidden_shards(tmp_path / "run" / "hidden"))
    trained = build_vocab_mapping([r for r in rows if r["sample_id"] not in held], 129_280, 48)
    saved = load_vocab(tmp_path / "run" / "drafter" / VOCAB_FILE)
    assert torch.equal(saved.d2t, trained.d2t) and torch.equal(saved.t2d, trained.t2d)
    everything = build_vocab_mapping(rows, 129_280, 48)
    assert not torch.equal(everything.d2t, trained.d2t), "the held-out rows would have changed the vocabulary"
