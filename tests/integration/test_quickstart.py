"""The quick start as a person runs and watches it: `python -m pipeline run configs/tiny.yaml` on its own local
Ray (no RAY_ADDRESS), output to a pipe, on the session's trained target.

Its drafter drafts: the run reports a held-out acceptance, and vLLM, loading the export with EAGLE-3 speculative
decoding (the run's own served measure), gets the same figure per position on the held-out prompts: at least
1.5 tokens per step at k=3 (an untrained drafter gives 1.0). Its console holds a header, one progress display
per phase and the report, and nothing else; vLLM, Ray, transformers and the workers' output go to OUTPUT/logs/.
With --verbose they stream to the console too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers.console import FOREIGN

pytestmark = pytest.mark.slow

K = 3
GOAL = 1.5


@dataclass
class Run:
    config: Path
    out: Path
    report: dict
    proc: subprocess.CompletedProcess

    @property
    def console(self) -> str:
        return self.proc.stdout + self.proc.stderr


def _run(cfg: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PIPELINE_PROGRESS_S")}
    return subprocess.run([sys.executable, "-m", "pipeline", "run", str(cfg), *extra], env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory, repo_root: Path, trained_target: Path) -> Run:
    """The quick start's config as shipped, on the session's trained target."""
    tmp = tmp_path_factory.mktemp("quickstart")
    cfg = yaml.safe_load((repo_root / "configs" / "tiny.yaml").read_text())
    cfg["output_dir"] = str(tmp / "out")
    cfg["model"]["path"] = str(trained_target)
    for d in cfg["datasets"]:
        d["path"] = str(repo_root / d["path"])
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = _run(path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return Run(path, tmp / "out", json.loads((tmp / "out" / "report.json").read_text()), proc)


def test_the_quick_start_reports_a_drafter_that_drafts(quickstart: Run):
    heldout = quickstart.report["training"]["heldout"]
    assert heldout["samples"] >= 10 and heldout["acceptance_length"] >= GOAL, heldout
    assert f"[held-out] acceptance length {heldout['acceptance_length']:.3f} at k={K}" in quickstart.console
    assert quickstart.report["quarantined"] <= 0.05 * quickstart.report["rows_in"], (
        quickstart.report["quarantine_by_stage"])


def test_served_acceptance_matches_the_simulated_one(quickstart: Run):
    """The run serves its export in vLLM (EAGLE-3, greedy, up to the end of turn) on the held-out samples' own
    prompts and reports it beside the simulated figure. The quick start generates greedily, so both count drafts
    over the same tokens: they may differ only where float rounding flips a near-tie between vLLM's kernels and
    the extraction's, a few drafts of ~200 (0.03 is six flipped rounds). The binomial tolerance the report
    applies (three standard errors, ~0.1 here) is the looser check a sampled (T > 0) run gets."""
    served, sim = quickstart.report["training"]["served"], quickstart.report["training"]["heldout"]
    print("served", served, "simulated", sim)
    assert served["prompts"] == sim["samples"] >= 10 and served["k"] == sim["k"] == K
    assert served["acceptance_length"] >= GOAL  # an untrained drafter gives 1.0
    assert served["agreement"]["within"], served["agreement"]
    assert abs(served["drafts"] - sim["drafts"]) <= 0.03 * sim["drafts"]
    for got, want in zip(served["per_position"], sim["per_position"], strict=True):
        assert got == pytest.approx(want, abs=0.03)
    assert f"[served] acceptance length {served['acceptance_length']:.3f} at k={K} in vLLM" in quickstart.console


def test_console_shows_the_run_and_nothing_else(quickstart: Run):
    out, report = quickstart.console, quickstart.report
    assert "Traceback" not in out, out[-4000:]
    lines = [ln for ln in out.splitlines() if ln.strip()]
    foreign = [ln for ln in lines if FOREIGN.search(ln)]
    assert foreign == [], "third-party lines on the console:\n" + "\n".join(foreign)
    # Header, a first and a last line per phase plus one progress line per 30 s of it (no terminal: plain lines),
    # then the report and the exit line. The periodic lines follow the machine's speed, so their allowance is
    # counted from the run's own phase times: a loaded machine prints more of them, never anything else.
    head, sep, tail = out.partition("=" * 64)
    progress = [ln for ln in head.splitlines() if ln.strip()]
    periodic = sum(int(v // 30) for k, v in report["seconds"].items() if k not in ("total", "read", "ray_init"))
    assert sep and len(progress) <= 8 + 2 * 5 + periodic, out  # 5 phases: generate, extract, train, held-out, served
    assert len(tail.splitlines()) <= 32, out  # a line per figure of the report
    # header
    rows = report["rows_in"]
    assert lines[0] == f"pipeline run {quickstart.config}"
    assert any(ln.startswith(f"  datasets  shop {rows - 32}, shop_plain 32 ({rows} rows)") for ln in lines), out
    assert any(ln.startswith("  training  80 steps, ") for ln in lines), out
    assert any(ln.strip().startswith("logs") and "/logs/" in ln for ln in lines), out
    # one progress display per phase, each ending with a final line
    assert any(re.match(rf"\[generate\] {rows}/{rows} done in \S+ \(\d+ passed", ln) for ln in lines), out
    assert any(ln.startswith("[extract] ") and " samples in " in ln for ln in lines), out
    assert any(ln.startswith("[train] step 80/80 done in ") for ln in lines), out
    assert any(ln.startswith("[held-out] acceptance length ") for ln in lines), out
    assert any(ln.startswith("[served] acceptance length ") and " in vLLM on " in ln for ln in lines), out
    # the report, then the exit line
    assert "Run report" in out and lines[-1].startswith("done: every prompt passed or quarantined")


def test_logs_folder_holds_what_the_console_does_not(quickstart: Run):
    files = {p.name: p.read_text(errors="replace") for p in (quickstart.out / "logs").glob("*.log")}
    assert {"pipeline.log", "ray.log", "worker-VLLMGenerator.log", "worker-RayTrainWorker.log"} <= set(files), files
    assert "vllm" in files["worker-VLLMGenerator.log"].lower()
    assert "Started a local Ray instance" in files["ray.log"]
    # the drafter's step line once per step logged, not twice (print in a Ray Train worker is teed)
    steps = re.findall(r"\[drafter\] step (\d+)/80", files["worker-RayTrainWorker.log"])
    assert steps == ["20", "40", "60", "80"], files["worker-RayTrainWorker.log"]
    # the engine stops before Ray reaps the actor: no resource-tracker tracebacks anywhere
    noise = [f"{name}: {ln}" for name, text in files.items() for ln in text.splitlines()
             if "resource_tracker" in ln or "KeyError: '/psm_" in ln
             # the state API answers (Ray Train's placement-group cleaner polls it)
             or "Failed to query Ray Train Controller" in ln]
    assert noise == [], "\n".join(noise[:40])


def test_verbose_streams_the_logs_too(quickstart: Run):
    """The same folder again with --verbose: the libraries' and workers' lines are on the console. It resumes
    (nothing to generate) with training off and extraction to shards (neither is part of the manifest): one
    extraction pass gives the workers' lines; training's restore, held-out evaluation and the served measure
    would add minutes and no line this test reads."""
    cfg = yaml.safe_load(quickstart.config.read_text())
    cfg["training"] = None
    cfg["extraction"]["mode"] = "shards"
    again = quickstart.config.with_name("tiny-verbose.yaml")
    again.write_text(yaml.safe_dump(cfg))
    loud = _run(again, "--verbose")
    out = loud.stdout + loud.stderr
    assert loud.returncode == 0, out[-4000:]
    assert "Started a local Ray instance" in out
    assert re.search(r"\((MapWorker|RayTrainWorker|TrainController|SplitCoordinator)\S* pid=\d+\)", out), out
    rows = quickstart.report["rows_in"]
    assert "Run report" in out and f"resume    {rows} rows already done, 0 to do" in out
    # the report's extraction figures are this attempt's (one pass over every passed sample), not summed with
    # the quick start's (its training pass and its held-out pass)
    report = json.loads((quickstart.out / "report.json").read_text())
    assert report["training"]["extraction"]["samples"] == rows == report["training"]["extracted"], report["training"]
