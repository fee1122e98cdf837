"""`pipeline status` on a folder written by hand: damaged files are reported, never raised."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.base.layout import RunLayout
from pipeline.run.status import collect_status, format_status
from tests.helpers.configs import formats_config


@pytest.fixture
def cfg(repo_root: Path, tmp_path: Path):
    return formats_config(repo_root, tmp_path)


def _metrics(layout: RunLayout, torn: bool) -> None:
    layout.drafter.mkdir(parents=True)
    lines = [json.dumps({"step": s, "epoch": 0, "loss": 2.0 / s, "acc_0": 0.1 * s, "tokens_per_s": 100.0})
             for s in (1, 2)]
    layout.metrics.write_text("\n".join(lines) + "\n" + ('{"step": 3, "lo' if torn else ""))


def test_a_truncated_report_is_shown_as_unreadable(cfg):
    layout = RunLayout(cfg.output_dir)
    _metrics(layout, torn=True)  # the job died mid-line: the last whole line counts
    layout.report.write_text('{"training": {"heldout": {"acceptance_length": 1.')  # cut short
    s = collect_status(cfg)
    tr = s["training"]
    assert tr["step"] == 2 and tr["last"]["loss"] == pytest.approx(1.0)
    assert tr["heldout"] is None and "report.json is unreadable" in tr["report_error"]
    text = format_status(s)
    assert "step 2 of 40" in text and "last report: report.json is unreadable" in text
    assert text.endswith("not finished: re-run the same config to continue")


@pytest.mark.parametrize("content", ["[1, 2, 3]", "\x00\xff garbage", ""])
def test_a_report_that_is_not_an_object_is_unreadable_too(cfg, content):
    layout = RunLayout(cfg.output_dir)
    layout.root.mkdir(parents=True)
    layout.report.write_bytes(content.encode("latin-1"))
    s = collect_status(cfg)
    assert "report.json is unreadable" in s["training"]["report_error"]
    assert "last report: report.json is unreadable" in format_status(s)


def test_a_missing_report_is_no_error(cfg):
    layout = RunLayout(cfg.output_dir)
    _metrics(layout, torn=False)
    s = collect_status(cfg)
    assert "report_error" not in s["training"] and s["training"]["heldout"] is None
    assert s["training"]["step"] == 2 and "unreadable" not in format_status(s)


def test_a_whole_report_gives_the_heldout_acceptance(cfg):
    layout = RunLayout(cfg.output_dir)
    _metrics(layout, torn=False)
    held = {"samples": 6, "k": 3, "acceptance_length": 1.75}
    layout.report.write_text(json.dumps({"training": {"heldout": held}}))
    s = collect_status(cfg)
    assert s["training"]["heldout"] == held and "report_error" not in s["training"]
    assert "held-out acceptance length 1.750 at k=3 on 6 samples" in format_status(s)


def test_a_damaged_manifest_and_shard_index_are_reported(cfg):
    layout = RunLayout(cfg.output_dir)
    layout.hidden.mkdir(parents=True)
    layout.hidden_index.write_text('{"shards": [{"file": "shard-a.arrow", "sam')
    layout.manifest.write_text('{"profile": "deeps')
    s = collect_status(cfg)
    assert "manifest.json is unreadable" in s["manifest"]["skipped"] and not s["manifest"]["differences"]
    assert "index.json is unreadable" in s["training"]["hidden_shards"]["error"]
    text = format_status(s)
    assert "manifest not checked: manifest.json is unreadable" in text
    assert "hidden shards: index.json is unreadable" in text


@pytest.mark.parametrize("index", [{"shards": [{"file": "a.arrow", "samples": None}]},
                                   {"shards": [{"file": "a.arrow", "samples": "x"}]},
                                   {"shards": [{"file": "a.arrow", "samples": 3}, "a.arrow"]},
                                   {"shards": {"file": "a.arrow"}}])
def test_a_shard_index_of_the_wrong_shape_is_reported(cfg, index):
    layout = RunLayout(cfg.output_dir)
    layout.hidden.mkdir(parents=True)
    layout.hidden_index.write_text(json.dumps(index))
    s = collect_status(cfg)
    assert "index.json is unreadable" in s["training"]["hidden_shards"]["error"]
    assert "hidden shards: index.json is unreadable" in format_status(s)


def test_dollar_caps_and_the_dollars_committed_are_shown(cfg):
    """A dataset capped only in dollars is capped: status names the cap and what the ledger committed against it
    (it said "no cap" before)."""
    from pipeline.generate.sources.http.config import OpenRouterSourceConfig

    cfg.sources.append(OpenRouterSourceConfig.model_validate(
        {"kind": "openrouter", "name": "api", "model": "moonshotai/kimi-k2.5",
         "budgets": {"code": 900}, "budgets_usd": {"chat": 40.0}, "default_budget": "unlimited"}))
    layout = RunLayout(cfg.output_dir)
    layout.root.mkdir(parents=True)
    layout.ledger("api").write_text(json.dumps({"#format": 2, "tokens": {"chat": 500, "code": 70, "math": 5},
                                                "usd": {"chat": 12.5, "math": 0.25}}))
    s = collect_status(cfg)
    per = s["spend"]["api"]["datasets"]
    assert (per["chat"]["budget"], per["chat"]["budget_usd"]) == (None, 40.0)
    assert (per["chat"]["committed"], per["chat"]["committed_usd"]) == (500, 12.5)
    assert (per["code"]["budget"], per["code"]["budget_usd"]) == (900, None)
    text = format_status(s)
    assert "500 tokens committed" in text and "$12.5000 committed of a $40.0000 cap" in text
    assert "cap 900 tokens" in text and "$0.2500 committed, " not in text
    math_line = next(line for line in text.splitlines() if line.split()[:3] == ["math", "5", "tokens"])
    assert math_line.endswith("$0.2500 committed")  # unlimited: what was committed, and no cap


def _api_source_journal(cfg) -> tuple[RunLayout, dict]:
    """An API source "api" on ``cfg``, its (empty) response journal folder, and one well-formed response record."""
    from pipeline.generate.sources.http.config import OpenRouterSourceConfig

    cfg.sources.append(OpenRouterSourceConfig.model_validate(
        {"kind": "openrouter", "name": "api", "model": "moonshotai/kimi-k2.5", "default_budget": "unlimited"}))
    layout = RunLayout(cfg.output_dir)
    layout.responses.mkdir(parents=True)
    return layout, {"sample_id": "chat:1", "dataset": "chat", "source": "api", "model": "m", "sampling": "{}",
                    "request_digest": "d", "kind": "response", "billed_completion_tokens": 5, "generation_id": "g1"}


def test_journal_lines_that_name_no_prompt_are_counted_and_said(cfg):
    """A response journal line in which nothing reads (torn mid-file, overwritten) holds no prompt: if it was a
    paid response, a re-run asks for its prompt again. It was said only in the logs; status counts it. A line that
    does not read but names its prompt is held (class journal), so it is not in that count."""
    layout, good = _api_source_journal(cfg)
    named = dict(good, sample_id="chat:2", generation_id="g2", cost="0.5")  # a counted field of the wrong type
    layout.response_journal("api", "a1").write_text("\n".join([
        json.dumps(good), '{"sample_id": "chat:3", "datas', "\x00\x01 not json", json.dumps(named)]) + "\n")
    s = collect_status(cfg)
    assert s["spend"]["api"]["journal_lines_naming_no_prompt"] == 2
    assert "WARNING: 2 lines of its response journal do not read and name no prompt" in format_status(s)
    layout.response_journal("api", "a1").write_text(json.dumps(good) + "\n" + json.dumps(named) + "\n")
    s = collect_status(cfg)
    assert s["spend"]["api"]["journal_lines_naming_no_prompt"] == 0 and "name no prompt" not in format_status(s)


def test_the_run_report_warns_of_journal_lines_naming_no_prompt(cfg, ray_session):
    """The run counts them too (it said so only in the logs; `status` alone counted them): the journal pass at the
    end of generation returns the count per source, and the report's attention lines say what to do."""
    from pipeline.report.summary import attention_lines
    from pipeline.run.job import project_journals

    layout, good = _api_source_journal(cfg)
    layout.response_journal("api", "a1").write_text("\n".join([json.dumps(good), "\x00 torn", '{"sample_i']) + "\n")
    nameless = project_journals(cfg, layout)
    assert nameless == {"api": 2}
    lines = attention_lines({"spend": {"api": {"journal_lines_naming_no_prompt": nameless["api"]}}})
    assert len(lines) == 1 and "source api: 2 lines of its response journal do not read and name no prompt" in lines[0]
    assert attention_lines({"spend": {"api": {"journal_lines_naming_no_prompt": 0}}}) == []
    assert attention_lines({"spend": {"api": None}}) == []  # an old or hand-edited report.json (report.html reads it)


def _shard_rows(*ids: int) -> list[dict]:
    import numpy as np

    return [{"sample_id": f"chat:{i}", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1],
             "aux_hidden": np.zeros((3, 4), np.float32), "final_hidden": np.zeros((3, 4), np.float32)} for i in ids]


def test_a_sample_in_two_shards_is_counted_once(cfg):
    """A killed extraction's retried batch can put a sample in two shards; the index lists it under the later one's
    ``skip`` and every reader yields it once. Status summed the entries' counts (4 samples, not 3)."""
    from pipeline.hidden.shards import build_index, shard_meta, write_shard

    layout = RunLayout(cfg.output_dir)
    write_shard(_shard_rows(0, 1), layout.hidden, shard_meta([0], 4))
    write_shard(_shard_rows(1, 2), layout.hidden, shard_meta([0], 4))
    assert build_index(layout.hidden)["samples"] == 3
    assert collect_status(cfg)["training"]["hidden_shards"] == {"files": 2, "samples": 3}
    assert "hidden shards: 2 files, 3 samples" in format_status(collect_status(cfg))


def test_shards_the_index_does_not_list_yet_are_counted(cfg):
    """The index is rebuilt when an extraction ends: while one runs, or after a kill, it is stale or absent. Status
    read it as it was (the old figures, or no shards at all); it counts the shards on disk then, never writing."""
    from pipeline.hidden.shards import build_index, shard_meta, write_shard

    layout = RunLayout(cfg.output_dir)
    write_shard(_shard_rows(0, 1), layout.hidden, shard_meta([0], 4))
    assert collect_status(cfg)["training"]["hidden_shards"] == {"files": 1, "samples": 2}  # no index yet
    assert not layout.hidden_index.exists()
    build_index(layout.hidden)
    write_shard(_shard_rows(1, 2, 3), layout.hidden, shard_meta([0], 4))  # a shard written after the index
    before = layout.hidden_index.read_bytes()
    assert collect_status(cfg)["training"]["hidden_shards"] == {"files": 2, "samples": 4}
    assert layout.hidden_index.read_bytes() == before


def test_a_damaged_shard_the_index_does_not_list_is_reported(cfg):
    layout = RunLayout(cfg.output_dir)
    layout.hidden.mkdir(parents=True)
    (layout.hidden / "shard-0123.arrow").write_bytes(b"ARROW1\x00\x00 cut short")
    s = collect_status(cfg)
    assert "shard-0123.arrow: not a readable Arrow shard" in s["training"]["hidden_shards"]["error"]
    assert "hidden shards: " in format_status(s)


def test_a_damaged_ledger_is_reported_with_the_rest_of_the_status(cfg):
    """A ledger cut short stopped `status` whole ("status: ... this budget journal is not valid JSON"): the rest
    of the folder's state was lost with it. Now it is that source's warning, its commitments shown as unknown."""
    from pipeline.generate.sources.http.config import OpenRouterSourceConfig

    cfg.sources.append(OpenRouterSourceConfig.model_validate(
        {"kind": "openrouter", "name": "api", "model": "moonshotai/kimi-k2.5", "budgets": {"chat": 900},
         "budgets_usd": {"code": 5.0}, "default_budget": "unlimited"}))
    layout = RunLayout(cfg.output_dir)
    layout.root.mkdir(parents=True)
    layout.ledger("api").write_text('{"#format": 2, "tokens": {"chat": 5')
    s = collect_status(cfg)
    sp = s["spend"]["api"]
    assert "this budget journal is not valid JSON" in sp["ledger_error"]
    assert sp["datasets"]["chat"]["committed"] is None and sp["datasets"]["code"]["committed_usd"] is None
    assert sp["datasets"]["chat"]["held_by_killed_requests"] is None  # unknown too: it is committed less billed
    text = format_status(s)
    assert "WARNING: " in text and "is not valid JSON" in text and "a run refuses to start" in text
    assert "chat             ? tokens committed" in text and "$? committed of a $5.0000 cap" in text
    assert s["totals"]["to_do"] > 0  # the rest of the status is there
