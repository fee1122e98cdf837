"""A run a person can watch: `python -m pipeline run` as the quick start runs it (its own local Ray, no
RAY_ADDRESS, output to a pipe) prints a header, one progress display per phase and the report, and
nothing else; vLLM, Ray, transformers and the workers' output go to OUTPUT/logs/. With --verbose they
stream to the console too."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.console import FOREIGN


@pytest.fixture(scope="module")
def run_config(tmp_path_factory, repo_root: Path, clean_target: Path) -> Path:
    """The quick start's shape, smaller: two datasets, 12 prompts, 6 training steps, a held-out quarter."""
    tmp = tmp_path_factory.mktemp("console")
    prompts = repo_root / "data" / "prompts"
    cfg = {
        "output_dir": str(tmp / "out"),
        "model": {"profile": "deepseek", "path": str(clean_target)},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 48, "seed": 0},
        "datasets": [
            {"name": "chat", "path": str(prompts / "chat.jsonl"), "format": "messages", "max_rows": 8},
            {"name": "code", "path": str(prompts / "code.jsonl"), "format": "sharegpt", "max_rows": 4},
        ],
        "sources": [{"kind": "vllm", "name": "vllm-cpu", "num_actors": 1, "num_cpus": 1, "batch_size": 16,
                     "dtype": "float32", "max_model_len": 1024}],
        "extraction": {"batch_tokens": 4096, "max_len": 1024, "num_cpus": 0.5},
        "training": {"steps": 6, "batch_tokens": 1024, "max_len": 256, "ttt_steps": 2, "draft_vocab_size": 4096,
                     "checkpoint_every": 6, "log_every": 3, "heldout_fraction": 0.25},
    }
    path = tmp / "console.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(cfg: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PIPELINE_PROGRESS_S")}
    return subprocess.run([sys.executable, "-m", "pipeline", "run", str(cfg), *extra], env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def quiet(run_config: Path) -> subprocess.CompletedProcess:
    return _run(run_config)


def test_console_shows_the_run_and_nothing_else(quiet, run_config: Path):
    out = quiet.stdout + quiet.stderr
    assert quiet.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    lines = [ln for ln in out.splitlines() if ln.strip()]
    foreign = [ln for ln in lines if FOREIGN.search(ln)]
    assert foreign == [], "third-party lines on the console:\n" + "\n".join(foreign)
    # Header, a first and a last line per phase plus one progress line per 30 s of it (no terminal: plain lines),
    # then the report and the exit line. The periodic lines follow the machine's speed, so their allowance is
    # counted from the run's own phase times: a loaded machine prints more of them, never anything else.
    head, sep, report = out.partition("=" * 64)
    progress = [ln for ln in head.splitlines() if ln.strip()]
    seconds = json.loads((Path(yaml.safe_load(run_config.read_text())["output_dir"]) / "report.json").read_text())[
        "seconds"]
    periodic = sum(int(v // 30) for k, v in seconds.items() if k not in ("total", "read", "ray_init"))
    assert sep and len(progress) <= 8 + 2 * 5 + periodic, out  # 5 phases: generate, extract, train, held-out, served
    assert len(report.splitlines()) <= 32, out  # a line per figure of the report
    # header
    assert lines[0] == f"pipeline run {run_config}"
    assert any(ln.startswith("  datasets  chat 8, code 4 (12 rows)") for ln in lines), out
    assert any(ln.startswith("  training  6 steps, ") for ln in lines), out
    assert any(ln.strip().startswith("logs") and "/logs/" in ln for ln in lines), out
    # one progress display per phase, each ending with a final line
    assert any(re.match(r"\[generate\] 12/12 done in \S+ \(\d+ passed", ln) for ln in lines), out
    assert any(ln.startswith("[extract] ") and " samples in " in ln for ln in lines), out
    assert any(ln.startswith("[train] step 6/6 done in ") for ln in lines), out
    assert any(ln.startswith("[held-out] acceptance length ") for ln in lines), out
    assert any(ln.startswith("[served] acceptance length ") and " in vLLM on " in ln for ln in lines), out
    # the report, then the exit line
    assert "Run report" in out and lines[-1].startswith("done: every prompt passed or quarantined")


def test_logs_folder_holds_what_the_console_does_not(quiet, run_config: Path):
    assert quiet.returncode == 0, (quiet.stdout + quiet.stderr)[-4000:]
    logs = Path(yaml.safe_load(run_config.read_text())["output_dir"]) / "logs"
    files = {p.name: p.read_text(errors="replace") for p in logs.glob("*.log")}
    assert {"pipeline.log", "ray.log", "worker-VLLMGenerator.log", "worker-RayTrainWorker.log"} <= set(files), files
    assert "vllm" in files["worker-VLLMGenerator.log"].lower()
    assert "Started a local Ray instance" in files["ray.log"]
    # the drafter's step line once per step logged, not twice (print in a Ray Train worker is teed)
    steps = re.findall(r"\[drafter\] step (\d+)/6", files["worker-RayTrainWorker.log"])
    assert steps == ["3", "6"], files["worker-RayTrainWorker.log"]
    # the engine stops before Ray reaps the actor: no resource-tracker tracebacks anywhere
    noise = [f"{name}: {ln}" for name, text in files.items() for ln in text.splitlines()
             if "resource_tracker" in ln or "KeyError: '/psm_" in ln
             # the state API answers (Ray Train's placement-group cleaner polls it)
             or "Failed to query Ray Train Controller" in ln]
    assert noise == [], "\n".join(noise[:40])


def test_verbose_streams_the_logs_too(quiet, run_config: Path):
    """The same config again with --verbose (it resumes: nothing to generate; extraction, training restore and
    held-out evaluation run again): the libraries' and workers' lines are on the console. The served measure is
    off in this rerun (not part of the manifest): a second vLLM engine would add a minute and no line this test
    reads."""
    assert quiet.returncode == 0, (quiet.stdout + quiet.stderr)[-4000:]
    cfg = yaml.safe_load(run_config.read_text())
    cfg["training"]["served_eval"] = False
    again = run_config.with_name("console-verbose.yaml")
    again.write_text(yaml.safe_dump(cfg))
    loud = _run(again, "--verbose")
    out = loud.stdout + loud.stderr
    assert loud.returncode == 0, out[-4000:]
    assert len(out.splitlines()) > len((quiet.stdout + quiet.stderr).splitlines()), out
    assert "Started a local Ray instance" in out
    assert re.search(r"\((MapWorker|RayTrainWorker|TrainController|SplitCoordinator)[^)]* pid=\d+", out), out
    assert "Run report" in out and "resume    12 rows already done, 0 to do" in out
