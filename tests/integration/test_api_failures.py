"""The fault matrix, through `python -m pipeline run` as a user runs it, against the local OpenRouter-compatible
server (a separate process that can die, run dry or misbehave): after every scenario each input row is exactly
once across samples + quarantine + not generated, the provider's own bill stays under the budget, `status` says
what the files say, and the exit code tells whether a re-run has work to do."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.generate.ledger import read_journal
from pipeline.generate.sources.http.journal import PROJECTION_META, projection_path

pytestmark = pytest.mark.slow

ROWS = 16
MAX_TOKENS = 24
KEY = "sk-or-v1-faultmatrix-9d8c7b6a5f4e3d2c"
# Set at import, before any fixture starts the session's Ray head: the source actors inherit its environment.
os.environ["FAULT_MATRIX_KEY"] = KEY


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m pipeline serve-openrouter` on a fixed port, so it can be stopped and started again there."""

    def __init__(self, tmp: Path, port: int, *args: str, env: dict[str, str] | None = None) -> None:
        self.log = tmp / f"server-{port}-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "serve-openrouter", "--host", "127.0.0.1", "--port", str(port),
             "--no-model", "--providers", "solo", *args],
            stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True, env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()
        assert line.startswith("READY "), self.log.read_text()[-2000:]
        self.url = line.split()[1]

    def counts(self) -> dict[str, int]:
        with urllib.request.urlopen(self.url.removesuffix("/api/v1") + "/api/v1/stats") as resp:
            return json.load(resp)["counts"]

    def stop(self) -> dict[str, int]:
        """Stop it (SIGTERM) and return its final counts, billed tokens of requests still in flight included."""
        self.proc.terminate()
        self.proc.wait(30)
        for line in self.log.read_text().splitlines()[::-1]:
            if "stopping; counts " in line:
                return json.loads(line.split("stopping; counts ", 1)[1])
        raise AssertionError("no final counts in the server log")


@pytest.fixture
def env(ray_head) -> dict[str, str]:
    return {**ray_head.env, "RAY_ADDRESS": ray_head.address, "FAULT_MATRIX_KEY": KEY}


def write_config(tmp: Path, repo_root: Path, tiny_target: Path, port: int, budget: int | None = None,
                 **source) -> Path:
    cfg = {
        "output_dir": str(tmp / "out"),
        "model": {"profile": "deepseek", "path": str(tiny_target)},
        "sampling": {"max_tokens": MAX_TOKENS, "temperature": 1.0},
        "datasets": [{"name": "chat", "path": str(repo_root / "data/prompts/chat.jsonl"), "max_rows": ROWS,
                      "thinking": False}],
        "sources": [{"kind": "openrouter", "name": "api", "base_url": f"http://127.0.0.1:{port}/api/v1",
                     "model": "tiny", "api_key_env": "FAULT_MATRIX_KEY", "num_actors": 1, "batch_size": 4,
                     "max_concurrent_batches": 1, "max_in_flight": 4, "max_attempts": 3, "backoff_base_s": 0.05,
                     "backoff_max_s": 0.2, "max_retry_after_s": 0.2, "request_timeout_s": 2.0,
                     "circuit_failures": 6, "circuit_cooldown_s": 0.2, "circuit_give_up_s": 2.0,
                     "budgets": {"chat": "unlimited" if budget is None else budget}, **source}],
        "training": None,
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(cfg: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "run", str(cfg)], env=env, capture_output=True,
                          text=True, timeout=timeout)


def rows(folder: Path) -> list[dict]:
    return [r for f in sorted(folder.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def status(cfg: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "pipeline", "status", str(cfg), "--json"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def check_accounting(cfg: Path, *, expect_to_do: int | None = None, finished: bool = True) -> dict:
    """Every row exactly once across samples + quarantine + to do, and `status` equal to the files (and, after
    a run that finished, to its report)."""
    out = cfg.parent / "out"
    samples, quarantine = rows(out / "samples"), rows(out / "quarantine")
    ids = Counter(r["sample_id"] for r in samples + quarantine)
    assert all(n == 1 for n in ids.values()), "a sample landed twice"
    st = status(cfg)
    assert st["totals"]["rows"] == ROWS
    assert (st["totals"]["passed"], st["totals"]["quarantined"]) == (len(samples), len(quarantine))
    assert st["totals"]["to_do"] == ROWS - len(ids)
    if expect_to_do is not None:
        assert st["totals"]["to_do"] == expect_to_do
    if finished:
        report = json.loads((out / "report.json").read_text())
        assert report["not_generated"] == st["totals"]["to_do"]
    return st


def test_outage_from_the_start_leaves_everything_to_do_then_resumes(tmp_path, repo_root, tiny_target, env):
    port = free_port()
    cfg = write_config(tmp_path, repo_root, tiny_target, port)
    down = run(cfg, env)
    assert down.returncode == 3, down.stdout[-3000:] + down.stderr[-3000:]
    assert "source api: API failing" in down.stdout and "resume with: python -m pipeline run" in down.stdout
    st = check_accounting(cfg, expect_to_do=ROWS)
    assert st["totals"]["quarantined"] == 0  # an outage is never a reason to drop a prompt

    server = Server(tmp_path, port, "--api-key-env", "FAULT_MATRIX_KEY", env=env)
    try:
        up = run(cfg, env)
        counts = server.counts()
    finally:
        server.stop()
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    # the run left each journal's projection up to date: the next status and resume parse no line of it
    journals = [f for f in sorted((tmp_path / "out" / "responses").glob("*.jsonl")) if f.stat().st_size]
    stored = [json.loads(pq.read_schema(projection_path(f)).metadata[PROJECTION_META]) for f in journals]
    assert journals and [m["offset"] for m in stored] == [f.stat().st_size for f in journals]
    check_accounting(cfg, expect_to_do=0)
    assert counts["requests"] == ROWS  # every prompt asked once, now that the API is back


def test_server_death_mid_run_then_resume(tmp_path, repo_root, tiny_target, env):
    port = free_port()
    budget = ROWS * MAX_TOKENS
    cfg = write_config(tmp_path, repo_root, tiny_target, port, budget=budget)
    server = Server(tmp_path, port, "--delay-ms", "400", "--api-key-env", "FAULT_MATRIX_KEY", env=env)
    driver = start_run(cfg, env)
    deadline = time.time() + 300
    # Stop the API once some answers came back, with most prompts still to ask (samples are written when the
    # run ends, so the server's own count is the signal).
    while time.time() < deadline and server.counts().get("served", 0) < 5:
        assert driver.poll() is None, driver.stdout.read()[-3000:]
        time.sleep(0.05)
    billed = server.stop()["billed_completion_tokens"]  # the API dies with requests in flight
    text, _ = driver.communicate(timeout=600)
    assert driver.returncode == 3, text[-3000:]
    first = check_accounting(cfg)
    assert 0 < first["totals"]["to_do"] < ROWS and first["totals"]["quarantined"] == 0

    server = Server(tmp_path, port, "--api-key-env", "FAULT_MATRIX_KEY", env=env)
    try:
        again = run(cfg, env)
    finally:
        billed += server.stop()["billed_completion_tokens"]
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    check_accounting(cfg, expect_to_do=0)
    assert billed <= budget


@pytest.mark.parametrize("scenario", ["credits", "bad-key"])
def test_account_failure_stops_spending_and_says_so(tmp_path, repo_root, tiny_target, env, scenario):
    port = free_port()
    cfg = write_config(tmp_path, repo_root, tiny_target, port)
    server_env = {**env, "SERVER_KEY": KEY if scenario == "credits" else "sk-or-v1-another-key-0000"}
    args = ["--credits", "60"] if scenario == "credits" else []
    server = Server(tmp_path, port, "--api-key-env", "SERVER_KEY", *args, env=server_env)
    try:
        res = run(cfg, env)
    finally:
        counts = server.stop()
    assert res.returncode == 3, res.stdout[-3000:] + res.stderr[-3000:]
    code = "402" if scenario == "credits" else "401"
    why = "out of credits (402)" if scenario == "credits" else "the API key was refused (401)"
    top = [ln for ln in res.stdout.splitlines() if ln.strip().startswith("! source api: stopped:")]
    assert len(top) == 1 and why in top[0] and "prompts left to do" in top[0], res.stdout[-3000:]
    st = check_accounting(cfg)
    assert st["totals"]["quarantined"] == 0 and st["totals"]["to_do"] > 0
    assert counts.get(f"status_{code}", 0) <= 4  # only requests already in flight saw it; then nothing was sent
    for text in (res.stdout, res.stderr, *(p.read_text(errors="replace") for p in (tmp_path / "out").rglob("*.json*"))):
        assert KEY not in text


def test_high_fault_rates_tight_budget_and_kills_at_random_points(tmp_path, repo_root, tiny_target, env):
    """Every fault kind at once (~50% of requests fail), a budget below what the rows need, and the driver
    SIGKILLed twice at seeded random moments: nothing lost, nothing twice, the provider's bill under the cap."""
    port = free_port()
    budget = 10 * MAX_TOKENS
    cfg = write_config(tmp_path, repo_root, tiny_target, port, budget=budget)
    faults = [f"--fault-{k}=0.05" for k in ("429", "502", "503", "timeout", "200-error", "empty-choices",
                                            "native-error", "empty-content", "null-content", "cutoff")]
    server = Server(tmp_path, port, "--delay-ms", "150", "--padding", "4", "--timeout-s", "3", "--retry-after",
                    "0.05", "--api-key-env", "FAULT_MATRIX_KEY", *faults, env=env)
    rng = random.Random(11)
    try:
        for _ in range(2):
            driver = subprocess.Popen([sys.executable, "-m", "pipeline", "run", str(cfg)], env=env,
                                      start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            t0 = time.time()  # wait for the first request, then a random moment of the generation
            while server.counts().get("requests", 0) == 0 and time.time() - t0 < 300:
                time.sleep(0.2)
            time.sleep(rng.uniform(0.5, 4.0))
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
            check_accounting(cfg, finished=False)
        final = run(cfg, env)
        time.sleep(3.5)  # requests the kills left in flight finish on the server (and are billed)
    finally:
        billed = server.stop()["billed_completion_tokens"]
    assert final.returncode in (0, 3), final.stdout[-3000:] + final.stderr[-3000:]
    check_accounting(cfg)
    assert billed <= budget, (billed, budget)
    journal = read_journal(str(tmp_path / "out" / "ledger-api.json"))
    assert journal["chat"] <= budget


def test_two_drivers_on_one_folder(tmp_path, repo_root, tiny_target, env):
    port = free_port()
    cfg = write_config(tmp_path, repo_root, tiny_target, port)
    server = Server(tmp_path, port, "--delay-ms", "100", "--api-key-env", "FAULT_MATRIX_KEY", env=env)
    try:
        cmd = [sys.executable, "-m", "pipeline", "run", str(cfg)]
        a = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        b = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        (a_out, a_err), (b_out, b_err) = a.communicate(timeout=600), b.communicate(timeout=600)
        counts = server.counts()
    finally:
        server.stop()
    codes = sorted([a.returncode, b.returncode])
    assert codes == [0, 2], (a_out[-2000:], a_err[-2000:], b_out[-2000:], b_err[-2000:])
    refused = a_err if a.returncode == 2 else b_err
    assert "is in use by another run" in refused and "pid" in refused
    check_accounting(cfg, expect_to_do=0)
    assert counts["requests"] == ROWS  # the refused driver sent nothing


# --------------------------------------------------------------------------- the second layer of faults

FLIGHT = "OpenRouterFlight"  # the HTTP source's Ray Data actor class (in "MapWorker(MapBatches(...))")


def http_actor_pids(dashboard: str) -> list[int]:
    """Pids of the HTTP source actors alive on the session's cluster (its own head, by address)."""
    from ray.util.state import list_actors

    return [a.pid for a in list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], detail=True,
                                       limit=10_000, raise_on_missing_output=False)
            if FLIGHT in (a.class_name or "") and a.pid]


_DRIVERS: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_driver_outlives_its_test():
    """A test that fails while its run is still going kills that run: a leaked driver would keep its job on the
    shared head and slow or starve every later test."""
    yield
    while _DRIVERS:
        proc = _DRIVERS.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


def start_run(cfg: Path, env: dict[str, str]) -> subprocess.Popen:
    """`python -m pipeline run` in the background (the test acts on the API or the cluster meanwhile)."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "run", str(cfg)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _DRIVERS.append(proc)
    return proc


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, proc: subprocess.Popen | None = None,
             poll: float = 0.3) -> Any:
    """Poll until ``predicate()`` is truthy (and return it); fail early when the driver ``proc`` exits."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited {proc.returncode} while waiting for {what}: "
                                 f"{proc.stdout.read()[-3000:] if proc.stdout else ''}")
        time.sleep(poll)
    raise TimeoutError(f"no {what} within {timeout}s")


def bills(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


def journaled_generation_ids(out: Path) -> set[str]:
    """Generation ids of every response our journals hold: answers this folder received (and paid for)."""
    ids = set()
    for f in (out / "responses").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("generation_id"):
                ids.add(rec["generation_id"])
    return ids


def paid_twice(log: Path, out: Path) -> tuple[int, int]:
    """(prompts the provider billed twice for answers we had received, prompts billed again after an answer we
    never received: a request in flight when its process was killed)."""
    received = journaled_generation_ids(out)
    by_prompt: dict[str, list[str]] = {}
    for b in bills(log):
        by_prompt.setdefault(b["messages_sha256"], []).append(b["id"])
    twice = sum(sum(i in received for i in ids) > 1 for ids in by_prompt.values())
    again = sum(len(ids) > 1 for ids in by_prompt.values()) - twice
    return twice, again


def test_a_config_error_halts_the_source_then_the_fixed_config_passes(tmp_path, repo_root, tiny_target, env):
    port = free_port()
    server = Server(tmp_path, port, "--known-models", "tiny", "--api-key-env", "FAULT_MATRIX_KEY", env=env)
    try:
        cfg = write_config(tmp_path, repo_root, tiny_target, port, model="tiny-typo")
        bad = run(cfg, env)
        asked = server.counts().get("requests", 0)
        assert bad.returncode == 3, bad.stdout[-3000:] + bad.stderr[-3000:]
        top = [ln for ln in bad.stdout.splitlines() if ln.strip().startswith("! source api: stopped: config error")]
        assert len(top) == 1 and "No endpoints found" in top[0] and "config" in top[0], bad.stdout[-3000:]
        st = check_accounting(cfg, expect_to_do=ROWS)
        assert st["totals"]["quarantined"] == 0  # nothing is quarantined for a config error
        assert asked < ROWS  # it stopped at once
        fixed = write_config(tmp_path, repo_root, tiny_target, port, model="tiny")
        good = run(fixed, env)
    finally:
        server.stop()
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    st = check_accounting(fixed, expect_to_do=0)
    assert st["totals"]["passed"] == ROWS


def test_sigkill_of_the_http_actor_under_a_binding_budget_ends_by_itself(tmp_path, repo_root, tiny_target, env,
                                                                        ray_head):
    """The HTTP actor is SIGKILLed with requests in flight and a budget below what the rows need. Its
    reservations lapse with its lease (in doubt: counted as spent), so nobody waits on them forever: the run ends
    by itself, each row once, and the provider's own bill stays under the cap and under what the ledger
    committed."""
    port = free_port()
    budget = 8 * MAX_TOKENS
    cfg = write_config(tmp_path, repo_root, tiny_target, port, budget=budget, lease_s=3.0, budget_wait_max_s=60.0,
                       request_timeout_s=10.0)
    server = Server(tmp_path, port, "--delay-ms", "500", "--api-key-env", "FAULT_MATRIX_KEY", env=env)
    try:
        driver = start_run(cfg, env)
        wait_for(lambda: server.counts().get("served", 0) >= 2, 300, "2 served requests", driver)
        pids = wait_for(lambda: http_actor_pids(ray_head.dashboard), 60, "the HTTP actor", driver)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)  # an OOM kill: no clean-up, its reservations never settled
        text, _ = driver.communicate(timeout=300)  # before leases: waits forever on the dead actor's reservations
        time.sleep(1.0)  # requests the kill left in flight finish on the server (and are billed)
    finally:
        billed = server.stop()["billed_completion_tokens"]
    assert driver.returncode in (0, 3), text[-4000:]
    check_accounting(cfg)
    committed = read_journal(str(tmp_path / "out" / "ledger-api.json"))["chat"]
    assert billed <= budget and billed <= committed <= budget, (billed, committed, budget)


def test_kills_of_driver_and_actor_at_random_points_never_pay_twice(tmp_path, repo_root, tiny_target, env,
                                                                     ray_head):
    """The HTTP actor and the driver SIGKILLed at seeded random moments, then a resume: every row exactly once,
    and by the provider's own bill log no prompt was billed twice for an answer this folder had received (a
    restarted actor reads every journal of the folder, its dead predecessor's included, before it sends)."""
    port = free_port()
    log = tmp_path / "bills.jsonl"
    cfg = write_config(tmp_path, repo_root, tiny_target, port, lease_s=3.0)
    server = Server(tmp_path, port, "--delay-ms", "1500", "--bill-log", str(log), "--api-key-env",
                    "FAULT_MATRIX_KEY", env=env)
    rng = random.Random(23)
    try:
        for attempt in range(2):
            driver = subprocess.Popen([sys.executable, "-m", "pipeline", "run", str(cfg)], env=env,
                                      start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            start = server.counts().get("requests", 0)

            def asked(start: int = start, driver: subprocess.Popen = driver) -> bool:
                return server.counts().get("requests", 0) > start or driver.poll() is not None

            def restarted(driver: subprocess.Popen = driver) -> bool:
                return bool(http_actor_pids(ray_head.dashboard)) or driver.poll() is not None

            wait_for(asked, 300, "a request")
            if attempt == 0:  # the actor first (Ray restarts it and re-runs its batch), then the driver
                time.sleep(rng.uniform(0.3, 1.5))
                for pid in http_actor_pids(ray_head.dashboard):
                    os.kill(pid, signal.SIGKILL)
                wait_for(restarted, 120, "the restarted HTTP actor")  # (or the run finished first)
            time.sleep(rng.uniform(0.5, 2.0))
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
            check_accounting(cfg, finished=False)
        final = run(cfg, env)
        time.sleep(1.0)
    finally:
        server.stop()
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    check_accounting(cfg, expect_to_do=0)
    twice, again = paid_twice(log, tmp_path / "out")
    print(f"prompts billed twice for a received answer: {twice}; billed again after an answer lost in flight at a "
          f"kill: {again}")
    assert twice == 0


def test_a_pool_no_node_can_hold_exits_3_at_once_naming_the_resource(tmp_path, repo_root, tiny_target, env):
    port = free_port()
    cfg = write_config(tmp_path, repo_root, tiny_target, port, resources={"api_node_nowhere": 1})
    raw = yaml.safe_load(cfg.read_text())
    raw["ray"] = {"placement_timeout_s": 3}
    cfg.write_text(yaml.safe_dump(raw))
    t0 = time.time()
    res = run(cfg, env, timeout=300)
    took = time.time() - t0
    assert res.returncode == 3, res.stdout[-3000:] + res.stderr[-3000:]
    assert "no node has api_node_nowhere 1" in res.stdout and f"{ROWS} prompts left to do" in res.stdout
    assert took < 60, took  # not Ray Data's half-hour no-progress wait
    st = status(cfg)
    assert st["totals"]["to_do"] == ROWS


def test_a_dollar_budget_binds_on_prompt_and_completion_cost(tmp_path, repo_root, tiny_target, env):
    """usage.cost covers prompt and completion tokens; the dollar cap binds before the token cap would, and the
    provider's own bill in dollars stays under it."""
    port = free_port()
    cap = 0.1  # a prompt costs ~$0.01 at this price (its words): some rows fit, not all 16
    cfg = write_config(tmp_path, repo_root, tiny_target, port, budgets_usd={"chat": cap},
                       prices={"prompt_usd_per_mtok": 500.0, "completion_usd_per_mtok": 100.0})
    server = Server(tmp_path, port, "--prompt-price", "0.0005", "--api-key-env", "FAULT_MATRIX_KEY", env=env)
    try:
        res = run(cfg, env)
        time.sleep(0.5)
    finally:
        counts = server.stop()
    billed_usd = counts.get("billed_cost_nano_usd", 0) / 1e9
    assert res.returncode == 3, res.stdout[-3000:] + res.stderr[-3000:]  # the cap binds: rows left to do
    st = check_accounting(cfg)
    assert 0 < st["totals"]["passed"] < ROWS and st["totals"]["quarantined"] == 0
    assert 0 < billed_usd <= cap, (billed_usd, cap)


def test_a_frozen_driver_loses_its_lock_stops_spending_and_the_new_holder_finishes(tmp_path, repo_root, tiny_target,
                                                                                  env):
    """Driver A is frozen (SIGSTOP: a GC pause, a suspended VM) past its lock's staleness while its actors go
    on; driver B takes the folder over and runs. A's ledger sees the takeover within a second and grants nothing
    more; A, let go (SIGCONT), writes nothing and exits 2 naming B. Every row once, the provider's bill under
    the cap."""
    port = free_port()
    budget = 10 * MAX_TOKENS
    cfg = write_config(tmp_path, repo_root, tiny_target, port, budget=budget)
    lock_env = {**env, "PIPELINE_LOCK_HEARTBEAT_S": "0.5", "PIPELINE_LOCK_STALE_S": "3"}
    server = Server(tmp_path, port, "--delay-ms", "300", "--api-key-env", "FAULT_MATRIX_KEY", env=env)
    try:
        a = subprocess.Popen([sys.executable, "-m", "pipeline", "run", str(cfg)], env=lock_env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_for(lambda: server.counts().get("served", 0) >= 2, 300, "2 served requests", a)
        os.kill(a.pid, signal.SIGSTOP)
        try:
            time.sleep(4.0)  # past the staleness: A's heartbeat is frozen with it
            b = run(cfg, lock_env)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        a_text, _ = a.communicate(timeout=300)
        time.sleep(1.0)
    finally:
        billed = server.stop()["billed_completion_tokens"]
    assert b.returncode in (0, 3), b.stdout[-3000:] + b.stderr[-3000:]
    assert a.returncode == 2, a_text[-3000:]
    # it names who holds the folder now (or that nobody does: B may have finished and released it first)
    assert "lock run.lock was lost" in a_text and ("now held by" in a_text or "no run holds it now" in a_text), \
        a_text[-3000:]
    check_accounting(cfg)  # B's report and the files agree; no id twice
    committed = read_journal(str(tmp_path / "out" / "ledger-api.json"))["chat"]
    assert billed <= budget and committed <= budget, (billed, committed, budget)
