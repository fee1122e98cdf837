"""Benches for scale (issue #26), each figure printed beside its floor from the same run.

``validate``: validation throughput (tokens/s) with long answers, one vs two ValidateSamples actors on a
two-node local Ray (a head and one worker node, 1 CPU each, started here and stopped at the end). The rows
are built once, before the clock starts: prompts rendered by the profile, answers of about
``--answer-tokens`` tokens from the stand-in server's long-answer mode (``CannedBackend``), ids rebuilt
from their text as the HTTP source does. Then the same rows go through
``map_batches(ValidateSamples, compute=ActorPoolStrategy(size=k), num_cpus=1)`` for k = 1, 2, in
``--rounds`` interleaved rounds; the floor is k = 1.

``e2e``: the whole pipeline (``python -m pipeline run``, training off) on N distinct prompts against the
no-model stand-in (``--delay-ms``), the source holding ``--concurrency`` requests in flight; the floor is a
bare aiohttp loop at the same concurrency against the same server, run just before and just after the
pipeline (their mean). Also: seconds from launch to the first answer counted, the driver's peak RSS, the
wall time of ``status`` and of a resume of the finished folder, and Ray's own start (a bare
``ray.init(); ray.shutdown()``) to read the resume against.

``first``: only the seconds from launch to the first answer counted, each run killed once it has one, in
alternating rounds against another checkout (``--base``): the drift of this machine's speed between minutes is
larger than most changes to the start-up.

    python bench/bench_scale.py validate --rows 1500 --answer-tokens 2000 --rounds 2
    python bench/bench_scale.py e2e --prompts 20000 200000
    python bench/bench_scale.py first --prompts 200000 --rounds 4 --base /tmp/base
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# BENCH_PIPELINE_ROOT: the pipeline runs from another checkout (an A/B of a change); the bench's own code
# (the stand-in, the floor) stays this checkout's.
_driver = sys.argv[1:2] == ["_driver"]
sys.path.insert(0, (os.environ.get("BENCH_PIPELINE_ROOT") if _driver else None) or str(ROOT))

MODEL = "tiny/deepseek-tiny"
PROFILE = "deepseek"
# One core per actor: the tokenizers and any BLAS stay on the CPU Ray gave the actor.
ONE_THREAD = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
              "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
GENERATE_LINE = re.compile(r"\[generate\] (\d+)/~?(\d+) done")


# ----------------------------------------------------------------------------- shared parts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ratio(value: float | None, floor: float | None) -> str:
    return f"{value / floor:.2f}x" if value is not None and floor else "--"


def child_env(tmp: Path) -> dict[str, str]:
    """This venv first on PATH, a Ray of our own (never RAY_ADDRESS), Ray's files under ``tmp``."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(ONE_THREAD, PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}", RAY_TMPDIR=str(tmp))
    return env


def kill_under(tmp: Path) -> int:
    """SIGKILL the processes whose command line names ``tmp`` (the Ray processes this bench started: every
    one of them carries its session folder there); returns how many there were."""
    import psutil

    mine = [p for p in psutil.process_iter(["cmdline"])
            if p.pid != os.getpid() and any(str(tmp) in part for part in (p.info["cmdline"] or []))]
    for p in mine:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(mine, timeout=10)
    return len(mine)


@contextmanager
def stand_in(tmp: Path, delay_ms: float, answer_tokens: int | None = None) -> Iterator[str]:
    """The no-model stand-in server in a process of its own; yields its base URL."""
    extra = ["--answer-tokens", str(answer_tokens)] if answer_tokens else []
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve-openrouter", "--host", "127.0.0.1", "--port",
                             "0", "--no-model", "--delay-ms", str(delay_ms), *extra],
                            stdout=subprocess.PIPE, stderr=(tmp / "server.log").open("w"), text=True, cwd=ROOT,
                            env=child_env(tmp), start_new_session=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("READY "):
            raise RuntimeError(f"stand-in server did not start: {line!r} {(tmp / 'server.log').read_text()[-2000:]}")
        yield line.split()[1]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ----------------------------------------------------------------------------- validate


def build_rows(n: int, answer_tokens: int, thinking: bool = True) -> Any:
    """``n`` ok rows as the HTTP source hands them to validation (``flight.FLIGHT_SCHEMA``): the stand-in's
    long answers, ids rebuilt from their text, billed counts as the server sends them."""
    from pipeline.base.flight import rows_to_table
    from pipeline.base.records import empty_sample
    from pipeline.checks.reconstruct import rebuild_ids
    from pipeline.demo.openrouter_server import CannedBackend, answer_variant
    from pipeline.profiles import load_profile
    from pipeline.profiles.base import Completion

    profile = load_profile(PROFILE)
    backend = CannedBackend(0, profile, answer_tokens)
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Validation bench prompt {i}: walk through case {i} step by step."}]
        rendered = profile.render_prompt(messages, None, thinking)
        g = backend.long_answer(answer_variant({"messages": messages, "seed": 0}), thinking, 1 << 30,
                                len(rendered.ids))
        rebuilt = rebuild_ids(profile, Completion(g.reasoning, g.content, None, g.finish_reason, g.completion_tokens),
                              thinking)
        row = empty_sample({"sample_id": f"bench:{i}", "dataset": "bench", "row_index": i,
                            "messages": json.dumps(messages), "tools": "", "thinking": rendered.thinking,
                            "prompt_ids": rendered.ids, "prompt_assistant_mask": rendered.assistant_mask})
        row.update(output_ids=rebuilt.ids, reasoning=g.reasoning, content=g.content, finish_reason=g.finish_reason,
                   truncated=rebuilt.truncated, billed_completion_tokens=g.completion_tokens, ids_from="rebuilt",
                   source="stand-in", provider="Alpha", model=MODEL, status="ok", stage="", reason="")
        rows.append(row)
    return rows_to_table(rows)


class RayCluster:
    """A ``ray start --head --block`` process and one worker node (tests.helpers.cluster.WorkerNode), 1 CPU
    each, every service on a port of its own, every file under ``tmp``."""

    def __init__(self, tmp: Path, cpus_per_node: int = 1) -> None:
        self.tmp, self.env = tmp, child_env(tmp)
        self.port = free_port()
        ports = [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                 f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
                 f"--ray-client-server-port={free_port()}", f"--node-manager-port={free_port()}",
                 f"--object-manager-port={free_port()}"]
        self.head = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={self.port}", f"--num-cpus={cpus_per_node}", f"--temp-dir={tmp / 'ray'}",
             "--include-dashboard=false", "--object-store-memory=400000000", "--disable-usage-stats", *ports],
            env=self.env, stdout=(tmp / "head.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.cpus_per_node = cpus_per_node
        self.worker: Any = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> None:
        import ray

        from tests.helpers.cluster import WorkerNode

        deadline = time.time() + timeout
        while True:
            if self.head.poll() is not None:
                raise RuntimeError(f"ray start --head exited: {(self.tmp / 'head.log').read_text()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2):
                    break
            except OSError:
                if time.time() > deadline:
                    raise TimeoutError("the Ray head did not come up") from None
                time.sleep(0.5)
        os.environ.update(ONE_THREAD)
        ray.init(address=self.address, _node_ip_address="127.0.0.1", log_to_driver=False, logging_level="WARNING")
        self.worker = WorkerNode(self.address, self.env, self.tmp, num_cpus=self.cpus_per_node)
        self.worker.wait_alive(timeout)
        while sum(n["Alive"] for n in ray.nodes()) < 2 and time.time() < deadline:
            time.sleep(0.5)

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.worker is not None:
            self.worker.stop()
        self.head.terminate()
        try:
            self.head.wait(30)
        except subprocess.TimeoutExpired:
            pass
        kill_under(self.tmp)


def _validate_class() -> type:
    """ValidateSamples, noting in a file per actor its node (the pool's spread) and the wall and CPU seconds
    of its calls (wall well over CPU: the actor waited for a core); the work is the stage's own ``__call__``."""
    from pipeline.generate.stages import ValidateSamples

    class NotedValidate(ValidateSamples):
        def __init__(self, note_dir: str, *args: Any) -> None:
            import ray

            super().__init__(*args)
            self.note = Path(note_dir, f"{os.getpid()}.node")
            self.node, self.wall, self.cpu = ray.get_runtime_context().get_node_id(), 0.0, 0.0
            self._write()

        def __call__(self, batch: Any) -> Any:
            t, c = time.perf_counter(), time.process_time()
            out = super().__call__(batch)
            self.wall += time.perf_counter() - t
            self.cpu += time.process_time() - c
            self._write()
            return out

        def _write(self) -> None:
            self.note.write_text(json.dumps({"node": self.node, "wall_s": self.wall, "cpu_s": self.cpu}))

    return NotedValidate


def time_validate(table: Any, k: int, batch_rows: int, note_dir: Path) -> dict[str, Any]:
    """One pass of every row through a pool of ``k`` validate actors: tokens/s over the pass (actor start-up
    included) and over its steady window (first output batch to last, the first batch's tokens left out)."""
    import pyarrow.compute as pc
    import ray

    from pipeline.base.config import ChecksConfig

    for f in note_dir.glob("*.node"):
        f.unlink()
    blocks = [table.slice(i, batch_rows) for i in range(0, table.num_rows, batch_rows)]
    ds = ray.data.from_arrow(blocks).map_batches(
        _validate_class(), fn_constructor_args=(str(note_dir), PROFILE, None, {"bench": ChecksConfig().model_dump()}),
        batch_format="pyarrow", batch_size=batch_rows, compute=ray.data.ActorPoolStrategy(size=k), num_cpus=1)
    t0 = time.perf_counter()
    times, tokens, rows, passed = [], [], 0, 0
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        times.append(time.perf_counter())
        tokens.append(int(pc.sum(pc.list_value_length(batch.column("output_ids"))).as_py() or 0))
        rows += batch.num_rows
        passed += sum(s == "ok" for s in batch.column("status").to_pylist())
    wall = times[-1] - t0
    window = times[-1] - times[0]
    notes = [json.loads(f.read_text()) for f in note_dir.glob("*.node")]
    return {"k": k, "rows": rows, "passed": passed, "tokens": sum(tokens), "wall_s": wall,
            "tok_s": sum(tokens) / wall, "window_s": window,
            "window_tok_s": sum(tokens[1:]) / window if window > 0 else None,
            "nodes": len({n["node"] for n in notes}), "actor_call_s": [round(n["wall_s"], 2) for n in notes],
            "actor_cpu_s": [round(n["cpu_s"], 2) for n in notes]}


def cmd_validate(a: argparse.Namespace) -> int:
    import ray

    t = time.perf_counter()
    table = build_rows(a.rows, a.answer_tokens)
    per_row = table.num_rows and sum(len(x) for x in table.column("output_ids").to_pylist()) / table.num_rows
    print(f"rows: {table.num_rows} built in {time.perf_counter() - t:.1f}s, {per_row:.0f} output tokens each "
          f"(--answer-tokens {a.answer_tokens}), batches of {a.batch_rows}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bsv-", dir="/tmp"))
    cluster = RayCluster(tmp)
    results: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    try:
        cluster.start()
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        print(f"cluster: {len(ray.nodes())} nodes, {ray.cluster_resources().get('CPU')} CPUs", flush=True)
        notes = tmp / "notes"
        notes.mkdir()
        for rnd in range(a.rounds):
            for k in (1, 2):
                r = time_validate(table, k, a.batch_rows, notes)
                results[k].append(r)
                print(f"round {rnd} k={k}: {r['tok_s']:,.0f} tok/s over the pass ({r['wall_s']:.1f}s), "
                      f"{(r['window_tok_s'] or 0):,.0f} tok/s steady ({r['window_s']:.1f}s), {r['passed']}/{r['rows']} "
                      f"passed, actors on {r['nodes']} node(s), their calls {r['actor_call_s']} s wall, "
                      f"{r['actor_cpu_s']} s CPU", flush=True)
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(k: int, key: str) -> float:
        return statistics.median(r[key] or 0.0 for r in results[k])

    print(f"\nvalidation, {a.rows} rows x ~{per_row:.0f} tokens, two nodes of 1 CPU, median of {a.rounds} rounds "
          "(floor: one actor, same rows, same run)")
    print("| figure | 1 actor (floor) | 2 actors | ratio | goal |")
    print("|---|---|---|---|---|")
    for key, label in (("window_tok_s", "tokens/s, steady window"), ("tok_s", "tokens/s, whole pass")):
        print(f"| {label} | {med(1, key):,.0f} | {med(2, key):,.0f} | {ratio(med(2, key), med(1, key))} | >= 1.7x |")
    per_round = [r2["window_tok_s"] / r1["window_tok_s"] for r1, r2 in zip(results[1], results[2], strict=True)
                 if r1["window_tok_s"] and r2["window_tok_s"]]
    print(f"per-round steady ratios: {', '.join(f'{x:.2f}x' for x in per_round)}; nodes used by 2 actors: "
          f"{sorted({r['nodes'] for r in results[2]})}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1))
    return 0


# ----------------------------------------------------------------------------- e2e


def floor_body(i: int, max_tokens: int) -> dict[str, Any]:
    """What the pipeline's source sends for prompt ``i``: the same messages, sampling and reasoning."""
    return {"model": MODEL, "messages": prompt_messages(i), "temperature": 1.0, "top_p": 1.0,
            "max_tokens": max_tokens, "seed": 0, "stream": False, "reasoning": {"enabled": True}}


def prompt_messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Scale bench question {i}: what is {i} plus {(i * 7919) % 100003}?"}]


async def bare_aiohttp(url: str, n: int, conc: int, max_tokens: int) -> int:
    """The floor: post the bodies with ``conc`` in flight, parse each JSON answer, nothing else."""
    import aiohttp

    ok = 0
    sem = asyncio.Semaphore(conc)
    conn = aiohttp.TCPConnector(limit=conc, limit_per_host=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as s:
        async def one(i: int) -> None:
            nonlocal ok
            async with sem, s.post(url + "/chat/completions", json=floor_body(i, max_tokens)) as r:
                data = json.loads(await r.read())
                ok += r.status == 200 and bool(data.get("choices"))

        await asyncio.gather(*(one(i) for i in range(n)))
    return ok


def cmd_floor(a: argparse.Namespace) -> int:
    """Child process: the floor loop, one JSON line out."""
    import aiohttp  # noqa: F401 - imported before the clock starts

    t0 = time.perf_counter()
    ok = asyncio.run(bare_aiohttp(a.url, a.requests, a.concurrency, a.max_tokens))
    wall = time.perf_counter() - t0
    print(json.dumps({"requests": a.requests, "ok": ok, "wall_s": wall, "rps": a.requests / wall}), flush=True)
    return 0


def cmd_driver(a: argparse.Namespace) -> int:
    """Child process: ``python -m pipeline ARGS`` in this process, its peak RSS written to ``--rss-out``."""
    try:
        from pipeline.run.cli import main
    except ImportError:  # BENCH_PIPELINE_ROOT names a checkout from before the regroup (an A/B of the change)
        from pipeline.cli import main  # type: ignore[no-redef]

    rc = 1
    try:
        rc = main(a.args)
    finally:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        Path(a.rss_out).write_text(json.dumps({"rc": rc, "maxrss_kib": peak, "vmhwm_kib": _status_kib("VmHWM")}))
    return rc


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def run_floor(url: str, n: int, conc: int, max_tokens: int, tmp: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "_floor", "--url", url, "--requests", str(n), "--concurrency",
                          str(conc), "--max-tokens", str(max_tokens)],
                         capture_output=True, text=True, cwd=ROOT, env=child_env(tmp), timeout=3600)
    if out.returncode:
        raise RuntimeError(f"floor loop failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_pipeline(args: Sequence[str], tmp: Path, timeout: float, tag: str) -> dict[str, Any]:
    """``python -m pipeline ARGS`` through the RSS-noting wrapper: wall time, exit code, peak RSS, and the
    seconds from launch to the first console line that counts an answer (progress lines every 0.5 s)."""
    rss_out = tmp / f"{tag}.rss.json"
    env = child_env(tmp) | {"PIPELINE_PROGRESS_S": "0.5"}
    other = os.environ.get("BENCH_PIPELINE_ROOT")  # another checkout's pipeline (an A/B), first on the path
    if other:
        env["PYTHONPATH"] = other
    log = (tmp / f"{tag}.out").open("w")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "_driver", "--rss-out", str(rss_out), "--", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=other or ROOT, env=env,
                            start_new_session=True)
    first: list[float] = []  # the first line counting an answer
    began: list[float] = []  # the phase's first line, printed as it starts

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            m = GENERATE_LINE.search(line)
            if m and not began:
                began.append(time.perf_counter() - t0)
            if m and int(m.group(1)) > 0 and not first:
                first.append(time.perf_counter() - t0)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        raise RuntimeError(f"{tag}: no end after {timeout:.0f}s (log {tmp / (tag + '.out')})") from None
    wall = time.perf_counter() - t0
    reader.join(30)
    log.close()
    rss = json.loads(rss_out.read_text()) if rss_out.exists() else {}
    return {"rc": rc, "wall_s": wall, "first_line_s": first[0] if first else None,
            "generate_began_s": began[0] if began else None,
            "peak_rss_mb": (rss.get("vmhwm_kib") or rss.get("maxrss_kib") or 0) / 1024, "log": str(tmp / f"{tag}.out")}


def ray_start_s(tmp: Path) -> dict[str, float]:
    """A bare local Ray as the pipeline starts it (dashboard on, loopback): ray.init's seconds, and the whole
    process (interpreter, ``import ray``, init, shutdown)."""
    code = ("import json, time; t0 = time.perf_counter(); import ray; t1 = time.perf_counter(); "
            "ray.init(address='local', include_dashboard=True, _node_ip_address='127.0.0.1'); "
            "t2 = time.perf_counter(); ray.shutdown(); t3 = time.perf_counter(); "
            "print(json.dumps({'import_s': t1 - t0, 'init_s': t2 - t1, 'shutdown_s': t3 - t2}))")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=child_env(tmp),
                         timeout=300)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(f"bare ray.init failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"process_s": wall}


def write_inputs(work: Path, n: int, url: str, a: argparse.Namespace) -> Path:
    """``n`` distinct prompts (messages JSONL) and a config: one openrouter source on the stand-in, no key,
    ``--concurrency`` in flight over ``--actors`` actors, training off, every other section at its default."""
    import yaml

    prompts = work / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": prompt_messages(i)}) + "\n")
    per_actor = -(-a.concurrency // a.actors)
    batches = 4
    cfg = {
        "output_dir": str(work / "out"),
        "model": {"profile": PROFILE},
        "sampling": {"max_tokens": a.max_tokens, "temperature": 1.0, "top_p": 1.0},
        "datasets": [{"name": "scale", "path": str(prompts), "format": "messages", "thinking": True}],
        "sources": [{"kind": "openrouter", "name": "stand-in", "base_url": url, "model": MODEL,
                     "api_key_required": False, "num_actors": a.actors, "max_in_flight": per_actor,
                     # enough rows handed to each actor at once to keep max_in_flight requests going
                     "batch_size": a.batch_size or -(-per_actor // batches), "max_concurrent_batches": batches,
                     "budgets": {"scale": "unlimited"}}],
        "training": None,
    }
    path = work / "scale.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def first_answer_in_series(report: dict[str, Any]) -> float | None:
    """Seconds from the generate phase's start to its first snapshot with an answer counted (report.json)."""
    series = (report.get("throughput") or {}).get("series") or []
    return next((p["t"] for p in series if p.get("done")), None)


def first_answer_s(run: dict[str, Any], report: dict[str, Any]) -> float | None:
    """Seconds from launch to the first answer counted: the console's first line counting one (every 0.5 s),
    or the phase's first line plus the report's first snapshot with one (at most one a second), whichever
    is earlier (both are late by up to their period)."""
    series = first_answer_in_series(report)
    began = run.get("generate_began_s")
    seen = [x for x in (run.get("first_line_s"), began + series if began is not None and series is not None
                        else None) if x is not None]
    return min(seen) if seen else None


def e2e_once(n: int, a: argparse.Namespace, base: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"bse{n}-", dir=str(base)))
    timeout = 900 + n / 50
    with stand_in(work, a.delay_ms) as url:
        cfg = write_inputs(work, n, url, a)
        floor_n = a.floor_requests or n
        before = run_floor(url, floor_n, a.concurrency, a.max_tokens, work)
        print(f"[{n}] floor before: {before['rps']:,.0f} req/s ({before['ok']}/{floor_n} ok)", flush=True)
        first = run_pipeline(["run", str(cfg)], work, timeout, "run")
        print(f"[{n}] pipeline: exit {first['rc']}, {first['wall_s']:.1f}s, driver peak "
              f"{first['peak_rss_mb']:.0f} MB", flush=True)
        after = run_floor(url, floor_n, a.concurrency, a.max_tokens, work)
        print(f"[{n}] floor after: {after['rps']:,.0f} req/s ({after['ok']}/{floor_n} ok)", flush=True)
        if first["rc"] != 0:
            raise RuntimeError(f"the pipeline run ended with exit {first['rc']}; see {first['log']}")
        report = json.loads((work / "out" / "report.json").read_text())  # before the resume rewrites it
        first["first_answer_s"] = first_answer_s(first, report)
        t = time.perf_counter()
        st = subprocess.run([sys.executable, "-m", "pipeline", "status", str(cfg)], capture_output=True, text=True,
                            cwd=ROOT, env=child_env(work), timeout=600)
        status_s = time.perf_counter() - t
        if st.returncode:
            raise RuntimeError(f"status failed (exit {st.returncode}):\n{st.stderr[-2000:]}")
        ray_s = ray_start_s(work)
        resume = run_pipeline(["run", str(cfg)], work, timeout, "resume")
        if resume["rc"] != 0:
            raise RuntimeError(f"the resume ended with exit {resume['rc']}; see {resume['log']}")
    leftover = kill_under(work)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    floor = (before["rps"] + after["rps"]) / 2
    done = report.get("passed", 0) + report.get("quarantined", 0)
    return {"prompts": n, "floor_before_rps": before["rps"], "floor_after_rps": after["rps"], "floor_rps": floor,
            "run": first, "whole_rps": n / first["wall_s"], "generate_rps": report["throughput"]["samples_per_s"],
            "passed": report.get("passed"), "quarantined": report.get("quarantined"), "done": done,
            "seconds": report.get("seconds"), "first_answer_generate_s": first_answer_in_series(report),
            "status_s": status_s, "ray_start": ray_s, "resume": resume, "leftover_processes": leftover,
            "work": str(work) if a.keep else None}


def print_e2e(r: dict[str, Any], a: argparse.Namespace) -> None:
    n, floor = r["prompts"], r["floor_rps"]
    ray_init, ray_proc = r["ray_start"]["init_s"], r["ray_start"]["process_s"]
    secs = r["seconds"] or {}
    print(f"\n{n:,} prompts, {a.concurrency} in flight ({a.actors} source actor(s)), stand-in --delay-ms "
          f"{a.delay_ms:g}; {r['passed']} passed, {r['quarantined']} quarantined; floor: bare aiohttp, same server, "
          f"same concurrency, before {r['floor_before_rps']:,.0f} / after {r['floor_after_rps']:,.0f} req/s")
    print("| figure | value | floor | ratio | goal |")
    print("|---|---|---|---|---|")
    print(f"| whole run | {r['whole_rps']:,.0f} req/s ({r['run']['wall_s']:.1f} s) | {floor:,.0f} req/s | "
          f"{ratio(r['whole_rps'], floor)} | >= 0.6x at 200k |")
    print(f"| generate phase | {r['generate_rps'] or 0:,.0f} req/s ({secs.get('generate', '--')} s) "
          f"| {floor:,.0f} req/s | {ratio(r['generate_rps'], floor)} | |")
    fa = r["run"]["first_answer_s"]
    print(f"| first answer counted, from launch | {_s(fa)} s | 15 s | "
          f"{ratio(fa, 15)} | <= 15 s (phase began at {_s(r['run']['generate_began_s'])} s, its first answer "
          f"{r['first_answer_generate_s']} s later; read {secs.get('read', '--')} s, ray_init "
          f"{secs.get('ray_init', '--')} s) |")
    print(f"| driver peak RSS | {r['run']['peak_rss_mb']:.0f} MB | | | within 1.3x between 20k and 200k |")
    print(f"| status | {r['status_s']:.1f} s | 3 s | {ratio(r['status_s'], 3)} | <= 3 s |")
    budget = 10 + ray_proc
    print(f"| resume of the finished folder | {r['resume']['wall_s']:.1f} s | 10 s + Ray's start {ray_proc:.1f} s "
          f"= {budget:.1f} s | {ratio(r['resume']['wall_s'], budget)} | <= 1.0x (bare ray.init alone "
          f"{ray_init:.1f} s) |")
    if r["leftover_processes"]:
        print(f"(killed {r['leftover_processes']} leftover processes of this bench's Ray)")


def _s(x: float | None) -> str:
    return "--" if x is None else f"{x:.1f}"


def cmd_e2e(a: argparse.Namespace) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    base = Path(a.work_dir) if a.work_dir else Path("/tmp")
    base.mkdir(parents=True, exist_ok=True)
    results = []
    for n in a.prompts:
        r = e2e_once(n, a, base)
        results.append(r)
        print_e2e(r, a)
    if len(results) > 1:
        lo, hi = min(results, key=lambda r: r["prompts"]), max(results, key=lambda r: r["prompts"])
        print(f"\ndriver peak RSS {hi['run']['peak_rss_mb']:.0f} MB at {hi['prompts']:,} prompts vs "
              f"{lo['run']['peak_rss_mb']:.0f} MB at {lo['prompts']:,}: "
              f"{ratio(hi['run']['peak_rss_mb'], lo['run']['peak_rss_mb'])} (goal <= 1.3x)")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1, default=str))
    return 0


# ----------------------------------------------------------------------------- first answer, A/B


def first_answer_once(cfg: Path, work: Path, root: Path, timeout: float) -> dict[str, float | None]:
    """``python -m pipeline run`` from checkout ``root``, killed (its whole process group and Ray) as soon as its
    console counts a first answer: seconds from launch to the phase's first line and to that answer."""
    env = child_env(work) | {"PIPELINE_PROGRESS_S": "0.25"}
    if root != ROOT:
        env["PYTHONPATH"] = str(root)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "run", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=root, env=env, start_new_session=True)
    began = first = None
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = GENERATE_LINE.search(line)
            if m and began is None:
                began = time.perf_counter() - t0
            if m and int(m.group(1)) > 0:
                first = time.perf_counter() - t0
                break
    finally:
        timer.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        kill_under(work)
    return {"began_s": began, "first_s": first}


def cmd_first(a: argparse.Namespace) -> int:
    """Seconds to the first answer only, this checkout against ``--base`` (another checkout) in alternating
    rounds on one stand-in and one prompt file: the machine's speed drifts by seconds between minutes, so
    only an interleaved A/B separates a change from the drift."""
    sides = {"base": Path(a.base).resolve(), "this": ROOT} if a.base else {"this": ROOT}
    base = Path(tempfile.mkdtemp(prefix="bsfirst-", dir=a.work_dir or "/tmp"))
    out: dict[str, list[dict[str, float | None]]] = {side: [] for side in sides}
    try:
        with stand_in(base, a.delay_ms) as url:
            for r in range(a.rounds):
                for side, root in sides.items():
                    work = base / f"{side}{r}"
                    work.mkdir()
                    cfg = write_inputs(work, a.prompts, url, a)
                    res = first_answer_once(cfg, work, root, timeout=300)
                    out[side].append(res)
                    print(f"[{side} {r}] phase began {_s(res['began_s'])} s, first answer {_s(res['first_s'])} s",
                          flush=True)
                    shutil.rmtree(work, ignore_errors=True)
    finally:
        kill_under(base)
        shutil.rmtree(base, ignore_errors=True)
    print(f"\nfirst answer counted, {a.prompts:,} prompts, {a.rounds} alternating rounds (goal <= 15 s from launch)")
    print("| checkout | from launch, per round | mean | after the phase began, mean |")
    print("|---|---|---|---|")
    for side, runs in out.items():
        firsts = [x["first_s"] for x in runs if x["first_s"] is not None]
        after = [x["first_s"] - x["began_s"] for x in runs if x["first_s"] is not None and x["began_s"] is not None]
        print(f"| {side} ({sides[side]}) | {', '.join(f'{x:.1f}' for x in firsts)} s | "
              f"{statistics.mean(firsts):.1f} s | {statistics.mean(after):.1f} s |" if firsts else f"| {side} | -- |")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1))
    return 0


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="validation tokens/s, one vs two actors on a two-node local Ray")
    v.add_argument("--rows", type=int, default=1500)
    v.add_argument("--answer-tokens", type=int, default=2000)
    v.add_argument("--batch-rows", type=int, default=25, help="rows per block and per actor call")
    v.add_argument("--rounds", type=int, default=2)
    v.add_argument("--json-out")
    v.set_defaults(fn=cmd_validate)
    e = sub.add_parser("e2e", help="the whole pipeline on N prompts against the stand-in, vs a bare aiohttp loop")
    e.add_argument("--prompts", type=int, nargs="+", default=[2000], help="one or more prompt counts, in turn")
    e.add_argument("--concurrency", type=int, default=2000, help="requests in flight (the source's, and the floor's)")
    e.add_argument("--actors", type=int, default=1, help="source actors sharing --concurrency")
    e.add_argument("--batch-size", type=int, default=None, help="rows per source batch (default: in flight / 4)")
    e.add_argument("--delay-ms", type=float, default=50.0)
    e.add_argument("--max-tokens", type=int, default=128)
    e.add_argument("--floor-requests", type=int, default=None, help="requests per floor loop (default: N)")
    e.add_argument("--work-dir", help="where the run folders go (default /tmp); each is removed unless --keep")
    e.add_argument("--keep", action="store_true")
    e.add_argument("--json-out")
    e.set_defaults(fn=cmd_e2e)
    fa = sub.add_parser("first", help="seconds to the first answer only, this checkout vs --base, alternating")
    fa.add_argument("--prompts", type=int, default=200000)
    fa.add_argument("--rounds", type=int, default=4)
    fa.add_argument("--base", help="another checkout of the project (e.g. a git worktree) to run against")
    fa.add_argument("--concurrency", type=int, default=2000)
    fa.add_argument("--actors", type=int, default=1)
    fa.add_argument("--batch-size", type=int, default=None)
    fa.add_argument("--delay-ms", type=float, default=50.0)
    fa.add_argument("--max-tokens", type=int, default=128)
    fa.add_argument("--work-dir")
    fa.add_argument("--json-out")
    fa.set_defaults(fn=cmd_first)
    f = sub.add_parser("_floor")
    f.add_argument("--url", required=True)
    f.add_argument("--requests", type=int, required=True)
    f.add_argument("--concurrency", type=int, required=True)
    f.add_argument("--max-tokens", type=int, required=True)
    f.set_defaults(fn=cmd_floor)
    d = sub.add_parser("_driver")
    d.add_argument("--rss-out", required=True)
    d.add_argument("args", nargs=argparse.REMAINDER)
    d.set_defaults(fn=cmd_driver)
    a = p.parse_args(argv)
    if a.command == "_driver" and a.args[:1] == ["--"]:
        a.args = a.args[1:]
    return a.fn(a)


if __name__ == "__main__":
    raise SystemExit(main())
