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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerNode:
    """One extra Ray node on the session's head, with its own ports and a small object store."""

    def __init__(self, head_address: str, env: Mapping[str, str], temp_dir: Path, *, num_cpus: float = 1,
                 resources: Mapping[str, float] | None = None, object_store_bytes: int = 200 * 1024**2) -> None:
        self.head_address = head_address
        self.resources = dict(resources or {})
        self.num_cpus = num_cpus
        self.node_manager_port = free_port()
        self.log = Path(temp_dir) / f"worker-node-{self.node_manager_port}.log"
        # Every service on a port of its own: the defaults (e.g. the agent's 52365) would clash between nodes.
        ports = [f"--node-manager-port={self.node_manager_port}", f"--object-manager-port={free_port()}",
                 f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                 f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]
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

    def remove(self) -> None:
        """Kill it (if still up) and wait until Ray no longer counts it; the finalizer of every test."""
        if not self.killed:
            self.kill()
        if self.node_id:
            self.wait_dead()


class Nodes:
    """The worker nodes a test added; ``remove_all`` runs in its fixture's finalizer."""

    def __init__(self, head_address: str, env: Mapping[str, str], temp_dir: Path) -> None:
        self.head_address, self.env, self.temp_dir = head_address, env, temp_dir
        self.added: list[WorkerNode] = []

    def add(self, *, num_cpus: float = 1, resources: Mapping[str, float] | None = None,
            wait: bool = True) -> WorkerNode:
        node = WorkerNode(self.head_address, self.env, self.temp_dir, num_cpus=num_cpus, resources=resources)
        self.added.append(node)
        if wait:
            node.wait_alive()
        return node

    def remove_all(self) -> None:
        errors = []
        for node in self.added:
            try:
                node.remove()
            except Exception as e:  # noqa: BLE001 - remove every node, then report
                errors.append(e)
        self.added.clear()
        if errors:
            raise errors[0]


