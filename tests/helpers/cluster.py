"""Worker nodes added to the test session's one Ray head, on this machine, and killed like a lost machine.

A node is a ``ray start --address=HEAD --block`` process in a session of its own; its raylet, agents and the
workers its raylet starts all descend from it. ``kill`` SIGKILLs that whole tree at once (nothing gets to
say goodbye to the GCS), which is what the cluster sees when a machine drops off the network. The node is
recognised in ``ray.nodes()`` by its node-manager port, which this helper picks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: every socket is held until all are bound (a port asked for one at a time can
    come back twice, and Ray refuses a node whose two services were given one port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


PORT_CLASH = "is trying to use a port number"  # ray start's words when a port it was given is taken


class WorkerNode:
    """One extra Ray node on the session's head, with its own ports and a small object store."""

    def __init__(self, head_address: str, env: Mapping[str, str], temp_dir: Path, *, num_cpus: float = 1,
                 resources: Mapping[str, float] | None = None, object_store_bytes: int = 200 * 1024**2) -> None:
        self.head_address = head_address
        self.resources = dict(resources or {})
        self.num_cpus = num_cpus
        # Every service on a port of its own: the defaults (e.g. the agent's 52365) would clash between nodes.
        self.node_manager_port, *others = free_ports(6)
        self.log = Path(temp_dir) / f"worker-node-{self.node_manager_port}.log"
        ports = [f"--node-manager-port={self.node_manager_port}", *(
            f"--{name}-port={port}" for name, port in zip(
                ("object-manager", "dashboard-agent-listen", "dashboard-agent-grpc", "metrics-export",
                 "runtime-env-agent"), others, strict=True))]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", f"--address={head_address}", "--block",
             "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", f"--resources={json.dumps(self.resources)}",
             f"--object-store-memory={object_store_bytes}", "--disable-usage-stats", *ports],
            env=dict(env), stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.node_id: str | None = None
        self.killed = False

    # -- what the cluster sees ------------------------------------------------
    def _entry(self) -> dict[str, Any] | None:
        import ray

        mine = [n for n in ray.nodes() if n.get("NodeManagerPort") == self.node_manager_port]
        return max(mine, key=lambda n: n["Alive"]) if mine else None

    def wait_alive(self, timeout: float = 120) -> str:
        """Block until the GCS lists this node alive; returns its node id."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            entry = self._entry()
            if entry is not None and entry["Alive"]:
                self.node_id = entry["NodeID"]
                return self.node_id
            time.sleep(0.5)
        raise TimeoutError(f"worker node :{self.node_manager_port} never came up: {self.log.read_text()[-3000:]}")

    def wait_dead(self, timeout: float = 120) -> None:
        """Block until the GCS has declared this node dead (its health checks time out after a kill)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            entry = self._entry()
            if entry is None or not entry["Alive"]:
                return
            time.sleep(0.5)
        raise TimeoutError(f"node {self.node_id} still alive {timeout}s after it was killed")

    # -- losing it ------------------------------------------------------------
    def processes(self) -> list[Any]:
        """The node's processes: the `ray start` process, its raylet and agents, and the raylet's workers."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        if self.node_id:  # workers already orphaned by an earlier kill still name their node
            seen = {p.pid for p in procs}
            for p in psutil.process_iter(["cmdline"]):
                if p.pid not in seen and any(self.node_id in part for part in (p.info["cmdline"] or [])):
                    procs.append(p)
        return procs

    def kill(self) -> None:
        """SIGKILL every process of the node at once: a machine gone without a word."""
        import psutil

        procs = self.processes()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        self.proc.wait(10)
        self.killed = True

    def stop(self) -> None:
        """Take a node that is still up away quickly: SIGTERM lets `ray start --block` stop its raylet, which
        tells the GCS at once (a kill waits out the GCS's health checks, ~15 s); whatever is left is killed."""
        if self.killed:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


class Nodes:
    """The worker nodes a test added (``remove_all`` runs in its fixture's finalizer), and the cluster's actors as
    the head's state API (``dashboard``) lists them."""

    def __init__(self, head_address: str, env: Mapping[str, str], temp_dir: Path, dashboard: str) -> None:
        self.head_address, self.env, self.temp_dir, self.dashboard = head_address, env, temp_dir, dashboard
        self.added: list[WorkerNode] = []

    def add(self, *, num_cpus: float = 1, resources: Mapping[str, float] | None = None,
            wait: bool = True, tries: int = 3) -> WorkerNode:
        """Start a node (and wait for it); a start that lost one of its ports to another process between the
        pick and the bind (``PORT_CLASH``) is tried again on new ports."""
        for attempt in range(tries):
            node = WorkerNode(self.head_address, self.env, self.temp_dir, num_cpus=num_cpus, resources=resources)
            self.added.append(node)
            if not wait:
                return node
            try:
                node.wait_alive()
                return node
            except RuntimeError as e:
                if PORT_CLASH not in str(e) or attempt == tries - 1:
                    raise
                self.added.remove(node)
        raise AssertionError("unreachable")

    def remove_all(self) -> None:
        """Stop every node first, then wait until Ray counts each one dead (so the waits overlap)."""
        errors: list[Exception] = []
        for node in self.added:
            try:
                node.stop()
            except Exception as e:  # noqa: BLE001 - remove every node, then report
                errors.append(e)
        for node in self.added:
            try:
                if node.node_id:
                    node.wait_dead()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        self.added.clear()
        if errors:
            raise errors[0]

    def actor_ids(self) -> set[str]:
        return actor_ids(self.dashboard)

    def actors_since(self, before: set[str], repr_part: str) -> list[Any]:
        return actors_since(self.dashboard, before, repr_part)

    @staticmethod
    def head_node_id() -> str:
        """The head's node id: this process's driver joined the head before any worker node existed."""
        import ray

        return ray.get_runtime_context().get_node_id()


def actors_since(dashboard: str, before: set[str], repr_part: str) -> list[Any]:
    """Actors (alive or dead) created after the ids in ``before`` whose repr or class contains ``repr_part``
    (``dashboard``: the head's dashboard URL, which serves the state API)."""
    from ray.util.state import list_actors

    return [a for a in list_actors(address=dashboard, detail=True, limit=10_000, raise_on_missing_output=False)
            if a.actor_id not in before and (repr_part in (a.repr_name or "") or repr_part in (a.class_name or ""))]


def actor_ids(dashboard: str) -> set[str]:
    """Every actor id the cluster knows now (to tell a run's actors from earlier tests')."""
    from ray.util.state import list_actors

    return {a.actor_id for a in list_actors(address=dashboard, limit=10_000, raise_on_missing_output=False)}


def slow_steps(seconds: float, log_path: str | Path):
    """An ``after_step`` hook for ``train_drafter`` (picklable): note (step, node id, pid) and sleep, so a test
    can take the worker's node away between two checkpoints."""
    import functools

    return functools.partial(_slow_step, seconds, str(log_path))


def _slow_step(seconds: float, log_path: str, step: int) -> None:
    import ray

    with open(log_path, "a") as f:
        f.write(json.dumps({"step": step, "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()})
                + "\n")
    time.sleep(seconds)
