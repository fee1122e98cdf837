"""The GPU scripts, run in their CPU smoke modes: they must keep working between the rare GPU sessions.

Each runs as a subprocess exactly as documented (GPU nodes get the same command
with CUDA defaults); the results they write are checked for what the GPU run
reports, so a refactor of the modules they import cannot silently break them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _run(repo: Path, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=repo, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_gpu_extract_smoke(repo_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu_extract.json"
    _run(repo_root, ["bench/gpu_extract.py", "--device", "cpu", "--dtype", "float32", "--hidden", "256",
                     "--layers", "8", "--heads", "4", "--kv-heads", "2", "--intermediate", "512", "--vocab", "1000",
                     "--samples", "8", "--max-len", "128", "--batch-tokens", "512", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["capture_equals_output_hidden_states"] is True
    assert r["aux_layer_ids"] == [2, 4, 5]  # [2, L//2, L-3] for 8 layers
    assert r["samples"] == 8 and r["tokens"] > 8
    assert set(r["ratio_to_bare"]) == {"capture", "rows_bf16", "rows_fp32"}
    assert all(0 < v < 10 for v in r["ratio_to_bare"].values())
    # bf16 shards: 4 states (3 aux + final) x hidden x 2 bytes per token, plus ids and mask.
    assert 4 * 256 * 2 <= r["shards"]["bytes_per_token"] < 4 * 256 * 2 * 1.2
    assert r["shards"]["samples"] == 8


def test_gpu_training_smoke(repo_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu_training.json"
    _run(repo_root, ["bench/gpu_training.py", "--device", "cpu", "--small", "--steps", "3", "--out", str(out)])
    r = json.loads(out.read_text())
    s = r["summary"]
    assert s["device"] == "cpu" and s["ttt"] == 7
    assert len(r["log"]) == 3 and [e["step"] for e in r["log"]] == [1, 2, 3]
    assert all(math.isfinite(e["loss"]) and e["grad_norm"] > 0 for e in r["log"])
    assert len(s["last_acc"]) == 7 and s["tokens_per_s"] > 0 and s["time_ratio_vs_baseline"] > 0


def test_sglang_smoke_reports_missing_package(repo_root: Path, tmp_path: Path) -> None:
    """Without sglang or a GPU the smoke script says so and exits 2, rather than crashing on import."""
    pytest.importorskip("ray")  # the script's own imports must all resolve on a CPU machine
    proc = subprocess.run([sys.executable, "scripts/gpu_sglang_smoke.py", "--model-dir", str(tmp_path)],
                          cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
