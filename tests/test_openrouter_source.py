"""The HTTP source end to end against the local server: faults, budget, resume, key hygiene, Ray pool."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline.ledger import Ledger, spent_from_samples
from pipeline.openrouter_server import RANDOM_FAULTS, CannedBackend, ServerConfig, serve_in_thread
from pipeline.profiles import load_profile
from pipeline.records import SAMPLE_COLUMNS
from pipeline.sources.openrouter import (
    OpenRouterGenerator,
    OpenRouterSourceConfig,
    ledger_for,
    local_ledger,
    map_openrouter,
    split_outcomes,
)

# Set at import, before any fixture starts Ray: actors inherit the environment Ray starts with.
KEY_ENV = "OPENROUTER_TEST_SOURCE_KEY"
KEY = "sk-or-v1-sourcetest-5f2b9c7d1e3a4b6c"
os.environ[KEY_ENV] = KEY

FATAL = {0: "400", 1: "401", 2: "402", 3: "403", 4: "echo-key"}
STUCK = {5: "always-502", 6: "always-cutoff", 7: "always-200-error", 8: "always-timeout"}


@pytest.fixture(scope="module")
def profile():
    return load_profile("deepseek")


def prompt_rows(n: int, dataset: str = "d", markers: dict[int, str] | None = None, thinking: bool = True) -> list[dict]:
    rows = []
    for i in range(n):
        text = f"Question {i} of {dataset}?" + (f" [[fault:{markers[i]}]]" if markers and i in markers else "")
        rows.append({"sample_id": f"{dataset}:{i}", "dataset": dataset, "row_index": i,
                     "messages": json.dumps([{"role": "user", "content": text}]), "tools": "",
                     "thinking": thinking, "prompt_ids": [0, 5, 6], "prompt_assistant_mask": [0, 0, 0]})
    return rows


def source_cfg(url: str, **over) -> OpenRouterSourceConfig:
    base = dict(model="tiny/deepseek-tiny", base_url=url, api_key_env=KEY_ENV, max_attempts=4,
                backoff_base_s=0.01, backoff_max_s=0.1, max_retry_after_s=0.2, request_timeout_s=0.6,
                health={"window": 20, "min_requests": 8, "max_error_rate": 0.5, "max_invalid_rate": 0.3},
                sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 64, "seed": 0},
                tune_gc=False)  # process-wide GC settings are for actors, not the test process
    base.update(over)
    return OpenRouterSourceConfig.model_validate(base)


def fault_server_cfg(**over) -> ServerConfig:
    cfg = ServerConfig(api_key_env=KEY_ENV, padding=8, seed=7, retry_after_s=0.05, timeout_s=1.5,
                       providers=("Alpha", "Beta", "Gamma", "Delta"), rates={k: 0.04 for k in RANDOM_FAULTS},
                       miscount_providers=("Beta",), corrupt_providers=("Gamma",), flaky_providers={"Delta": 0.7})
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def run_local(gen: OpenRouterGenerator, rows: list[dict]):
    async def go():
        try:
            return await gen(rows)
        finally:
            await gen.close()

    return asyncio.run(go()).to_pylist()


def assert_every_prompt_accounted(rows: list[dict], out: list[dict]) -> None:
    ids = [r["sample_id"] for r in out]
    assert len(out) == len(rows) and len(set(ids)) == len(ids), "a prompt was lost or duplicated"
    assert set(ids) == {r["sample_id"] for r in rows}
    for r in out:
        assert r["status"] in ("ok", "quarantined", "not_generated")
        if r["status"] != "ok":
            assert r["error"], f"{r['sample_id']} has no reason"


def assert_key_absent(*texts: str) -> None:
    for t in texts:
        assert KEY not in t
        assert KEY[10:] not in t  # not even the tail of it


def test_every_fault_ends_passed_or_quarantined(profile, caplog):
    caplog.set_level(logging.DEBUG)
    rows = prompt_rows(120, markers={**FATAL, **STUCK})
    with serve_in_thread(fault_server_cfg(), CannedBackend(2, profile)) as (url, server):
        cfg = source_cfg(url, budgets={"d": 120 * 4 * 64})  # every attempt fits: the budget is not the limit here
        ledger = local_ledger(cfg, strict=True)  # strict: a settle over budget raises
        out = run_local(OpenRouterGenerator(cfg, "deepseek", None, ledger, seed=1), rows)
    assert_every_prompt_accounted(rows, out)
    by_id = {r["sample_id"]: r for r in out}
    status = Counter(r["status"] for r in out)
    assert status["not_generated"] == 0 and status["ok"] >= 90, status

    for i, code in FATAL.items():
        r = by_id[f"d:{i}"]
        assert r["status"] == "quarantined" and r["attempts"] == 1, r
        assert ("401" if code == "echo-key" else code) in r["error"]
    assert "[REDACTED]" in by_id["d:4"]["error"]
    for i in STUCK:
        r = by_id[f"d:{i}"]
        assert r["status"] == "quarantined" and r["attempts"] == cfg.max_attempts, r
    assert "502" in by_id["d:5"]["error"] and "error" in by_id["d:7"]["error"]
    assert "timeout" in by_id["d:8"]["error"]

    for r in out:
        if r["status"] == "ok":
            assert r["ids_from"] == "rebuilt" and r["source_kind"] == "openrouter" and r["provider"]
            assert r["output_ids"] and r["billed_completion_tokens"] > 0 and r["t_generate_s"] > 0
            assert json.loads(r["sampling"]) == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64, "seed": 0}
            if r["content"] not in ("", None) and r["provider"] == "Alpha":
                assert r["output_ids"][-1] == profile.eot_id and profile.think_end_id in r["output_ids"]
    samples, quarantine, not_generated = split_outcomes(out)
    assert len(samples) + len(quarantine) == len(rows) and not not_generated
    assert set(samples[0]) == set(SAMPLE_COLUMNS)
    assert all(q["stage"] == "generate" and q["reason"] for q in quarantine)

    rep = ledger.report()
    assert rep["violations"] == [] and rep["datasets"]["d"]["reserved"] == 0
    assert rep["datasets"]["d"]["spent"] <= cfg.budgets["d"]
    # Billing drift (Beta), corrupted text (Gamma) and 502s (Delta) get routed around; honest Alpha does not.
    assert {"Beta", "Gamma", "Delta"} <= set(rep["excluded"]) and "Alpha" not in rep["excluded"]
    assert "drift" not in rep["providers"]["Alpha"] and rep["providers"]["Beta"]["mean_abs_billing_drift"] > 8
    billed_ok = Counter()
    for s in samples:
        billed_ok[s["provider"]] += s["billed_completion_tokens"]
    for p, n in billed_ok.items():
        assert rep["providers"][p]["completion_tokens"] >= n
    assert sum(p["completion_tokens"] for p in rep["providers"].values()) == rep["datasets"]["d"]["spent"]
    assert abs(sum(p["cost"] for p in rep["providers"].values()) - rep["datasets"]["d"]["cost"]) < 1e-9
    assert server.counts.get("fault_cutoff", 0) and server.counts.get("client_gone", 0)
    assert_key_absent(json.dumps(out, default=str), json.dumps(rep), caplog.text)


def test_budget_stops_requests_and_a_resumed_run_finishes(profile):
    rows = prompt_rows(30)
    with serve_in_thread(ServerConfig(api_key_env=KEY_ENV), CannedBackend(2, profile)) as (url, server):
        cfg = source_cfg(url, budgets={"d": 300}, sampling={"max_tokens": 32})
        ledger = local_ledger(cfg, strict=True)
        out = run_local(OpenRouterGenerator(cfg, "deepseek", None, ledger), rows)
        assert_every_prompt_accounted(rows, out)
        samples, quarantine, not_generated = split_outcomes(out)
        spent = ledger.report()["datasets"]["d"]["spent"]
        per = samples[0]["billed_completion_tokens"]
        assert not quarantine and spent <= 300 and spent == per * len(samples)
        # Waiting on in-flight reservations gets past 300 // 32 requests: refunds make room.
        assert len(samples) == (300 - 32) // per + 1 > 300 // 32
        assert len(not_generated) == 30 - len(samples)
        assert all("budget" in r["reason"] for r in not_generated)
        assert server.counts["requests"] == len(samples)  # nothing was sent once the budget was spent

        # Resume: spend restored from the written samples, a larger budget, only the rows not generated.
        ledger2 = Ledger({"d": 900}, spent=spent_from_samples(samples), strict=True)
        todo = [r for r in rows if r["sample_id"] in {n["sample_id"] for n in not_generated}]
        out2 = run_local(OpenRouterGenerator(cfg, "deepseek", None, ledger2), todo)
    samples2, q2, ng2 = split_outcomes(out2)
    assert not q2 and not ng2
    all_ids = [s["sample_id"] for s in samples + samples2]
    assert sorted(all_ids) == sorted(r["sample_id"] for r in rows)
    assert ledger2.report()["datasets"]["d"]["spent"] == per * 30 <= 900


def test_missing_key_is_named_not_shown(monkeypatch):
    monkeypatch.delenv("OPENROUTER_TEST_UNSET_KEY", raising=False)
    cfg = OpenRouterSourceConfig(model="m", api_key_env="OPENROUTER_TEST_UNSET_KEY")
    with pytest.raises(RuntimeError, match="OPENROUTER_TEST_UNSET_KEY"):
        OpenRouterGenerator(cfg, "deepseek", None, Ledger())


def _start_server_process(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str, Path]:
    log_path = tmp_path / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pipeline.openrouter_server import main; sys.exit(main(sys.argv[1:]))",
         "--port", "0", *args], stdout=subprocess.PIPE, stderr=log_path.open("w"), text=True,
        cwd=Path(__file__).resolve().parents[1])
    deadline = time.time() + 120
    url = ""
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY "):
            url = line.split()[1]
            break
        if proc.poll() is not None:
            break
    if not url:
        proc.kill()
        raise RuntimeError(f"server did not start: {log_path.read_text()[-2000:]}")
    return proc, url, log_path


def test_ray_actor_pool_with_shared_ledger(ray_session, tmp_path):
    """Two actors share one ledger actor; every fault kind injected; two datasets, one with a small budget."""
    ray = ray_session
    faults = [f"--fault-{k}={0.04}" for k in RANDOM_FAULTS]
    proc, url, server_log = _start_server_process(
        tmp_path, "--no-model", "--delay-ms", "5", "--api-key-env", KEY_ENV, "--padding", "8",
        "--providers", "Alpha,Beta,Gamma", "--miscount-provider", "Beta", "--retry-after", "0.05",
        "--timeout-s", "1.5", *faults)
    try:
        rows = prompt_rows(80, "big", markers={0: "400", 1: "echo-key", 2: "always-502"}) + prompt_rows(40, "small")
        cfg = source_cfg(url, num_actors=2, num_cpus=0.25, batch_size=16, max_in_flight=64,
                         budgets={"small": 10 * 64}, default_budget=None, tune_gc=True)
        ledger = ledger_for(cfg, strict=True)
        ds = ray.data.from_items(rows)
        out = map_openrouter(ds, cfg, "deepseek", None, ledger).take_all()
        report = ray.get(ledger.report.remote())
    finally:
        proc.terminate()
        rc = proc.wait(30)
    assert rc == 0  # SIGTERM stops the server cleanly
    out = [dict(r) for r in out]
    assert_every_prompt_accounted(rows, out)
    st = Counter((r["dataset"], r["status"]) for r in out)
    assert st[("big", "not_generated")] == 0 and st[("big", "ok")] >= 70, st
    assert st[("small", "not_generated")] > 0 and st[("small", "ok")] >= 5, st
    by_id = {r["sample_id"]: r for r in out}
    assert by_id["big:0"]["status"] == by_id["big:1"]["status"] == by_id["big:2"]["status"] == "quarantined"
    assert report["violations"] == [] and report["datasets"]["small"]["spent"] <= 10 * 64
    assert all(a["reserved"] == 0 for a in report["datasets"].values())
    assert "Beta" in report["excluded"]

    session_dir = Path(ray._private.worker._global_node.get_session_dir_path())
    logs = "".join(p.read_text(errors="replace") for p in (session_dir / "logs").rglob("*") if p.is_file())
    assert len(logs) > 1000  # the actors' logs were read
    assert_key_absent(json.dumps(out, default=str), json.dumps(report), server_log.read_text(), logs)
