"""Running on a cluster: `ray job submit` of the pipeline on a local Ray head, and what `ray job logs` then shows
(the project's plain progress lines and report, no third-party lines)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.console import FOREIGN


@pytest.mark.slow
def test_ray_job_submit_runs_the_pipeline(ray_head, tmp_path: Path, repo_root: Path, tiny_target: Path):
    out = tmp_path / "out"
    cfg = {
        "output_dir": str(out),
        "model": {"profile": "deepseek", "path": str(tiny_target)},
        "sampling": {"max_tokens": 12},
        "datasets": [{"name": "chat", "path": str(repo_root / "data/prompts/chat.jsonl"), "max_rows": 3}],
        "sources": [{"kind": "vllm", "name": "vllm-cpu", "dtype": "float32", "max_model_len": 1024}],
        "training": None,
    }
    cfg_path = tmp_path / "job.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    job_id = f"pipeline-{tmp_path.name}"
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts", "job"]
    proc = subprocess.run(
        [*ray_cli, "submit", "--address", ray_head.dashboard, "--submission-id", job_id,
         "--working-dir", str(repo_root), "--", "python", "-m", "pipeline", "run", str(cfg_path)],
        env=ray_head.env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Run report" in proc.stdout and "succeeded" in proc.stdout + proc.stderr

    # What a user reads later with `ray job logs`: the driver's console only (no terminal, so plain lines)
    logs = subprocess.run([*ray_cli, "logs", "--address", ray_head.dashboard, job_id], env=ray_head.env,
                          capture_output=True, text=True, timeout=120).stdout
    # (the Ray CLI's own lines and the job supervisor's "Running entrypoint" come first)
    lines = [ln for ln in logs.splitlines() if ln.strip()]
    header = f"pipeline run {cfg_path}"
    assert header in lines, logs
    lines = lines[lines.index(header):]
    assert any(re.match(r"\[generate\] 3/3 done in \S+ \(\d+ passed", ln) for ln in lines), logs
    job_out = logs[logs.index(header):]
    assert "\r" not in job_out and "\x1b[" not in job_out, "no redraws or colour codes without a terminal"
    assert "Traceback" not in job_out, logs
    foreign = [ln for ln in lines if FOREIGN.search(ln)]
    assert foreign == [], "third-party lines in ray job logs:\n" + "\n".join(foreign)
    assert "Run report" in logs and lines[-1].startswith("done: every prompt passed or quarantined"), logs
    report = json.loads((out / "report.json").read_text())
    assert report["rows_in"] == 3 and report["passed"] + report["quarantined"] == 3
