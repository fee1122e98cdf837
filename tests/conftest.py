"""Session-wide fixtures: one tiny target, one Ray cluster, one directly-called vLLM engine.

The session's Ray is a real head started with `ray start --head` on loopback, so the
same cluster serves in-process tests (`ray.init(address=...)`) and `ray job submit`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cluster import free_ports

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["RAY_AUTH_MODE"] = "disabled"  # a loopback test cluster; no token to distribute
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

REPO = Path(__file__).resolve().parents[1]
INTEGRATION = REPO / "tests" / "integration"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything under tests/integration is `slow` (the fast loop is `-m "not slow"`); `gpu` tests skip
    without CUDA. The modules that use a trained target (Prebuilds) run last, in their order: their targets build
    in the background meanwhile."""
    late = {getattr(i, "module", None) for i in items if set(getattr(i, "fixturenames", ())) & set(Prebuilds.FIXTURES)}
    late.discard(None)
    items.sort(key=lambda i: getattr(i, "module", None) in late)  # stable: each group keeps its order
    cuda = None
    for item in items:
        if INTEGRATION in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None:
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA (gpu marker)"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wild tiny target: random </think>, end-of-turn and tool markers (the checks' hard cases)."""
    from pipeline.demo.tiny_model import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"), variant="wild")


@pytest.fixture(scope="session")
def clean_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The well-formed tiny target (the quick start's): its sampled responses pass every check."""
    from pipeline.demo.tiny_model import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("clean-target"), variant="well-formed")


@pytest.fixture(scope="session")
def trained_target(prebuilds: Prebuilds) -> Path:
    """The trained tiny target (shop arithmetic, peaked distributions): a minute or two to build, once a session,
    in the background from the session's start."""
    return prebuilds.result("trained")


@pytest.fixture(scope="session")
def reasoning_target(prebuilds: Prebuilds) -> Path:
    """The reasoning tiny target (multi-step word problems, 100-300 token traces): ~4 minutes to build, once a
    session, in the background from the session's start. ``TINY_REASONING_DIR`` names a folder to build into (or
    reuse, when it holds this recipe's build): a developer's shortcut; CI builds it fresh."""
    return prebuilds.result("reasoning")


# SCHED_IDLE: the build gets the CPU only when nothing else wants it (below nice 19, and below Ray's workers at
# its default niceness 15); its threads inherit the policy. Passive OpenMP waits (set before torch loads): a
# thread spinning at a barrier would burn the idle time the build is for.
_BUILD = ("import os, sys; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
          "os.environ['OMP_WAIT_POLICY'] = 'PASSIVE'; "
          "from pipeline.demo.tiny_model import build_tiny_target; build_tiny_target(sys.argv[1], variant=sys.argv[2])")


class Prebuilds:
    """The trained tiny targets, each built by a background process from the session's start, on idle CPU only.

    The trained builds are minutes of CPU each, and the tests before the first one that needs a target leave
    about a fifth of the machine idle (they wait on servers, Ray and subprocesses): the builds soak that up
    instead of stalling the suite where a target is first needed. The bytes are those of an in-process build
    (the build fixes its own thread count; the scheduling policy changes when it runs, not what it computes)."""

    FIXTURES = {"trained_target": "trained", "reasoning_target": "reasoning"}

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.procs: dict[str, tuple[Path, subprocess.Popen]] = {}

    def folder(self, variant: str) -> Path:
        if variant == "reasoning" and os.environ.get("TINY_REASONING_DIR"):
            return Path(os.environ["TINY_REASONING_DIR"])
        return self.tmp_path_factory.mktemp(f"{variant}-target")

    def start(self, variant: str) -> None:
        folder = self.folder(variant)
        folder.mkdir(parents=True, exist_ok=True)
        with folder.with_name(folder.name + "-build.log").open("w") as log:  # kept: read it when a build fails
            proc = subprocess.Popen([sys.executable, "-c", _BUILD, str(folder), variant], cwd=REPO,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[variant] = folder, proc

    def result(self, variant: str) -> Path:
        """The built folder, once its background build is done. Built here when that build failed (or never
        started): the error a test then shows is the build's own."""
        from pipeline.demo.tiny_model import build_tiny_target

        if variant not in self.procs:
            self.start(variant)
        folder, proc = self.procs[variant]
        proc.wait()
        return build_tiny_target(folder, variant=variant)

    def stop(self) -> None:
        for _, proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session", autouse=True)
def prebuilds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Starts a build for each trained target a collected test uses (none for the fast loop, which uses none)."""
    builds = Prebuilds(tmp_path_factory)
    used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    for name, variant in Prebuilds.FIXTURES.items():
        if name in used:
            builds.start(variant)
    try:
        yield builds
    finally:
        builds.stop()


class RayHead:
    """A `ray start --head --block` process; stopping it kills everything under its temp dir."""

    def __init__(self, temp_dir: Path, num_cpus: int = 2) -> None:
        self.temp_dir = temp_dir
        # Every service on a port of its own: a default port still held by a Ray that just stopped (or another
        # Ray on the machine) would leave the head without a dashboard agent ("No available agent to submit job").
        # Distinct ports (free_ports holds each socket until all are bound: one at a time could repeat one).
        self.port, self.dashboard_port, self.agent_port, *others = free_ports(7)
        services = ("dashboard-agent-listen", "dashboard-agent-grpc", "metrics-export", "runtime-env-agent",
                    "ray-client-server")
        service_ports = [f"--{name}-port={port}" for name, port in zip(services, (self.agent_port, *others),
                                                                         strict=True)]
        self.env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
        self.log = temp_dir / "ray-start.log"  # what `ray start` said: quoted when the head does not come up
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                 "--node-ip-address=127.0.0.1", f"--port={self.port}", f"--num-cpus={num_cpus}",
                 f"--temp-dir={temp_dir}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                 f"--dashboard-port={self.dashboard_port}", "--disable-usage-stats", *service_ports],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def wait_ready(self, timeout: float = 120) -> None:
        import urllib.request

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start --head exited with {self.proc.returncode}:\n{self.said()}")
            try:
                urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=2)
                # the job server needs the dashboard agent: wait until it listens too
                with socket.create_connection(("127.0.0.1", self.agent_port), timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"Ray head did not come up in {timeout:.0f} s:\n{self.said()}")

    def said(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no output)"

    def stop(self) -> None:
        import psutil

        procs = [p for p in psutil.process_iter(["cmdline"])
                 if any(str(self.temp_dir) in part for part in (p.info["cmdline"] or []))]
        try:  # `ray start` and everything under it (the agents renamed themselves: no temp dir in their cmdline)
            start = psutil.Process(self.proc.pid)
            procs += [start, *start.children(recursive=True)]
        except psutil.NoSuchProcess:  # it exited (a failed start)
            pass
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def start_head(tmp_path_factory: pytest.TempPathFactory, tries: int = 2) -> RayHead:
    """A ready head, started again on fresh ports (and a fresh folder) when a start fails: the ports are picked
    free and then released, so another process may take one before Ray binds it. One failed head would error
    every test that uses the session's cluster."""
    failures = []
    for _ in range(tries):
        head = RayHead(Path(tmp_path_factory.mktemp("ray")))
        try:
            head.wait_ready()
            return head
        except (RuntimeError, TimeoutError) as e:
            head.stop()
            failures.append(str(e))
    raise RuntimeError(f"the session's Ray head did not start in {tries} tries:\n" + "\n---\n".join(failures))


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory):
    head = start_head(tmp_path_factory)
    try:
        yield head
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        head.stop()


@pytest.fixture(scope="session")
def ray_session(ray_head: RayHead):
    import ray

    if not ray.is_initialized():  # no runtime_env, as the CLI's local Ray (pipeline.run.job.init_ray)
        ray.init(address=ray_head.address, _node_ip_address="127.0.0.1")
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
    yield ray


# ------------------------------------------------------------------ training tests (unit and Ray Train)


@pytest.fixture(scope="module")
def one_thread():
    """Two OpenMP threads fighting other processes on a 2-core box are ~30x slower than one
    (training modules use it: ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    from tests.helpers.training import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny_rows(tiny_target: Path) -> list[dict]:
    """The pipeline's tiny target (129k vocab): its own greedy continuations of random prompts."""
    from tests.helpers.training import AUX_IDS, PROMPT_IDS, generated_rows, random_prompts

    return generated_rows(tiny_target, random_prompts(40, PROMPT_IDS[1], (8, 24), seed=1), 32, AUX_IDS)


@pytest.fixture(scope="module")
def target_parts(tiny_target: Path):
    from training.target import load_target_parts

    return load_target_parts(tiny_target)


@pytest.fixture(scope="session")
def tiny_llm(tiny_target: Path):
    """The session's one directly-called vLLM engine on the tiny target."""
    from vllm import LLM

    llm = LLM(model=str(tiny_target), dtype="float32", max_model_len=2048, seed=0, enforce_eager=True)
    yield llm
    del llm
