"""HTTP source throughput: our client vs a bare aiohttp loop vs the openai SDK, same server, same run.

The no-model server (a separate process) answers after ``--delay-ms``. Each
client runs in its own process (so CPU time and peak memory are its own) with
``--concurrency`` requests in flight, and the clients take turns for
``--rounds`` rounds so background load hits them alike. Reported per client:
sustained requests/s, client CPU per request (user+sys), peak RSS. One-time set-up (imports, the
tokenizer and the copy of it that it builds lazily, pyarrow's first use) stays out of the timed window.

    python bench/bench_openrouter.py --requests 10000 --concurrency 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KEY_ENV = "BENCH_OPENROUTER_KEY"
MODEL = "tiny/deepseek-tiny"
CLIENTS = ("aiohttp", "openai", "ours")


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Benchmark question number {i}: what is {i} plus {i}?"}]


def _body(i: int, max_tokens: int) -> dict:
    # The same request our client sends: explicit sampling, reasoning on.
    return {"model": MODEL, "messages": _messages(i), "temperature": 1.0, "top_p": 1.0, "max_tokens": max_tokens,
            "seed": 0, "stream": False, "reasoning": {"enabled": True}}


def _usage() -> tuple[float, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_maxrss  # seconds, KiB


async def _bare_aiohttp(url: str, n: int, conc: int, max_tokens: int, key: str) -> int:
    """The floor: post the same bodies, parse the JSON, nothing else."""
    import aiohttp

    ok = 0
    sem = asyncio.Semaphore(conc)
    conn = aiohttp.TCPConnector(limit=conc, limit_per_host=0)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=conn, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def one(i: int) -> None:
            nonlocal ok
            async with sem, s.post(url + "/chat/completions", json=_body(i, max_tokens)) as r:
                data = json.loads(await r.read())
                ok += r.status == 200 and bool(data["choices"])

        await asyncio.gather(*(one(i) for i in range(n)))
    return ok


async def _openai_sdk(url: str, n: int, conc: int, max_tokens: int, key: str) -> int:
    import httpx
    from openai import AsyncOpenAI

    ok = 0
    sem = asyncio.Semaphore(conc)
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=conc, max_keepalive_connections=conc),
                             timeout=600)
    client = AsyncOpenAI(api_key=key, base_url=url, http_client=http, max_retries=3)

    async def one(i: int) -> None:
        nonlocal ok
        async with sem:
            r = await client.chat.completions.create(
                model=MODEL, messages=_messages(i), temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=0,
                extra_body={"reasoning": {"enabled": True}})
            ok += bool(r.choices)

    await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()
    return ok


async def _ours(url: str, n: int, conc: int, max_tokens: int, key: str) -> int:
    """The Ray Data callable itself, in process: retries, ledger, id rebuild, checks, Arrow output batch, and the
    response journal (every paid answer appended to a run folder's ``responses/``, as in a run)."""
    import tempfile

    from pipeline.base.layout import RunLayout
    from pipeline.generate.sources.http.config import OpenRouterSourceConfig
    from pipeline.generate.sources.http.openrouter import OpenRouterGenerator
    from tests.helpers.http import local_ledger

    cfg = OpenRouterSourceConfig(model=MODEL, base_url=url, api_key_env=KEY_ENV, max_in_flight=conc,
                                 request_timeout_s=600, sampling={"max_tokens": max_tokens},
                                 budgets={"bench": 10**12})
    out_dir = tempfile.mkdtemp(prefix="bench-openrouter-")
    gen = OpenRouterGenerator(cfg, "deepseek", None, local_ledger(cfg, strict=True), layout=RunLayout(out_dir))
    rows = [{"sample_id": f"bench:{i}", "dataset": "bench", "row_index": i, "messages": json.dumps(_messages(i)),
             "tools": "", "thinking": True, "prompt_ids": [0, 1, 2], "prompt_assistant_mask": [0, 0, 0]}
            for i in range(n)]
    table = await gen(rows)
    await gen.close()
    return sum(s == "ok" for s in table.column("status").to_pylist())


def _preload(kind: str) -> None:
    """Imports and one-time set-up (what an actor does in __init__) stay out of the timed window."""
    import aiohttp  # noqa: F401

    if kind == "openai":
        import httpx  # noqa: F401
        import openai  # noqa: F401
    if kind == "ours":
        import pyarrow as pa

        from pipeline.checks.reconstruct import rebuild_ids
        from pipeline.generate.sources.http.openrouter import OUTPUT_SCHEMA
        from pipeline.profiles import load_profile
        from pipeline.profiles.base import Completion

        profile = load_profile("deepseek")  # cached: the generator gets this same profile and tokenizer
        # The tokenizer's lazily built copy without added tokens (text segments are encoded with it; ~0.5 s CPU
        # to build) is tokenizer load too: left in, it would charge ~0.08 ms to each of 6,000 requests.
        rebuild_ids(profile, Completion("warm", "up", None, "stop", None), True)
        pa.Table.from_pylist([], schema=OUTPUT_SCHEMA)  # pyarrow's lazy first-use set-up


def run_client(kind: str, url: str, n: int, conc: int, max_tokens: int) -> dict:
    """Runs inside a child process; prints one JSON line."""
    key = os.environ[KEY_ENV]
    fn = {"aiohttp": _bare_aiohttp, "openai": _openai_sdk, "ours": _ours}[kind]
    _preload(kind)
    cpu0, _ = _usage()
    rss0 = _rss_kib()
    t0 = time.perf_counter()
    ok = asyncio.run(fn(url, n, conc, max_tokens, key))
    wall = time.perf_counter() - t0
    cpu1, maxrss = _usage()
    return {"client": kind, "requests": n, "ok": ok, "wall_s": wall, "rps": n / wall,
            "cpu_ms_per_req": 1000 * (cpu1 - cpu0) / n, "peak_rss_mb": maxrss / 1024,
            "rss_growth_mb": (maxrss - rss0) / 1024}


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def start_server(delay_ms: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.demo.openrouter_server",
         "--port", "0", "--no-model", "--delay-ms", str(delay_ms), "--api-key-env", KEY_ENV],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY "):
            return proc, line.split()[1]
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("server did not start")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=2000)
    p.add_argument("--delay-ms", type=float, default=50.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--openai-requests", type=int, default=1000,
                   help="fewer requests for the openai SDK, whose pool slows down with thousands of connections")
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help="write all results here")
    a = p.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if a.client:  # child mode
        print(json.dumps(run_client(a.client, a.url, a.requests, a.concurrency, a.max_tokens)), flush=True)
        return 0

    os.environ.setdefault(KEY_ENV, "sk-or-v1-bench-" + os.urandom(8).hex())
    proc, url = start_server(a.delay_ms)
    results: dict[str, list[dict]] = {c: [] for c in a.clients.split(",")}
    try:
        for rnd in range(a.rounds):
            for kind in results:
                out = subprocess.run(
                    [sys.executable, __file__, "--client", kind, "--url", url, "--requests",
                     str(a.openai_requests if kind == "openai" else a.requests),
                     "--concurrency", str(a.concurrency), "--max-tokens", str(a.max_tokens)],
                    capture_output=True, text=True, cwd=ROOT, timeout=900)
                if out.returncode:
                    raise RuntimeError(f"{kind} failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                results[kind].append(res)
                print(f"round {rnd} {kind:8s} {res['rps']:8.0f} req/s  {res['cpu_ms_per_req']:.3f} ms CPU/req  "
                      f"peak {res['peak_rss_mb']:.0f} MB  ok {res['ok']}/{res['requests']}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in results[kind])

    print(f"\n{a.requests} requests ({a.openai_requests} for openai), {a.concurrency} in flight, "
          f"server delay {a.delay_ms:g} ms, median of {a.rounds} rounds")
    print("| client | req/s | CPU ms/req | client-bound req/s (1 core) | peak RSS MB | req/s vs aiohttp "
          "(median of per-round ratios) | CPU/req vs aiohttp |")
    print("|---|---|---|---|---|---|---|")
    for kind in results:
        line = (f"| {kind} | {med(kind, 'rps'):.0f} | {med(kind, 'cpu_ms_per_req'):.3f} "
                f"| {1000 / med(kind, 'cpu_ms_per_req'):.0f} | {med(kind, 'peak_rss_mb'):.0f}")
        if "aiohttp" in results:
            ratios = [r["rps"] / f["rps"] for r, f in zip(results[kind], results["aiohttp"], strict=True)]
            line += (f" | {statistics.median(ratios):.2f}x"
                     f" | {med(kind, 'cpu_ms_per_req') / med('aiohttp', 'cpu_ms_per_req'):.2f}x |")
        print(line)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
