"""The walking skeleton end to end: one config, local Ray, vLLM CPU actor, validation, extraction, training.

The run uses the quick start's well-formed tiny target plus a dataset of malformed input rows: every
generated sample must pass every quarantining check (a clean model gives clean data), and every
malformed row must end in quarantine with its reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.base.config import DatasetConfig
from pipeline.base.records import QUARANTINE_SCHEMA, SAMPLE_SCHEMA
from pipeline.profiles import load_profile
from pipeline.run.config import load_config

pytestmark = pytest.mark.slow


ROWS_IN = 68 + 9  # data/prompts/*.jsonl + tests/data/malformed_messages.jsonl
MALFORMED = 7  # rows of the malformed file that cannot be read (tests/test_datasets.py names each reason)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, repo_root: Path, clean_target: Path, ray_session):
    from pipeline.run.job import run

    out = tmp_path_factory.mktemp("run")
    cfg = load_config(repo_root / "configs" / "tiny_formats.yaml", base_dir=repo_root)
    cfg.output_dir = str(out)
    cfg.model.path = str(clean_target)
    cfg.datasets.append(DatasetConfig(name="malformed", path=str(repo_root / "tests/data/malformed_messages.jsonl")))
    cfg.sampling.max_tokens = 64
    cfg.training.steps = 12
    cfg.training.checkpoint_every = 6
    cfg.training.served_eval = False  # one vLLM engine less: the quick start and console tests serve the drafter
    report = run(cfg)
    return cfg, out, report


def _read(folder: Path):
    return [r for f in sorted(folder.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def test_every_row_ends_passed_or_quarantined(tiny_run):
    cfg, out, report = tiny_run
    samples, quarantine = _read(out / "samples"), _read(out / "quarantine")
    assert report["rows_in"] == ROWS_IN
    assert len(samples) + len(quarantine) == ROWS_IN
    ids = [r["sample_id"] for r in samples] + [r["sample_id"] for r in quarantine]
    assert len(set(ids)) == ROWS_IN
    assert report["passed"] == len(samples) and report["quarantined"] == len(quarantine)
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["passed"] == report["passed"]


def test_clean_target_passes_every_check_and_only_malformed_rows_are_quarantined(tiny_run):
    _, out, report = tiny_run
    assert report["passed"] == ROWS_IN - MALFORMED
    assert report["quarantine_by_stage"] == {"read": MALFORMED}
    assert {q["dataset"] for q in _read(out / "quarantine")} == {"malformed"}
    audit = report["audit"]
    assert audit["samples"] == ROWS_IN - MALFORMED and audit["quarantined"] == 0
    for name, figures in audit["checks"].items():
        assert figures["failed"] == 0, (name, figures)
    assert audit["checks"]["structure"]["checked"] == audit["checks"]["repetition"]["checked"] == audit["samples"]
    # thinking on: one </think> in every finished response; thinking off: none
    profile = load_profile("deepseek")
    samples = _read(out / "samples")
    for s in samples:
        if not s["truncated"]:
            assert s["output_ids"].count(profile.think_end_id) == int(s["thinking"]), s["sample_id"]
    assert sum(s["thinking"] for s in samples) > 10
    assert sum(not s["thinking"] for s in samples) >= 5  # prompts that end with a tool result


def test_audit_of_the_clean_run_passes_its_gate(tiny_run, tmp_path):
    from pipeline.checks.audit import main as audit_main

    _, out, report = tiny_run
    assert audit_main([str(out / "samples"), "--json", str(tmp_path / "audit.json")]) == 0
    again = json.loads((tmp_path / "audit.json").read_text())
    assert again["samples"] == report["passed"]
    assert {k: v["failed"] for k, v in again["checks"].items()} == {k: 0 for k in again["checks"]}


def test_shards_have_the_documented_schema(tiny_run):
    _, out, _ = tiny_run
    for f in (out / "samples").glob("*.parquet"):
        assert pq.read_schema(f).names == SAMPLE_SCHEMA.names
    for f in (out / "quarantine").glob("*.parquet"):
        assert pq.read_schema(f).names == QUARANTINE_SCHEMA.names


def test_samples_hold_exact_engine_ids_and_checks(tiny_run, clean_target):
    cfg, out, _ = tiny_run
    profile = load_profile("deepseek", str(clean_target))
    for s in _read(out / "samples"):
        messages = json.loads(s["messages"])
        tools = json.loads(s["tools"]) if s["tools"] else None
        assert s["prompt_ids"] == profile.render_prompt(messages, tools, s["thinking"]).ids
        assert s["source"] == "vllm-cpu" and s["ids_from"] == "engine"
        ids = s["output_ids"]
        assert 0 < len(ids) <= 64
        assert s["truncated"] == (s["finish_reason"] == "length")
        if not s["truncated"]:
            assert ids[-1] == profile.eot_id
        assert s["checks_failed"] == []
        assert s["t_generate_s"] > 0


def test_quarantine_rows_carry_reasons(tiny_run):
    _, out, _ = tiny_run
    quarantine = _read(out / "quarantine")
    assert len(quarantine) == MALFORMED
    for q in quarantine:
        assert q["stage"] == "read" and q["reason"].startswith("malformed row: ")
        assert json.loads(q["detail"])["raw"], q  # the offending line is kept for the data team


def test_drafter_is_trained_and_exported(tiny_run):
    _, out, report = tiny_run
    export = Path(report["training"]["export_dir"])
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (export / "model.safetensors").stat().st_size > 0
    assert report["training"]["metrics"]["step"] == 12
    held = report["training"]["heldout"]  # samples the drafter never saw, measured after training
    assert held["samples"] >= 3 and held["k"] == 3 and len(held["per_position"]) == 3
    assert held["acceptance_length"] == pytest.approx(1 + sum(held["per_position"]), abs=1e-3)
    assert held["drafts"] > 0 and held["tokens"] > 0


def test_status_of_the_finished_run_matches_its_report(tiny_run):
    from pipeline.run.status import collect_status, format_status, is_finished

    cfg, _, report = tiny_run
    s = collect_status(cfg)
    assert s["totals"] == {"rows": report["rows_in"], "passed": report["passed"],
                           "quarantined": report["quarantined"], "to_do": 0}
    assert s["datasets"]["malformed"]["quarantined_by_stage"] == {"read": MALFORMED}
    assert s["samples_by_source"] == {"vllm-cpu": report["passed"]}
    assert s["manifest"] == {"present": True, "differences": []}
    assert (s["training"]["step"], s["training"]["steps"], s["training"]["exported"]) == (12, 12, True)
    assert s["training"]["heldout"] == report["training"]["heldout"]
    assert is_finished(s) and format_status(s).endswith("finished")
    cfg2 = cfg.model_copy(deep=True)
    cfg2.sampling.temperature = 0.5
    assert collect_status(cfg2)["manifest"]["differences"] == ["sampling.temperature: 1.0 -> 0.5"]


def test_rerun_resumes_without_regenerating(tiny_run):
    from pipeline.base.layout import RunLayout
    from pipeline.run.job import finished_ids, read_prompts

    cfg, out, report = tiny_run
    prompts, index = read_prompts(cfg, RunLayout(out))
    assert len(prompts) == 0 and not prompts.estimated  # a PromptSet: the count left to do, never the rows
    assert index.counts()["to_do"] == 0 and len(finished_ids(RunLayout(out))) == ROWS_IN


def test_rerun_with_other_sampling_or_target_is_refused(tiny_run, tmp_path):
    """The run's manifest pins what its samples were made with: a resume that would mix two
    distributions stops before any work, naming each difference, and writes nothing."""
    from pipeline.run.job import run
    from pipeline.run.manifest import MANIFEST_FILE, ManifestMismatch

    cfg, out, _ = tiny_run
    before = sorted(p.name for p in (out / "samples").iterdir())
    hotter = cfg.model_copy(deep=True)
    hotter.sampling.temperature = 0.7
    with pytest.raises(ManifestMismatch, match=r"sampling.temperature: 1.0 -> 0.7"):
        run(hotter)
    wild = cfg.model_copy(deep=True)
    wild.model.path = str(tmp_path / "wild")
    wild.model.tiny_variant = "wild"
    with pytest.raises(ManifestMismatch, match=r"model.config"):
        run(wild)
    assert sorted(p.name for p in (out / "samples").iterdir()) == before
    assert json.loads((out / MANIFEST_FILE).read_text())["sampling"]["temperature"] == 1.0


def test_the_run_publishes_report_html_and_tensorboard_events(tiny_run):
    """report.html beside report.json with every figure; the drafter's TensorBoard events hold each training
    step and, at the last step, the report's data-side figures."""
    from pipeline.report.html import FIGURE_IDS
    from tests.unit.test_trackers import read_scalars

    _, out, report = tiny_run
    page = (out / "report.html").read_text()
    assert all(f'<svg id="{fig}"' in page for fig in FIGURE_IDS)
    assert report["throughput"]["series"][-1]["done"] == report["this_attempt"]["samples"]
    got = read_scalars(out / "drafter" / "tensorboard")
    assert [step for step, _ in got["loss/total"]] == list(range(1, 13))
    assert got["data/samples_per_source/vllm-cpu"] == [(12, float(report["sources"]["vllm-cpu"]["served"]))]


def test_value_curves_and_a_plan_from_the_finished_run(tiny_run, tmp_path, capsys):
    """`value` on the finished folder: the full drafter and chat cut to 0 and 50%, trained and
    measured for real (its streamed states extracted once into value/hidden/), resumed without training again;
    then `plan` from the CLI: a budget below one sample's price is refused with one line, and a real one writes
    whole samples' dollars and a config fragment within the prompts left."""
    import yaml

    from pipeline.run.cli import main
    from pipeline.run.value import ValueOptions, run_value
    from pipeline.value.arms import Arm

    cfg, out, _ = tiny_run
    vcfg = cfg.model_copy(deep=True)
    vcfg.sources[0].gpu_hour_usd = 3.0  # the engine's time, priced: what the plan buys samples with
    vcfg.training.heldout_fraction = 0.3  # a held-out figure for most datasets (the value arms' own split)
    opts = ValueOptions(datasets=("chat",), fractions=(0.0, 0.5), steps=4)
    value = run_value(vcfg, opts)
    arms = [r["arm"]["name"] for r in value["arms"]]
    assert arms == ["full.seed0", "chat@0.seed0", "chat@0.5.seed0"]
    assert (out / "value" / "hidden" / "index.json").is_file()  # the run streamed: extracted once, here
    full, no_chat = value["arms"][0], value["arms"][1]
    assert no_chat["spend"]["chat"]["samples"] == 0 and no_chat["spend"]["code"] == full["spend"]["code"]
    assert full["train_samples"] == sum(d["samples"] for d in full["spend"].values()) > no_chat["train_samples"]
    assert all(r["heldout"]["samples"] > 0 and r["steps"] == 4 for r in value["arms"])
    assert list(value["datasets"]) == ["chat"]
    for name in ("chat",):
        d = value["datasets"][name]
        assert d["usd_per_sample"] > 0 and d["spent_usd"] == pytest.approx(full["spend"][name]["usd"], rel=1e-6)
        assert [p["fraction"] for p in d["points"]] == [0.0, 0.5, 1.0]
        assert d["points"][0]["usd"] == 0 and d["points"][-1]["usd"] == pytest.approx(d["spent_usd"], rel=1e-6)
    assert json.loads((out / "value" / "value.json").read_text())["arms"] == value["arms"]
    results = out / "value" / Arm("chat", 0.0, 0).name / "result.json"
    mtime = results.stat().st_mtime_ns
    again = run_value(vcfg, opts)  # every arm has its result: nothing is trained again
    assert results.stat().st_mtime_ns == mtime and again["arms"] == value["arms"]

    raw = yaml.safe_load((Path(__file__).parents[2] / "configs" / "tiny_formats.yaml").read_text())
    raw |= {"output_dir": str(out), "model": {"profile": "deepseek", "path": cfg.model.path}}
    raw["datasets"] = [{**d, "path": str(Path(__file__).parents[2] / d["path"])} for d in raw["datasets"]]
    chat = tmp_path / "chat.jsonl"  # the user added 10 prompts to chat's file since: the plan's room
    lines = Path(raw["datasets"][0]["path"]).read_text().splitlines()
    more = [json.loads(ln) for ln in lines[:10]]
    for row in more:
        row["messages"][-1]["content"] += " Answer once more, briefly."
    chat.write_text("\n".join(lines + [json.dumps(r) for r in more]) + "\n")
    raw["datasets"][0]["path"] = str(chat)
    raw["sources"][0]["gpu_hour_usd"] = 3.0
    raw["training"]["heldout_fraction"] = 0.3
    path = tmp_path / "value.yaml"
    path.write_text(yaml.safe_dump(raw))
    price = min(d["usd_per_sample"] for d in value["datasets"].values())
    capsys.readouterr()
    assert main(["plan", str(path), "--budget-usd", f"{price / 2:.3g}"]) == 2
    refused = capsys.readouterr().err.strip().splitlines()
    assert len(refused) == 1 and refused[0].startswith("plan refused: a budget of $") and "buys no sample" in refused[0]
    assert main(["plan", str(path), "--budget-usd", f"{price * 20:.6g}"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("[plan] $")
    # value drafters of 4 steps, a config whose drafter trains 40: the plan says its curves may misread it
    assert "[plan] ! the value drafters trained 4 steps and this config's drafter trains 40" in printed
    plan = json.loads((out / "value" / "plan.json").read_text())
    assert len(plan["cautions"]) == 1 and "--steps 40" in plan["cautions"][0]
    assert plan["planned_usd"] + plan["unspent_usd"] == pytest.approx(price * 20, rel=1e-4)
    for row in plan["datasets"]:
        assert row["add_usd"] == pytest.approx(row["add_samples"] * row["usd_per_sample"], rel=1e-6)
    rows = {d["name"]: sum(1 for ln in Path(d["path"]).read_text().splitlines() if ln.strip()) for d in raw["datasets"]}
    assert {r["dataset"]: r["room"] for r in plan["datasets"]} == {"chat": 10}
    for name, d in plan["fragment"]["datasets"].items():  # keys to set on the config's entry of that name
        assert name == "chat" and 20 < d["max_rows"] <= rows["chat"] == 30
    page = (out / "report.html").read_text()  # redrawn by value and plan: the curves and the plan
    assert 'data-series="chat"' in page and 'data-series="chat fit"' in page and plan["lines"][0][7:40] in page
    assert main(["plan", str(path), "--budget-usd", "1", "--mix", "nope=1"]) == 2
    assert "no held-out figures for nope" in capsys.readouterr().err
