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
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

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
                     **({"budgets": {"chat": budget}} if budget is not None else {}), **source}],
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
    check_accounting(cfg, expect_to_do=0)
    assert counts["requests"] == ROWS  # every prompt asked once, now that the API is back


def test_server_death_mid_run_then_resume(tmp_path, repo_root, tiny_target, env):
    port = free_port()
    budget = ROWS * MAX_TOKENS
    cfg = write_config(tmp_path, repo_root, tiny_target, port, budget=budget)
    server = Server(tmp_path, port, "--delay-ms", "400", "--api-key-env", "FAULT_MATRIX_KEY", env=env)
    driver = subprocess.Popen([sys.executable, "-m", "pipeline", "run", str(cfg)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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
    journal = json.loads((tmp_path / "out" / "ledger-api.json").read_text())
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
