"""Held-out acceptance per dataset and source: one simulation split by group, its standard errors, and
where the report, report.html, status and the console show it."""

from __future__ import annotations

import json
import math
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.base.console import heldout_line
from pipeline.base.layout import RunLayout
from pipeline.report.html import render_report_html
from pipeline.report.summary import format_report, heldout_breakdown_lines
from pipeline.run.config import load_config
from pipeline.run.status import collect_status, format_status
from tests.unit.test_report_html import NS, SVG
from tests.unit.test_training import fake_rows, small_drafter
from training.heldout import FEW_DRAFTS, acceptance_se, group_acceptance, heldout_acceptance, sample_label
from training.simulate import RowCounts, propose_all, row_counts, simulate_acceptance, walk_acceptance

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3
SHOP = [0, 2, 4]  # rows whose target agrees with the drafter's first guess over their first half


def grouped_rows() -> tuple[torch.nn.Module, list[dict], list[str]]:
    """A tiny random drafter and rows of two datasets: `shop` (easy, see SHOP) and `reasoning` (random)."""
    drafter = small_drafter().eval()
    rows = fake_rows([14, 22, 10, 18, 26, 15, 9], seed=3)
    for i in SHOP:
        r = rows[i]
        first = propose_all(drafter, torch.from_numpy(r["input_ids"]), torch.from_numpy(r["aux_hidden"]), K)[0]
        agree = np.concatenate([r["target_ids"][:1], first.numpy()[:-1]])
        half = len(agree) // 2 + 2 * i // 4  # the first half or so agrees: drafts differ within the group
        r["target_ids"] = np.concatenate([agree[:half], r["target_ids"][half:]])
    rows[6]["loss_mask"][:] = 0  # a sample with nothing to draft still counts as a sample of its group
    keys = ["shop" if i in SHOP else "reasoning" for i in range(len(rows))]
    return drafter, rows, keys


def old_simulation(drafter, rows: list[dict]) -> tuple[int, list[int]]:
    """simulate_acceptance's loop as it was before it kept per-row counts."""
    drafts, accepted = 0, [0] * K
    for r in rows:
        mask = np.asarray(r["loss_mask"]).astype(bool)
        if not mask.any():
            continue
        prop = propose_all(drafter, torch.from_numpy(r["input_ids"]), torch.from_numpy(r["aux_hidden"]), K).numpy()
        d, acc = walk_acceptance(prop, np.asarray(r["target_ids"], np.int64), int(np.argmax(mask)) - 1)
        drafts += d
        accepted = [a + b for a, b in zip(accepted, acc, strict=True)]
    return drafts, accepted


LM_HEAD = torch.zeros(50, 32)  # unused: every fake row carries target_ids


def test_groups_split_one_simulation_and_add_up_to_the_whole():
    drafter, rows, keys = grouped_rows()
    counts = row_counts(drafter, rows, LM_HEAD, K)
    overall = simulate_acceptance(drafter, rows, LM_HEAD, K)
    drafts, accepted = old_simulation(drafter, rows)
    assert (overall.num_drafts, overall.num_accepted) == (drafts, sum(accepted))  # unchanged, exactly
    assert overall.acceptance_length == 1.0 + sum(accepted) / drafts
    assert overall.per_position == [a / drafts for a in accepted]

    groups = group_acceptance(rows, counts, keys, K)
    assert [g["name"] for g in groups] == ["reasoning", "shop"]
    assert [g["samples"] for g in groups] == [4, 3] and counts[6] == RowCounts(0, [0] * K)
    assert sum(g["drafts"] for g in groups) == overall.num_drafts
    alone = {}
    for g in groups:  # each group's figure is the simulation of that group alone
        members = [r for r, key in zip(rows, keys, strict=True) if key == g["name"]]
        alone[g["name"]] = sim = simulate_acceptance(drafter, members, LM_HEAD, K)
        assert g["drafts"] == sim.num_drafts
        assert g["acceptance_length"] == round(sim.acceptance_length, 4)
        assert g["per_position"] == [round(p, 4) for p in sim.per_position]
        assert g["tokens"] == sum(int(r["loss_mask"].sum()) for r in members)
        assert g["few"] is (sim.num_drafts < FEW_DRAFTS)
        assert g["se"] == round(acceptance_se([c for c, key in zip(counts, keys, strict=True) if key == g["name"]]), 4)
    assert sum(s.num_accepted for s in alone.values()) == overall.num_accepted
    shop, reasoning = groups[1], groups[0]
    assert shop["acceptance_length"] > reasoning["acceptance_length"] + 0.3 and shop["se"] > 0


def drafts_of(c: RowCounts) -> list[int]:
    """The accepted count of each draft of a row, rebuilt from its per-position counts (prefix acceptance)."""
    levels = [c.drafts, *c.accepted, 0]
    return [n for n in range(len(c.accepted) + 1) for _ in range(levels[n] - levels[n + 1])]


def test_the_standard_error_is_per_draft_or_by_sample_whichever_is_larger():
    alike = [RowCounts(4, [2, 1, 0]), RowCounts(4, [2, 1, 0])]  # same rate in both samples: per draft
    ns = drafts_of(alike[0]) + drafts_of(alike[1])
    assert ns == [0, 0, 1, 2] * 2
    assert acceptance_se(alike) == pytest.approx(statistics.stdev(ns) / math.sqrt(len(ns)), rel=1e-12)
    apart = [RowCounts(4, [4, 4, 4]), RowCounts(4, [0, 0, 0])]  # one sample accepts all, one nothing
    per_draft = statistics.stdev(drafts_of(apart[0]) + drafts_of(apart[1])) / math.sqrt(8)
    assert acceptance_se(apart) == pytest.approx(1.5) and per_draft < 0.6  # clustered: sqrt(2 * 72) / 8
    assert acceptance_se([RowCounts(1, [1, 0, 0])]) is None and acceptance_se([]) is None
    assert acceptance_se([RowCounts(3, [3, 3, 3])]) == 0.0  # one sample, every draft the same


def test_a_row_is_labelled_by_its_own_column_then_its_sample_then_unknown():
    labels = {"a": {"dataset": "shop", "source": "vllm"}, "b": {"dataset": None, "source": ""}}
    assert sample_label({"sample_id": "a"}, labels, "dataset") == "shop"
    assert sample_label({"sample_id": "a", "source": "api"}, labels, "source") == "api"
    assert sample_label({"sample_id": "b"}, labels, "dataset") == "unknown"
    assert sample_label({"sample_id": "b"}, labels, "source") == "unknown"
    assert sample_label({"sample_id": "zz"}, labels, "dataset") == "unknown"


def test_heldout_acceptance_of_an_export_keeps_its_keys_and_adds_the_breakdowns(tmp_path):
    from tests.helpers.training import TINY_TARGET, build_tiny_llama, small_cfg
    from training.export import export_draft, load_exported
    from training.target import load_target_parts, read_target_config
    from training.train import prepare_drafter
    from training.vocab import build_vocab_mapping

    target = build_tiny_llama(tmp_path / "target")
    parts = load_target_parts(target)
    rows = fake_rows([12, 16, 10, 14], vocab=TINY_TARGET["vocab_size"], hidden=TINY_TARGET["hidden_size"], seed=5)
    cfg = small_cfg(draft_vocab_size=64)
    drafter = prepare_drafter(cfg, parts, build_vocab_mapping(rows, parts.vocab_size, 64))
    export = export_draft(drafter, tmp_path / "export", target_config=read_target_config(target))
    labels = {"r0": {"dataset": "shop", "source": "api"}, "r1": {"dataset": "reasoning", "source": "api"},
              "r2": {"dataset": "shop", "source": "api"}}  # r3: not among the samples
    got = heldout_acceptance(export, target, rows, K, labels)
    sim = simulate_acceptance(load_exported(export, parts), rows, parts.lm_head, K)
    assert {k: got[k] for k in ("samples", "k", "acceptance_length", "per_position", "drafts", "tokens")} == {
        "samples": 4, "k": K, "acceptance_length": round(sim.acceptance_length, 4),
        "per_position": [round(p, 4) for p in sim.per_position], "drafts": sim.num_drafts,
        "tokens": sum(int(r["loss_mask"].sum()) for r in rows)}
    assert [(g["name"], g["samples"]) for g in got["by_dataset"]] == [("reasoning", 1), ("shop", 2), ("unknown", 1)]
    assert [(g["name"], g["samples"]) for g in got["by_source"]] == [("api", 3), ("unknown", 1)]
    assert sum(g["drafts"] for g in got["by_dataset"]) == sum(g["drafts"] for g in got["by_source"]) == sim.num_drafts
    assert set(got["by_dataset"][0]) >= {"name", "samples", "drafts", "acceptance_length", "se", "per_position"}
    # no answer token in any held-out row (each masked out): nothing measured, not an acceptance of 1.0
    masked = [dict(r, loss_mask=np.zeros_like(r["loss_mask"])) for r in rows]
    none = heldout_acceptance(export, target, masked, K, labels)
    assert none["drafts"] == 0 and none.get("acceptance_length") is None and "no answer tokens" in none["skipped"]


# ----------------------------------------------------------------------------- where it is shown


def group(name: str, al: float, se: float | None, drafts: int) -> dict:
    return {"name": name, "samples": drafts // 10, "drafts": drafts, "acceptance_length": al, "se": se,
            "per_position": [0.5, 0.3, 0.1], "tokens": 4 * drafts, "few": drafts < FEW_DRAFTS}


def heldout(datasets: list[dict], sources: list[dict]) -> dict:
    return {"samples": 42, "k": 3, "acceptance_length": 2.3, "per_position": [0.7, 0.4, 0.2], "drafts": 420,
            "tokens": 1600, "by_dataset": datasets, "by_source": sources}


TWO = heldout([group("reasoning", 2.1, 0.04, 300), group("shop", 2.81, 0.05, 120)], [group("vllm", 2.3, 0.03, 420)])
ONE = heldout([group("chat", 2.3, 0.03, 420)], [group("vllm", 2.3, 0.03, 420)])
BASE = {"rows_in": 10, "passed": 3, "quarantined": 0, "quarantine_by_stage": {}, "not_generated": 0, "flagged": {},
        "tokens_generated": 0, "this_attempt": {"cost_usd": 0.0}, "seconds": {}, "audit": {"samples": 0},
        "throughput": {"samples_per_s": 1.0, "tokens_per_s": 2.0}}


def report_lines(h: dict) -> list[str]:
    return format_report({**BASE, "training": {"heldout": h}}, Path("/out")).splitlines()


def test_the_report_lists_each_dataset_under_the_heldout_line_when_there_are_two():
    lines = report_lines(TWO)
    at = next(i for i, ln in enumerate(lines) if ln.startswith("  held-out     acceptance length 2.300"))
    assert lines[at + 1] == "  held-out by dataset: reasoning 2.10 ± 0.04 (300 drafts) · shop 2.81 ± 0.05 (120 drafts)"
    assert not any("held-out by source" in ln for ln in lines)  # one source: nothing to compare
    assert report_lines(ONE) == [ln for ln in lines if "held-out by" not in ln]  # one of each: nothing new
    few = heldout([group("a", 2.0, None, 1), group("b", 1.5, 0.2, 12)],
                  [group("api", 1.6, 0.1, 13), group("x", 2, 0, 0)])
    assert heldout_breakdown_lines(few) == [
        "  held-out by dataset: a 2.00 (1 draft, few) · b 1.50 ± 0.20 (12 drafts, few)",
        "  held-out by source: api 1.60 ± 0.10 (13 drafts, few) · x 2.00 ± 0.00 (0 drafts, few)"]
    # report.json from before the breakdown, or edited by hand: nothing shown, nothing raised
    assert heldout_breakdown_lines({"by_dataset": "shop"}) == heldout_breakdown_lines({"by_dataset": [1, {}]}) == []


def figure(h: dict | None, **training) -> ET.Element:
    page = render_report_html({"training": {"heldout": h, **training} if h is not None else training}, [])
    return next(el for el in (ET.fromstring(m.group(0)) for m in SVG.finditer(page))
                if el.get("id") == "fig-heldout-datasets")


def test_the_html_figure_draws_a_bar_and_a_whisker_per_dataset():
    fig = figure(TWO)
    assert fig.find(f"{NS}title").text.startswith("Held-out acceptance per dataset")
    assert [r.find(f"{NS}title").text for r in fig.findall(f"{NS}rect")] == ["reasoning: 2.10", "shop: 2.81"]
    assert len(fig.findall(f"{NS}path")) == 2  # ± one standard error on each
    few = figure(heldout([group("a", 2.0, 0.3, 10), group("b", 2.5, 0.1, 200)], []))
    assert [r.get("fill") for r in few.findall(f"{NS}rect")] == ["#bab0ac", "#59a14f"]
    assert "grey: few drafts" in few.find(f"{NS}title").text


@pytest.mark.parametrize(("h", "training", "why"), [
    (ONE, {}, "one dataset held out (chat)"),
    ({k: v for k, v in ONE.items() if k != "by_dataset"}, {}, "written before they were measured"),
    ({"samples": 0, "k": 3, "skipped": "no held-out samples"}, {}, "no held-out samples"),
    (None, {"skipped": "training is off"}, "training is off"),
])
def test_the_html_figure_says_why_it_has_nothing_to_compare(h, training, why):
    fig = figure(h, **training)
    assert why in "".join(fig.itertext()) and not fig.findall(f"{NS}path")


def test_the_console_line_stays_one_line_and_names_the_weakest_sure_dataset():
    line = heldout_line(TWO, 3.0)
    assert "\n" not in line and "(weakest dataset reasoning 2.10)" in line
    assert "weakest" not in heldout_line(ONE, 3.0)
    few = heldout([group("a", 1.2, 0.3, 10), group("b", 2.5, 0.1, 200), group("c", 2.4, 0.1, 200)], [])
    assert "(weakest dataset c 2.40)" in heldout_line(few, 3.0)  # `a` has too few drafts to call it weakest
    # one sure dataset beside a few-drafts one (the quick start: shop and a small shop_plain): nothing to rank
    lone = heldout([group("a", 1.2, 0.3, 10), group("b", 2.5, 0.1, 200)], [])
    assert "weakest" not in heldout_line(lone, 3.0)


@pytest.fixture
def cfg(repo_root: Path, tmp_path: Path):
    cfg = load_config(repo_root / "configs" / "tiny_formats.yaml", base_dir=repo_root, check_paths=False)
    cfg.output_dir = str(tmp_path / "out")
    (tmp_path / "model").mkdir()
    cfg.model.path = str(tmp_path / "model")
    return cfg


def test_status_shows_the_per_dataset_figures_of_the_last_report(cfg):
    layout = RunLayout(cfg.output_dir)
    layout.root.mkdir(parents=True)
    layout.report.write_text(json.dumps({"training": {"heldout": TWO}}))
    text = format_status(collect_status(cfg)).splitlines()
    at = next(i for i, ln in enumerate(text) if ln.startswith("  held-out acceptance length 2.300"))
    assert text[at + 1] == "  held-out by dataset: reasoning 2.10 ± 0.04 (300 drafts) · shop 2.81 ± 0.05 (120 drafts)"
    layout.report.write_text(json.dumps({"training": {"heldout": ONE}}))
    assert not any("held-out by" in ln for ln in format_status(collect_status(cfg)).splitlines())
