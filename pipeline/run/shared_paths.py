"""The output folder, the prompt files and the model folder at the same path on every node, or the run stops.

Actors on every node write into the output folder (the journals of paid responses, the shards, the engines'
notes) and read the dataset files and the model folder's tokenizer. A folder on one node's own disk splits a
run: each node writes its own copy at the same path, a resume on the driver's node does not see what the others
paid for and pays for it again, and their samples never reach the report. Before generation the driver writes a
fresh token into the output folder, and one zero-CPU task pinned to each alive node reads it back and looks for
the dataset files and the model folder; a node that reads another token or none, or misses a file, stops the run
before anything is spent (a config error, exit 2), naming the node and the path. A local Ray (one node) has
nothing to check; a node that joins later is not checked.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.base.config import ConfigError
from pipeline.base.layout import RunLayout, atomic_write

if TYPE_CHECKING:
    from pipeline.run.config import RunConfig

log = logging.getLogger(__name__)

TOKEN_FILE = ".shared-check"  # in the output folder while the check runs
ANSWER_S = 60.0  # how long a node has to answer; one that does not is warned about, not failed


def node_problems(root: str, token: str, paths: Sequence[str]) -> list[str]:
    """What this node does not see as the driver does: the token the driver wrote into the output folder
    ``root``, and each of ``paths``. Total: an unreadable file is a problem named, never an exception."""
    problems = []
    try:
        seen: str | None = (Path(root) / TOKEN_FILE).read_text()
    except (OSError, UnicodeDecodeError):
        seen = None
    if seen != token:
        why = "does not have the driver's check file" if seen is None else "holds another run's check file"
        problems.append(f"the output folder {root} {why}: it is not the driver's folder")
    problems += [f"{p} is missing" for p in paths if not Path(p).exists()]
    return problems


def paths_to_check(cfg: RunConfig) -> list[str]:
    """The dataset files and the model folder, where they are paths the driver sees (a name it does not see as
    a path, e.g. a hub id, is not this check's business)."""
    out = [d.path for d in cfg.datasets if Path(d.path).exists()]
    if cfg.model.path and Path(cfg.model.path).exists():
        out.append(cfg.model.path)
    return out


def check_shared_paths(cfg: RunConfig, layout: RunLayout, answer_s: float = ANSWER_S) -> None:
    """Raise ``ConfigError`` naming every node that does not see the run's folder and files as the driver does
    (see the module doc); a no-op on one node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return
    token = uuid.uuid4().hex
    marker = layout.root / TOKEN_FILE
    atomic_write(marker, token)
    task = ray.remote(num_cpus=0, max_retries=0)(node_problems)
    paths = paths_to_check(cfg)
    try:
        refs = {f"{n.get('NodeManagerAddress')} ({n['NodeID'][:8]})":
                task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(str(layout.root), token, paths) for n in nodes}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=answer_s)
        problems = []
        for node, ref in refs.items():
            if ref not in ready:
                ray.cancel(ref, force=True)
                log.warning("node %s did not answer the shared-folder check within %.0f s: not checked", node,
                            answer_s)
                continue
            try:
                problems += [f"node {node}: {p}" for p in ray.get(ref)]
            except Exception as e:  # noqa: BLE001 - a node lost meanwhile is not this check's to judge
                log.warning("node %s could not run the shared-folder check (%s): not checked", node, e)
    finally:
        marker.unlink(missing_ok=True)
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ConfigError("the output folder, the dataset files and the model folder must be at the same path on "
                          f"every node (a shared filesystem): {shown}")
