"""The quick start's drafter drafts: `python -m pipeline run configs/tiny.yaml` (the trained tiny target, its
own domain's prompts) reports a held-out acceptance, and vLLM, loading the export with EAGLE-3 speculative
decoding, measures the same drafter on the held-out prompts: at least 1.5 tokens per step at k=3 (an
untrained drafter gives 1.0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from training.heldout import is_held_out

pytestmark = pytest.mark.slow

K = 3
GOAL = 1.5


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory, repo_root: Path, trained_target: Path, ray_head) -> tuple[Path, dict, str]:
    """The quick start's config as shipped, on the session's trained target and Ray head."""
    tmp = tmp_path_factory.mktemp("quickstart")
    cfg = yaml.safe_load((repo_root / "configs" / "tiny.yaml").read_text())
    cfg["output_dir"] = str(tmp / "out")
    cfg["model"]["path"] = str(trained_target)
    for d in cfg["datasets"]:
        d["path"] = str(repo_root / d["path"])
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**ray_head.env, "RAY_ADDRESS": ray_head.address}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "run", str(path)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return tmp / "out", json.loads((tmp / "out" / "report.json").read_text()), proc.stdout


def test_the_quick_start_reports_a_drafter_that_drafts(quickstart):
    out, report, console = quickstart
    heldout = report["training"]["heldout"]
    assert heldout["samples"] >= 10 and heldout["acceptance_length"] >= GOAL, heldout
    assert f"[held-out] acceptance length {heldout['acceptance_length']:.3f} at k={K}" in console
    assert report["quarantined"] <= 0.05 * report["rows_in"], report["quarantine_by_stage"]


def test_vllm_measures_the_exported_drafter_on_held_out_prompts(quickstart, trained_target: Path, tmp_path):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from training.evaluate import main as evaluate

    out, report, _ = quickstart
    fraction = yaml.safe_load((out.parent / "tiny.yaml").read_text())["training"]["heldout_fraction"]
    prompts = [r["prompt_ids"] for f in sorted((out / "samples").glob("*.parquet"))
               for r in pq.read_table(f, columns=["sample_id", "prompt_ids"]).to_pylist()
               if is_held_out(r["sample_id"], fraction)]
    assert len(prompts) >= 10
    (tmp_path / "held.json").write_text(json.dumps(prompts))
    got = evaluate(["--target", str(trained_target), "--draft", str(out / "drafter" / "export"),
                    "--prompts", str(tmp_path / "held.json"), "--k", str(K), "--max-tokens", "48",
                    "--max-model-len", "1024", "--no-baseline", "--out", str(tmp_path / "eval.json")])
    spec = got["spec"]
    print("vLLM", {k: spec[k] for k in ("acceptance_length", "per_position_acceptance", "num_drafts")},
          "simulated", report["training"]["heldout"])
    assert spec["num_drafts"] > 0 and spec["acceptance_length"] >= GOAL
