"""Running on a cluster: `ray job submit` of the pipeline on a local Ray head."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


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
    proc = subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", ray_head.dashboard,
         "--working-dir", str(repo_root), "--", "python", "-m", "pipeline", "run", str(cfg_path)],
        env=ray_head.env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Run report" in proc.stdout and "succeeded" in proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["rows_in"] == 3 and report["passed"] + report["quarantined"] == 3
