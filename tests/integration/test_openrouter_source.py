"""The HTTP source end to end against the local server: faults, budget, resume, key hygiene, Ray pool."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline.base.layout import RunLayout
from pipeline.base.records import SAMPLE_COLUMNS
from pipeline.demo.openrouter_server import RANDOM_FAULTS, CannedBackend, ServerConfig
from pipeline.generate.ledger import Ledger, ledger_for
from pipeline.generate.sources.http.config import OpenRouterSourceConfig
from pipeline.generate.sources.http.openrouter import OpenRouterGenerator
from pipeline.profiles import load_profile
from tests.helpers.http import local_ledger, map_openrouter, split_outcomes
from tests.helpers.ledger import spent_from_samples
from tests.helpers.server import serve_in_thread

# Set at import, before any fixture starts Ray: actors inherit the environment Ray starts with.
KEY_ENV = "OPENROUTER_TEST_SOURCE_KEY"
KEY = "sk-or-v1-sourcetest-5f2b9c7d1e3a4b6c"
os.environ[KEY_ENV] = KEY

SAMPLE_FAULTS = {0: "400"}  # would fail the same way again: quarantined
STUCK = {5: "always-502", 6: "always-cutoff", 7: "always-200-error", 8: "always-timeout"}  # transient every time


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


# For a test that counts requests or bills exactly with no fault injected. The helper's 0.6 s timeout is for the
# fault tests (their server stalls 1.5 s); on a loaded machine it can fire on an answer the server then finishes
# and bills, and the retry is a second request and a second bill -- as designed (the ledger charges the first as
# maybe billed), but not the count such a test checks.
CALM_TIMEOUT_S = 60.0


def fault_server_cfg(**over) -> ServerConfig:
    cfg = ServerConfig(api_key_env=KEY_ENV, padding=8, seed=7, retry_after_s=0.05, timeout_s=1.5,
                       providers=("Alpha", "Beta", "Gamma", "Delta"),
                       # every random fault but an odd-shaped answer, which is quarantined (its own test); ~40% of
                       # requests fail in all, so an honest provider stays under the exclusion policy's 50%
                       rates={k: 0.4 / (len(RANDOM_FAULTS) - 1) for k in RANDOM_FAULTS if k != "choices-object"},
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


def test_every_fault_ends_in_its_class(profile, caplog):
    """Random faults of every kind are retried through; a 400 with no detail ("Bad Request") is retried, and
    quarantined once it came back on every attempt while other prompts were answered; a prompt that fails
    transiently on every attempt is left to do (not quarantined: the API may recover), with its attempts."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="pipeline")  # the engine's "retrying ..." lines
    rows = prompt_rows(120, markers={**SAMPLE_FAULTS, **STUCK})
    with serve_in_thread(fault_server_cfg(), CannedBackend(2, profile)) as (url, server):
        cfg = source_cfg(url, budgets={"d": 120 * 4 * 64})  # every attempt fits: the budget is not the limit here
        ledger = local_ledger(cfg, strict=True)  # strict: a settle over budget raises
        out = run_local(OpenRouterGenerator(cfg, "deepseek", None, ledger, seed=1), rows)
        time.sleep(cfg.request_timeout_s + 1.6)  # timed-out requests the server still finishes (and bills)
        server_billed = server.counts.get("billed_completion_tokens", 0)
        answered_400 = server.counts.get("status_400", 0)
    assert_every_prompt_accounted(rows, out)
    by_id = {r["sample_id"]: r for r in out}
    status = Counter(r["status"] for r in out)
    assert status["quarantined"] == 1 and status["ok"] >= 90, status
    # the stuck ones, and any prompt that drew a random fault on every attempt: left to do, never quarantined
    assert all(r["error"].startswith("transient failures") for r in out if r["status"] == "not_generated")

    r = by_id["d:0"]
    assert r["status"] == "quarantined" and "400" in r["error"] and answered_400 >= 1, r
    # every attempt made, each logged (one may have failed before its 400 arrived: a dropped keep-alive
    # connection, a timeout on a loaded machine); the last one's 400 decided
    retries = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("retrying d:0 after")]
    assert r["attempts"] == len(retries) + 1 == cfg.max_attempts and any("400" in m for m in retries), retries
    stuck = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("retrying d:5 after")]
    # the log is complete; on a loaded machine an attempt may time out before its 502 comes (both transient)
    assert len(stuck) == cfg.max_attempts - 1 and all("502" in m or "timeout" in m for m in stuck), stuck
    for i in STUCK:
        r = by_id[f"d:{i}"]
        assert r["status"] == "not_generated" and r["attempts"] == cfg.max_attempts, r
        assert r["error"].startswith(f"transient failures, {cfg.max_attempts} attempt(s)")
    assert ("502" in by_id["d:5"]["error"] or "timeout" in by_id["d:5"]["error"]) and "error" in by_id["d:7"]["error"]
    assert "timeout" in by_id["d:8"]["error"]

    for r in out:
        if r["status"] == "ok":
            assert r["ids_from"] == "rebuilt" and r["source_kind"] == "openrouter" and r["provider"]
            # -1: usage.completion_tokens came as a string (usage-string), an unknown bill
            assert r["output_ids"] and (r["billed_completion_tokens"] > 0 or r["billed_completion_tokens"] == -1)
            assert r["t_generate_s"] > 0
            assert json.loads(r["sampling"]) == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64, "seed": 0}
            if r["content"] not in ("", None) and r["provider"] == "Alpha":
                assert r["output_ids"][-1] == profile.eot_id and profile.think_end_id in r["output_ids"]
    samples, quarantine, not_generated = split_outcomes(out)
    assert len(samples) + len(quarantine) + len(not_generated) == len(rows)
    assert set(samples[0]) == set(SAMPLE_COLUMNS)
    assert all(q["stage"] == "generate" and q["reason"] for q in quarantine)

    rep = ledger.report()
    assert rep["violations"] == [] and rep["datasets"]["d"]["reserved"] == 0
    # The budget caps what the provider bills: cut bodies and timeouts were billed by the server, and the
    # ledger counted each of them as its whole reservation.
    assert server_billed <= rep["datasets"]["d"]["spent"] <= cfg.budgets["d"]
    d = rep["datasets"]["d"]
    assert d["sent"] == d["settled"] + d["released"] > len(rows)  # retries included
    # Billing drift (Beta), corrupted text (Gamma) and 502s (Delta) get routed around; honest Alpha does not.
    assert {"Beta", "Gamma", "Delta"} <= set(rep["excluded"]) and "Alpha" not in rep["excluded"]
    assert "drift" not in rep["providers"]["Alpha"] and rep["providers"]["Beta"]["mean_abs_billing_drift"] > 8
    billed_ok = Counter()
    for s in samples:
        billed_ok[s["provider"]] += max(s["billed_completion_tokens"], 0)
    for p, n in billed_ok.items():
        assert rep["providers"][p]["completion_tokens"] >= n
    # maybe-billed failures charge reservations no provider reported: the ledger's spend is at least the providers'
    assert sum(p["completion_tokens"] for p in rep["providers"].values()) <= rep["datasets"]["d"]["spent"]
    assert abs(sum(p["cost"] for p in rep["providers"].values()) - rep["datasets"]["d"]["cost"]) < 1e-9
    assert server.counts.get("fault_cutoff", 0) and server.counts.get("client_gone", 0)
    assert_key_absent(json.dumps(out, default=str), json.dumps(rep), caplog.text)


def test_cost_per_sample_sums_to_the_providers_own_bill(profile, tmp_path):
    """#27: each sample carries the dollars the provider billed for it (usage.cost, prompt tokens included), so
    spend per dataset is the provider's bill split by dataset -- checked against the server's own bill log."""
    from pipeline.report.costs import cost_table

    rows = prompt_rows(10, dataset="shop") + prompt_rows(14, dataset="math")
    log = tmp_path / "bills.jsonl"
    cfg_server = ServerConfig(api_key_env=KEY_ENV, seed=3, bill_log=str(log), prompt_price_per_token=2e-7)
    with serve_in_thread(cfg_server, CannedBackend(2, profile)) as (url, _server):
        cfg = source_cfg(url, budgets={"shop": 10**6, "math": 10**6}, request_timeout_s=CALM_TIMEOUT_S)
        ledger = local_ledger(cfg, strict=True)
        out = run_local(OpenRouterGenerator(cfg, "deepseek", None, ledger, seed=1), rows)
    samples, _, _ = split_outcomes(out)
    assert len(samples) == len(rows)
    sent = sum(d["sent"] for d in ledger.report()["datasets"].values())
    bills = [json.loads(line) for line in log.read_text().splitlines()]
    assert sent == len(bills) == len(rows)  # no fault: one request, one billed generation per prompt
    table = cost_table(samples, {})
    assert table["total"]["billed_usd"] == pytest.approx(sum(b["cost"] for b in bills), rel=1e-9, abs=1e-12)
    by_prompt = {}
    for b in bills:
        by_prompt[b["messages_sha256"]] = b["cost"]
    for s in samples:  # and sample by sample: the provider's bill for that very conversation
        digest = hashlib.sha256(json.dumps(json.loads(s["messages"]), sort_keys=True).encode()).hexdigest()
        assert s["cost"] == pytest.approx(by_prompt[digest], rel=1e-9)
    assert table["by_dataset"]["shop"]["samples"] == 10 and table["by_dataset"]["math"]["samples"] == 14
    assert table["by_dataset"]["shop"]["usd"] > 0 and table["by_dataset"]["math"]["usd"] > 0


def test_budget_stops_requests_and_a_resumed_run_finishes(profile):
    rows = prompt_rows(30)
    with serve_in_thread(ServerConfig(api_key_env=KEY_ENV), CannedBackend(2, profile)) as (url, server):
        cfg = source_cfg(url, budgets={"d": 300}, sampling={"max_tokens": 32}, request_timeout_s=CALM_TIMEOUT_S)
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
        [sys.executable, "-m", "pipeline.demo.openrouter_server",
         "--port", "0", *args], stdout=subprocess.PIPE, stderr=log_path.open("w"), text=True,
        cwd=Path(__file__).resolve().parents[2])
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
        rows = prompt_rows(80, "big", markers={0: "400", 2: "always-502"}) + prompt_rows(40, "small")
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
    # the always-502 prompt, and on a loaded machine a few whose retries (timeouts, 5xx) ran out: left to do as
    # transient, never quarantined
    big_left = [r for r in out if r["dataset"] == "big" and r["status"] == "not_generated"]
    assert 1 <= len(big_left) <= 6 and all(r["failure_class"] == "transient" for r in big_left), big_left
    assert st[("big", "ok")] >= 70, st
    assert st[("small", "not_generated")] > 0 and st[("small", "ok")] >= 5, st
    by_id = {r["sample_id"]: r for r in out}
    assert by_id["big:0"]["status"] == "quarantined" and by_id["big:2"]["status"] == "not_generated"
    assert report["violations"] == [] and report["datasets"]["small"]["spent"] <= 10 * 64
    assert all(a["reserved"] == 0 for a in report["datasets"].values())
    assert "Beta" in report["excluded"]

    session_dir = Path(ray._private.worker._global_node.get_session_dir_path())
    logs = "".join(p.read_text(errors="replace") for p in (session_dir / "logs").rglob("*") if p.is_file())
    assert len(logs) > 1000  # the actors' logs were read
    assert_key_absent(json.dumps(out, default=str), json.dumps(report), server_log.read_text(), logs)


# -- failure classes: account errors stop the source, outages leave rows to do, paid answers are kept ------------


@pytest.mark.parametrize("marker,code", [("402", "402"), ("echo-key", "401"), ("403", "403")])
def test_account_error_halts_the_source_at_once(profile, caplog, marker, code):
    """After a 401/402/403 nothing more is sent: every later prompt is left to do with the reason, none is
    quarantined (a fixed key or topped-up account makes them work), and the key never shows."""
    rows = prompt_rows(30, markers={3: marker})
    with serve_in_thread(ServerConfig(api_key_env=KEY_ENV), CannedBackend(2, profile)) as (url, server):
        # one request at a time: the order is the rows' order
        cfg = source_cfg(url, max_in_flight=1, request_timeout_s=CALM_TIMEOUT_S)
        ledger = local_ledger(cfg)
        out = run_local(OpenRouterGenerator(cfg, "deepseek", None, ledger), rows)
    assert_every_prompt_accounted(rows, out)
    status = Counter(r["status"] for r in out)
    assert status == {"ok": 3, "not_generated": 27}, status
    assert server.counts["requests"] == 4  # the three before it and the one that failed
    assert all("halted: " in r["error"] and code in r["error"] for r in out if r["status"] != "ok")
    assert ledger.report()["halted"] and code in ledger.report()["halted"]
    assert ledger.report()["datasets"]["d"]["reserved"] == 0
    assert_key_absent(json.dumps(out, default=str), json.dumps(ledger.report()), caplog.text)


def test_out_of_credits_mid_run_stops_every_actor(profile, ray_session):
    """The account runs dry mid-run (402 on every request from then on): two actors share the ledger, so
    both stop; at most the requests already in flight see the 402."""
    ray = ray_session
    rows = prompt_rows(60)
    with serve_in_thread(ServerConfig(credits_tokens=300, seed=3), CannedBackend(2, profile)) as (url, server):
        cfg = source_cfg(url, num_actors=2, num_cpus=0.25, batch_size=10, max_in_flight=3, api_key_required=False,
                         max_concurrent_batches=1)
        ledger = ledger_for(cfg)
        out = [dict(r) for r in map_openrouter(ray.data.from_items(rows), cfg, "deepseek", None, ledger).take_all()]
        report = ray.get(ledger.report.remote())
    assert_every_prompt_accounted(rows, out)
    status = Counter(r["status"] for r in out)
    assert status["quarantined"] == 0 and status["ok"] > 0 and status["not_generated"] > 20, status
    assert "out of credits (402)" in report["halted"]
    assert server.counts.get("status_402", 0) <= 2 * 3  # only what was in flight when the first 402 came


def test_outage_from_the_start_leaves_every_row_to_do_and_opens_the_circuit(profile):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rows = prompt_rows(40)
    cfg = source_cfg(f"http://127.0.0.1:{port}/api/v1", max_in_flight=4, api_key_required=False,
                     circuit_failures=6, circuit_cooldown_s=0.05, circuit_max_cooldown_s=0.1, circuit_give_up_s=0.6)
    ledger = local_ledger(cfg)
    gen = OpenRouterGenerator(cfg, "deepseek", None, ledger)
    t0 = time.time()
    out = run_local(gen, rows)
    assert time.time() - t0 < 30
    assert_every_prompt_accounted(rows, out)
    assert {r["status"] for r in out} == {"not_generated"}
    assert any("API unreachable" in r["error"] for r in out)  # the circuit gave up on the waiting rows
    # Connection refused never reached a server: nothing spent, nothing held.
    d = ledger.report()["datasets"]["d"]
    assert d["spent"] == 0 and d["reserved"] == 0
    # The circuit stopped the hammering: far fewer requests than rows x attempts.
    assert gen.engine.stats["requests"] < len(rows) * cfg.max_attempts / 2


def test_cut_bodies_under_a_tight_budget_never_overbill(profile):
    """30% of answers cut mid-body (the server bills them): the provider's own bill stays under the budget."""
    rows = prompt_rows(60)
    with serve_in_thread(ServerConfig(rates={"cutoff": 0.3}, seed=5), CannedBackend(2, profile)) as (url, server):
        cfg = source_cfg(url, budgets={"d": 1000}, api_key_required=False, max_in_flight=8)
        ledger = local_ledger(cfg, strict=True)
        out = run_local(OpenRouterGenerator(cfg, "deepseek", None, ledger), rows)
        billed = server.counts.get("billed_completion_tokens", 0)
    assert_every_prompt_accounted(rows, out)
    assert server.counts.get("fault_cutoff", 0) > 0
    assert billed <= ledger.report()["datasets"]["d"]["spent"] <= 1000


def test_journaled_responses_are_replayed_not_paid_again(profile, tmp_path):
    """Every paid answer is journaled as it arrives; a new attempt handed the journal rebuilds those samples
    without a request (same ids as the first time), and asks only for the rest."""
    from pipeline.generate.sources.http.journal import load_responses
    from pipeline.generate.sources.http.totals import billed_by_dataset

    rows = prompt_rows(12)
    with serve_in_thread(ServerConfig(seed=2), CannedBackend(2, profile)) as (url, server):
        cfg = source_cfg(url, api_key_required=False, request_timeout_s=CALM_TIMEOUT_S)
        first = run_local(OpenRouterGenerator(cfg, "deepseek", None, local_ledger(cfg), layout=RunLayout(tmp_path)),
                          rows)
        assert server.counts["requests"] == 12
        journaled = load_responses(RunLayout(tmp_path).responses, cfg.name)
        assert set(journaled) == {r["sample_id"] for r in rows}
        assert billed_by_dataset(RunLayout(tmp_path).responses, cfg.name) == {
            "d": sum(r["billed_completion_tokens"] for r in first)}
        # the "killed" attempt wrote none of them: hand 8 of them to the next attempt
        replay = {sid: rec.to_json().decode() for sid, rec in journaled.items() if int(sid.split(":")[1]) < 8}
        again = run_local(OpenRouterGenerator(cfg, "deepseek", None, local_ledger(cfg), replay=replay), rows)
        assert server.counts["requests"] == 12 + 4
    by_id = {r["sample_id"]: r for r in first}
    for r in again[:8]:
        assert r["status"] == "ok" and r["output_ids"] == by_id[r["sample_id"]]["output_ids"]
        assert r["generation_id"] == by_id[r["sample_id"]]["generation_id"]



def test_the_http_session_is_closed_when_the_actor_goes_idle(profile, caplog):
    """A Ray Data actor gets no shutdown call: the stage closes its session once no batch has been in flight for
    ``idle_close_s``, so a run never ends with aiohttp's "Unclosed client session"; a batch within that gap
    reuses the session and its connections (closing at every gap reopened all of them)."""
    import gc

    caplog.set_level(logging.ERROR, logger="asyncio")
    rows = prompt_rows(6)
    with serve_in_thread(ServerConfig(seed=4), CannedBackend(2, profile)) as (url, _server):
        gen = OpenRouterGenerator(source_cfg(url, api_key_required=False), "deepseek", None,
                                  local_ledger(source_cfg(url)))
        gen.idle_close_s = 0.5

        async def go(gen: OpenRouterGenerator) -> list[dict]:
            out = (await gen(rows[:3])).to_pylist()  # no explicit close, as in a Ray Data actor
            session = gen.engine._session
            assert session is not None and not session.closed
            out += (await gen(rows[3:])).to_pylist()  # within the gap: the same session
            assert gen.engine._session is session
            await asyncio.sleep(1.0)
            assert gen.engine._session is None and session.closed
            return out

        out = asyncio.run(go(gen))
    del gen
    gc.collect()
    assert len(out) == 6 and {r["status"] for r in out} == {"ok"}
    assert "Unclosed client session" not in caplog.text


def test_a_prompt_that_keeps_failing_is_quarantined_after_transient_runs_runs(profile, tmp_path):
    """Out of retries on transient failures while the API answers other prompts: left to do, with a give-up
    journaled; after ``transient_runs`` such runs the driver quarantines the prompt at read time. Prompts
    that failed because the whole API was down journal nothing (an outage says nothing about them)."""
    import socket

    from pipeline.run.config import RunConfig
    from pipeline.run.job import worn_out

    rows = prompt_rows(8, markers={2: "always-502"})
    with serve_in_thread(ServerConfig(seed=6), CannedBackend(2, profile)) as (url, _server):
        cfg = source_cfg(url, api_key_required=False, max_attempts=2, transient_runs=2, budgets={"d": "unlimited"})
        for attempt in range(2):
            gen = OpenRouterGenerator(cfg, "deepseek", None, local_ledger(cfg), layout=RunLayout(tmp_path))
            # the API answers other prompts in this run (new ones: those answered before were written, so
            # skipped), then d:2 fails on every attempt
            others = run_local(gen, prompt_rows(7, f"other{attempt}"))
            assert {r["status"] for r in others} == {"ok"}
            out = {r["sample_id"]: r for r in run_local(gen, [rows[2]])}
            assert out["d:2"]["status"] == "not_generated" and out["d:2"]["failure_class"] == "transient"
    run_cfg = RunConfig(output_dir=str(tmp_path), model={"profile": "deepseek"},
                        datasets=[{"name": "d", "path": "d.jsonl"}], sources=[cfg])
    assert set(worn_out(run_cfg, RunLayout(tmp_path))) == {"d:2"}
    assert "transient failures in 2 runs" in worn_out(run_cfg, RunLayout(tmp_path))["d:2"]["reason"]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = source_cfg(f"http://127.0.0.1:{port}/api/v1", api_key_required=False, max_attempts=2, transient_runs=1,
                      budgets={"e": "unlimited"})
    for _ in range(2):
        run_local(OpenRouterGenerator(down, "deepseek", None, local_ledger(down), layout=RunLayout(tmp_path / "x")),
                  prompt_rows(4, "e"))
    down_cfg = run_cfg.model_copy(update={"sources": [down], "datasets": [run_cfg.datasets[0].model_copy(
        update={"name": "e"})]})
    assert worn_out(down_cfg, RunLayout(tmp_path / "x")) == {}
