"""Kill the driver mid-run, restart with the same config: every sample exactly once, no overspend."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.generate.ledger import read_journal

pytestmark = pytest.mark.slow

DATASETS = [("chat", "chat.jsonl", "messages"), ("code", "code.jsonl", "sharegpt"), ("math", "math.jsonl",
                                                                                     "instruction")]
ROWS = 20 + 14 + 14
MAX_TOKENS = 24


@pytest.fixture
def api_server(tmp_path: Path):
    """The local OpenRouter-compatible server (canned answers after 300 ms), on loopback."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve-openrouter", "--host", "127.0.0.1",
                             "--port", "0", "--no-model", "--delay-ms", "300", "--providers", "solo"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    assert line.startswith("READY "), line
    yield line.split()[1]
    proc.terminate()
    proc.wait(timeout=30)


def _config(tmp_path: Path, repo_root: Path, tiny_target: Path, base_url: str, budgets: dict[str, int]) -> Path:
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "model": {"profile": "deepseek", "path": str(tiny_target)},
        "sampling": {"max_tokens": MAX_TOKENS, "temperature": 1.0},
        "datasets": [{"name": n, "path": str(repo_root / "data/prompts" / f), "format": fmt, "thinking": False}
                     for n, f, fmt in DATASETS],
        "sources": [{"kind": "openrouter", "name": "api", "base_url": base_url, "model": "tiny",
                     "api_key_required": False, "num_actors": 1, "batch_size": 4, "max_concurrent_batches": 1,
                     "max_in_flight": 4, "budgets": budgets, "max_attempts": 2, "backoff_base_s": 0.1}],
        "training": None,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _rows(folder: Path) -> list[dict]:
    return [r for f in sorted(folder.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def test_killed_driver_resumes_exactly_once_without_overspend(ray_head, tmp_path, repo_root, tiny_target,
                                                              api_server):
    budgets = {"chat": 20 * MAX_TOKENS, "code": 14 * MAX_TOKENS, "math": 4 * MAX_TOKENS}  # math runs out
    cfg_path = _config(tmp_path, repo_root, tiny_target, api_server, budgets)
    out = tmp_path / "out"
    env = {**ray_head.env, "RAY_ADDRESS": ray_head.address}
    cmd = [sys.executable, "-m", "pipeline", "run", str(cfg_path)]

    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline and len(list((out / "samples").glob("*.parquet"))) < 2:
        assert first.poll() is None, "the first run ended early:\n" + (tmp_path / "first.log").read_text()[-4000:]
        time.sleep(0.5)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    _settle(out)  # the dead driver's writer actor may still commit a shard it had in hand
    written_before = len(_rows(out / "samples")) + len(_rows(out / "quarantine"))
    assert 0 < written_before < ROWS
    # `pipeline status` on the killed run's folder: what is done, what a re-run will do, what was committed.
    killed = _status(cfg_path)
    assert killed["totals"]["rows"] == ROWS
    assert killed["totals"]["passed"] + killed["totals"]["quarantined"] == written_before
    assert killed["totals"]["to_do"] == ROWS - written_before
    committed = {d: v["committed"] for d, v in killed["spend"]["api"]["datasets"].items()}
    assert committed == read_journal(str(out / "ledger-api.json"))  # in flight at the kill included
    assert {d: v["budget"] for d, v in killed["spend"]["api"]["datasets"].items()} == budgets
    assert killed["manifest"] == {"present": True, "differences": []}

    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    # exit 3: finished with rows left to do (math's budget), and the last line says how to resume
    assert second.returncode == 3, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resume with: python -m pipeline run {cfg_path}" in second.stdout.strip().splitlines()[-1]
    report = json.loads((out / "report.json").read_text())

    samples, quarantine = _rows(out / "samples"), _rows(out / "quarantine")
    ids = Counter(r["sample_id"] for r in samples + quarantine)
    assert all(n == 1 for n in ids.values()), "a sample landed twice"
    assert report["this_attempt"]["resumed_done"] == written_before
    assert report["rows_in"] == ROWS
    assert len(ids) + report["not_generated"] == ROWS
    assert report["not_generated"] > 0  # math's budget ran out: recorded as not generated, not failed

    spent = Counter()
    for r in samples:
        spent[r["dataset"]] += max(r["billed_completion_tokens"], 0)
    for q in quarantine:
        spent[q["dataset"]] += max(json.loads(q["detail"]).get("billed_completion_tokens") or 0, 0)
    for dataset, budget in budgets.items():
        assert spent[dataset] <= budget, (dataset, spent[dataset], budget)
    # The server's own bill counts requests killed in flight too: still within the total budget.
    with urllib.request.urlopen(api_server + "/stats") as resp:
        billed_by_server = json.load(resp)["counts"]["billed_completion_tokens"]
    assert billed_by_server <= sum(budgets.values())
    journal = read_journal(str(out / "ledger-api.json"))
    assert all(journal[d] <= budgets[d] for d in budgets)
    done = _status(cfg_path)  # to do now: exactly the prompts math's budget left ungenerated
    assert done["totals"]["to_do"] == report["not_generated"] and done["datasets"]["math"]["to_do"] > 0
    assert done["totals"]["passed"] == report["passed"] and done["duplicates_in_shards"] == 0
    assert sum(v["billed_in_samples"] for v in done["spend"]["api"]["datasets"].values()) == \
        sum(max(r["billed_completion_tokens"], 0) for r in samples)


def _settle(out: Path, quiet_s: float = 5.0, limit_s: float = 90.0) -> None:
    """Wait until the run's shards and journals stay unchanged for `quiet_s`.

    Ray reaps a killed driver's actors a little later: its writer may still commit the shard it had in hand.
    """
    def snapshot() -> list[tuple[str, int, int]]:
        files = [*out.glob("samples/*"), *out.glob("quarantine/*"), *out.glob("*.json*")]
        seen = []
        for p in files:
            try:
                st = p.stat()
            except FileNotFoundError:  # a temporary file renamed into place meanwhile
                continue
            seen.append((str(p), st.st_size, st.st_mtime_ns))
        return sorted(seen)

    deadline, last, since = time.time() + limit_s, None, time.time()
    while time.time() < deadline:
        now = snapshot()
        if now != last:
            last, since = now, time.time()
        elif time.time() - since >= quiet_s:
            return
        time.sleep(0.5)
    raise AssertionError(f"{out} still changing {limit_s:.0f} s after the driver was killed")


def _status(cfg_path: Path) -> dict:
    """`python -m pipeline status CONFIG --json`, as a user runs it (no Ray)."""
    proc = subprocess.run([sys.executable, "-m", "pipeline", "status", str(cfg_path), "--json"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)
