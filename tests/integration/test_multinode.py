"""Multi-node behaviour on one machine: worker nodes join the session's Ray head (tests.helpers.cluster), carry
custom resources that pin work to them, and are lost the way a machine is (every process SIGKILLed at once).

Generation runs as a user runs it (`python -m pipeline run` against the local OpenRouter-compatible server,
`--no-model`: cheap), and ends with the fault matrix's accounting: each input row exactly once across samples +
quarantine + to do, `status` equal to the files, the provider's bill under the budget cap and never above what
the ledger committed. Training runs through `train_drafter` (Ray Train) with its worker pinned to a node by a
custom resource in `resources_per_worker`.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.generate.ledger import read_journal
from tests.helpers.cluster import Nodes, WorkerNode, slow_steps
from tests.integration.test_api_failures import (
    KEY,
    MAX_TOKENS,
    ROWS,
    Server,
    check_accounting,
    free_port,
    no_driver_outlives_its_test,  # noqa: F401 - autouse here too: a failed test kills its run
    run,
    start_run,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow

FLIGHT = "OpenRouterFlight"  # the HTTP source's Ray Data actor: repr "MapWorker(MapBatches(OpenRouterFlight))"


@pytest.fixture
def env(ray_head) -> dict[str, str]:
    return {**ray_head.env, "RAY_ADDRESS": ray_head.address, "FAULT_MATRIX_KEY": KEY}


@pytest.fixture
def nodes(ray_head, ray_session):
    """Worker nodes added by one test; all killed and seen dead by Ray when it ends, whatever happened."""
    added = Nodes(ray_head.address, {**ray_head.env, "FAULT_MATRIX_KEY": KEY}, Path(ray_head.temp_dir),
                  ray_head.dashboard)
    try:
        yield added
    finally:
        added.remove_all()


def alive_on(nodes: Nodes, before: set[str], repr_part: str) -> dict[str, str]:
    """actor id -> node id of this run's actors of ``repr_part`` that are alive now."""
    return {a.actor_id: a.node_id for a in nodes.actors_since(before, repr_part) if a.state == "ALIVE"}


def ledger_nodes(nodes: Nodes, before: set[str]) -> list[str]:
    """Node ids of this run's budget ledger actors."""
    return [a.node_id for a in nodes.actors_since(before, "Ledger") if a.class_name == "Ledger"]


def spend_line(cfg: Path, billed: int, budget: int, st: dict) -> str:
    t = st["totals"]
    committed = read_journal(str(cfg.parent / "out" / "ledger-api.json")).get("chat", 0)
    return (f"rows {t['rows']}: passed {t['passed']}, quarantined {t['quarantined']}, to do {t['to_do']}; "
            f"server billed {billed} <= budget {budget}; ledger committed {committed}")


def check_spend(cfg: Path, billed: int, budget: int) -> None:
    """The provider's bill is under the cap, and the ledger never committed less than the provider billed."""
    committed = read_journal(str(cfg.parent / "out" / "ledger-api.json")).get("chat", 0)
    assert billed <= budget, (billed, budget)
    assert committed <= budget and billed <= committed, (billed, committed, budget)


def test_http_source_actors_run_only_on_the_node_with_their_resource(tmp_path, repo_root, tiny_target, env, nodes):
    """`resources: {api_node: 1}` keeps every actor of the source on the one node that carries `api_node`, while a
    second worker node and the head take the rest of the run; all outputs land in the one output folder."""
    api = nodes.add(num_cpus=1, resources={"api_node": 2})
    plain = nodes.add(num_cpus=1)
    budget = ROWS * MAX_TOKENS
    port = free_port()
    cfg = write_config(tmp_path, repo_root, tiny_target, port, budget=budget, num_actors=2,
                       resources={"api_node": 1})
    before = nodes.actor_ids()
    server = Server(tmp_path, port, "--delay-ms", "100", "--api-key-env", "FAULT_MATRIX_KEY", env=env)
    try:
        res = run(cfg, env)
    finally:
        billed = server.stop()["billed_completion_tokens"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    flight = nodes.actors_since(before, FLIGHT)
    assert len(flight) == 2, [(a.repr_name, a.state) for a in flight]
    assert {a.node_id for a in flight} == {api.node_id}, "an HTTP source actor ran off its api_node"
    assert all(a.num_restarts == 0 for a in flight)
    # the ledger sits with the driver on the head, never on a worker node whose loss would take the budget with it
    assert ledger_nodes(nodes, before) == [nodes.head_node_id()]
    st = check_accounting(cfg, expect_to_do=0)
    check_spend(cfg, billed, budget)
    names = {api.node_id: "api", plain.node_id: "plain"}
    placed = sorted((a.repr_name or a.class_name, names.get(a.node_id, "head"))
                    for a in nodes.actors_since(before, ""))
    print("placement:", placed)
    print(spend_line(cfg, billed, budget, st))


def pinned_api_run(tmp_path: Path, repo_root: Path, tiny_target: Path, env: dict[str, str]
                   ) -> tuple[Path, int, Server]:
    """(config, budget, server) of a run whose HTTP source needs `api_node`, against a slow server (1 s a
    request). The budget has room for the requests in flight on a lost node (max_in_flight 4): they stay
    reserved, as billed."""
    budget = (ROWS + 4) * MAX_TOKENS
    port = free_port()
    cfg = write_config(tmp_path, repo_root, tiny_target, port, budget=budget, resources={"api_node": 1},
                       request_timeout_s=30.0)
    return cfg, budget, Server(tmp_path, port, "--delay-ms", "1000", "--api-key-env", "FAULT_MATRIX_KEY", env=env)


def test_losing_the_http_node_mid_run_moves_its_actor_and_nothing_is_lost_or_doubled(
        tmp_path, repo_root, tiny_target, env, nodes):
    """Two nodes carry `api_node`; the one holding the source's actor is killed after the API served some
    requests (its requests in flight die with it). Ray restarts the actor on the other node and re-runs the
    lost batches: the run finishes, each row once, and the stranded reservations keep the bill under the cap."""
    a, b = nodes.add(num_cpus=1, resources={"api_node": 1}), nodes.add(num_cpus=1, resources={"api_node": 1})
    by_id = {a.node_id: a, b.node_id: b}
    before = nodes.actor_ids()
    cfg, budget, server = pinned_api_run(tmp_path, repo_root, tiny_target, env)
    try:
        driver = start_run(cfg, env)
        holder = next(iter(wait_for(lambda: alive_on(nodes, before, FLIGHT), 300, "alive HTTP actor", driver).values()))
        wait_for(lambda: server.counts().get("served", 0) >= 4, 300, "4 served requests", driver, poll=0.05)
        lost: WorkerNode = by_id[holder]
        lost.kill()
        served_at_kill = server.counts().get("served", 0)
        text, _ = driver.communicate(timeout=600)
    finally:
        billed = server.stop()["billed_completion_tokens"]
    assert driver.returncode == 0, text[-4000:]
    assert served_at_kill < ROWS, "the node was lost after the work was done"
    survivor = b if lost is a else a
    flight = nodes.actors_since(before, FLIGHT)
    assert len(flight) == 1 and flight[0].num_restarts >= 1, [(f.state, f.num_restarts) for f in flight]
    assert flight[0].node_id == survivor.node_id, "the restarted actor should run on the surviving api node"
    assert ledger_nodes(nodes, before) == [nodes.head_node_id()]
    st = check_accounting(cfg, expect_to_do=0)
    check_spend(cfg, billed, budget)
    print(spend_line(cfg, billed, budget, st))


def test_losing_the_only_http_node_waits_for_a_replacement_then_finishes(
        tmp_path, repo_root, tiny_target, env, nodes):
    """The only node that carries `api_node` is killed mid-run. Ray Data keeps the actor (max_restarts -1) and
    waits for a node to place it on: the run neither fails nor spends meanwhile (on a cluster the autoscaler
    starts a replacement). A replacement node joins; the run finishes there, each row once, under the cap."""
    first = nodes.add(num_cpus=1, resources={"api_node": 1})
    before = nodes.actor_ids()
    cfg, budget, server = pinned_api_run(tmp_path, repo_root, tiny_target, env)
    try:
        driver = start_run(cfg, env)
        wait_for(lambda: server.counts().get("served", 0) >= 4, 300, "4 served requests", driver, poll=0.05)
        first.kill()
        first.wait_dead()
        asked = server.counts().get("requests", 0)
        time.sleep(10)  # no node can take the actor: nothing is asked, and the run waits instead of failing
        assert driver.poll() is None, driver.stdout.read()[-3000:] if driver.stdout else ""
        assert server.counts().get("requests", 0) == asked
        replacement = nodes.add(num_cpus=1, resources={"api_node": 1})
        text, _ = driver.communicate(timeout=600)
    finally:
        billed = server.stop()["billed_completion_tokens"]
    assert driver.returncode == 0, text[-4000:]
    flight = nodes.actors_since(before, FLIGHT)
    assert len(flight) == 1 and flight[0].node_id == replacement.node_id and flight[0].num_restarts >= 1
    st = check_accounting(cfg, expect_to_do=0)
    check_spend(cfg, billed, budget)
    print(f"asked {asked} before the loss; " + spend_line(cfg, billed, budget, st))


def scaling_lines(ray_temp_dir: Path, since: float, stage: str) -> list[str]:
    """Ray Data's actor-pool scaling decisions for ``stage`` in the datasets the head logged after ``since``
    (the driver's Ray Data debug log, OUTPUT-independent: ``<temp>/session_latest/logs/ray-data/``)."""
    logs = Path(ray_temp_dir) / "session_latest" / "logs" / "ray-data"
    return [ln for f in sorted(logs.glob("ray-data-dataset_*.log")) if f.stat().st_mtime >= since
            for ln in f.read_text(errors="replace").splitlines()
            if re.search(r"Scal(ing|ed) (up|down) MapWorker\(MapBatches\(" + stage + r"\)\)", ln)]


def test_http_pool_grows_onto_a_node_added_mid_run_and_shrinks_when_the_queue_drains(
        tmp_path, repo_root, tiny_target, env, nodes, ray_head):
    """A pool of 1..2 actors starts on the only `api_node` node; its queue backs up (a stalled API) and Ray Data
    asks for a second actor, which waits for resources until a second `api_node` node joins mid-run and then
    serves there. Once every batch is handed out, the pool releases an idle actor before the run ends."""
    a = nodes.add(num_cpus=1, resources={"api_node": 1})
    budget = ROWS * MAX_TOKENS
    port = free_port()
    cfg = write_config(tmp_path, repo_root, tiny_target, port, budget=budget, resources={"api_node": 1},
                       num_actors=1, max_actors=2, batch_size=2, max_in_flight=2, request_timeout_s=600.0)
    before, t0 = nodes.actor_ids(), time.time()
    # The provider stalls until the second actor is up, however long the node takes to join on a loaded machine
    # (the first run of this test without the stall lost that race on CI); then 8 batches of 2 at 2 s each.
    hold = tmp_path / "hold"
    hold.touch()
    server = Server(tmp_path, port, "--delay-ms", "2000", "--api-key-env", "FAULT_MATRIX_KEY", "--hold-file",
                    str(hold), env=env)
    try:
        driver = start_run(cfg, env)
        wait_for(lambda: server.counts().get("requests", 0) >= 1, 300, "a first request", driver, poll=0.1)
        b = nodes.add(num_cpus=1, resources={"api_node": 1})
        on_b = wait_for(lambda: b.node_id in alive_on(nodes, before, FLIGHT).values(), 300,
                        "an HTTP actor on the new node", driver)
        served_before_growth = server.counts().get("served", 0)
        hold.unlink()
        text, _ = driver.communicate(timeout=600)
    finally:
        hold.unlink(missing_ok=True)
        billed = server.stop()["billed_completion_tokens"]
    assert on_b and driver.returncode == 0, text[-4000:]
    assert served_before_growth == 0, "the stalled provider answered before the pool grew"
    flight = nodes.actors_since(before, FLIGHT)
    assert sorted(n for n in (f.node_id for f in flight)) == sorted([a.node_id, b.node_id]), \
        [(f.node_id, f.state) for f in flight]
    lines = scaling_lines(Path(ray_head.temp_dir), t0, FLIGHT)
    ups = [ln for ln in lines if "Scaling up" in ln and "initial size" not in ln]
    downs = [ln for ln in lines if "Scaled down" in ln]
    assert ups and "utilization" in ups[0], lines
    # the first release, once every batch was handed out, leaves one actor running (2 -> 1 before the end)
    assert downs and "consumed all inputs" in downs[0] and "running=1," in downs[0], lines
    st = check_accounting(cfg, expect_to_do=0)
    check_spend(cfg, billed, budget)
    print("scaling:", *[ln.split(" -- ", 1)[-1][:160] for ln in ups + downs], sep="\n  ")
    print(spend_line(cfg, billed, budget, st))


# ----------------------------------------------------------------------------- training

AUX_IDS = [1, 2, 3]  # the tiny target's 4 layers (as in test_training_ray)


@pytest.fixture(scope="module")
def train_rows(tiny_target: Path) -> list[dict]:
    from tests.helpers.training import generated_rows, random_prompts, torch_threads

    with torch_threads(1):
        return generated_rows(tiny_target, random_prompts(16, 120_000, (8, 24), seed=1), 24, AUX_IDS)


def test_losing_the_train_workers_node_resumes_from_its_checkpoint_on_another(
        tmp_path, tiny_target, nodes, train_rows):
    """The Ray Train worker is pinned to nodes carrying `train_node` (resources_per_worker). Its node is killed
    between checkpoints; with max_failures 1 the group restarts on the other such node from the last committed
    checkpoint, ends at the configured step, and exports a drafter bit-identical to an uninterrupted run."""
    from tests.helpers.training import torch_threads
    from training.config import DraftTrainConfig
    from training.export import load_exported
    from training.target import load_target_parts
    from training.train import RUN_NAME, train_drafter, train_loop
    from training.vocab import build_vocab_mapping

    a, b = nodes.add(num_cpus=1, resources={"train_node": 1}), nodes.add(num_cpus=1, resources={"train_node": 1})
    by_id = {a.node_id: a, b.node_id: b}
    cfg = DraftTrainConfig(steps=9, batch_tokens=512, max_len=128, draft_vocab_size=1024, aux_layer_ids=AUX_IDS,
                           ttt_steps=3, lr=2e-3, warmup_steps=2, checkpoint_every=3, log_every=3, shuffle_buffer=16,
                           max_failures=1, resources_per_worker={"CPU": 1, "train_node": 1})
    out, steps_log = tmp_path / "run", tmp_path / "steps.jsonl"
    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            outcome["result"] = train_drafter(train_rows, cfg, tiny_target, out, after_step=slow_steps(2.0, steps_log))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = e

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    snapshot = out / "ray" / RUN_NAME / "checkpoint_manager_snapshot.json"
    wait_for(lambda: snapshot.exists() and "step_0000003" in snapshot.read_text(), 400, "checkpoint at step 3")
    steps = [json.loads(ln) for ln in steps_log.read_text().splitlines()]
    lost = by_id[steps[-1]["node"]]
    committed = max(int(m) for m in re.findall(r"step_(\d{7})", snapshot.read_text()))
    lost.kill()
    thread.join(600)
    assert not thread.is_alive(), "training did not finish within 10 minutes of the node loss"
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    assert result.metrics["step"] == cfg.steps
    logged = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, cfg.steps + 1))
    steps = [json.loads(ln) for ln in steps_log.read_text().splitlines()]
    survivor = b if lost is a else a
    before_loss = [s for s in steps if s["node"] == lost.node_id]
    after_loss = [s for s in steps if s["node"] != lost.node_id]
    assert {s["node"] for s in after_loss} == {survivor.node_id}, "the restarted worker ran off its train_node nodes"
    first_again = after_loss[0]["step"]
    # resumed from a committed checkpoint (the one seen before the kill, or one committed just after it), not step 0
    assert first_again - 1 in range(committed, before_loss[-1]["step"] + 1, cfg.checkpoint_every), \
        (committed, before_loss[-1], first_again)
    assert [s["step"] for s in after_loss] == list(range(first_again, cfg.steps + 1))
    parts = load_target_parts(tiny_target)
    exported = load_exported(result.export_dir, parts)
    vocab = build_vocab_mapping(train_rows, parts.vocab_size, cfg.draft_vocab_size)
    with torch_threads(1):
        reference, _ = train_loop(cfg, tiny_target, tmp_path / "ref", lambda e: train_rows, vocab)
    for k, v in reference.trainable_state_dict().items():
        torch.testing.assert_close(exported.trainable_state_dict()[k], v, rtol=0, atol=0, msg=k)
    print(f"train worker: steps {before_loss[0]['step']}-{before_loss[-1]['step']} on the lost node, "
          f"{first_again}-{cfg.steps} on the survivor (checkpoint committed at kill: step {committed})")


ENGINE = "TransformersGenerator"  # a local engine source's actor, cheap enough to run on a 1-CPU worker node


def test_losing_the_engine_node_mid_run_restarts_the_engine_elsewhere(tmp_path, repo_root, clean_target, env,
                                                                       nodes):
    """A local engine source pinned by `resources: {engine_node: 1}` runs only on the nodes that carry it (never
    on the head). The node holding the engine actor is killed while it generates: Ray restarts the actor, with a
    fresh engine, on the other engine node and re-runs the lost batches; the run finishes with every row exactly
    once. (Half a CPU: the pipeline's small stage actors may take a slice of a 1-CPU node; on a cluster the engine
    asks for GPUs, which they never take.)"""
    import yaml

    a, b = nodes.add(num_cpus=1, resources={"engine_node": 1}), nodes.add(num_cpus=1, resources={"engine_node": 1})
    by_id = {a.node_id: a, b.node_id: b}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "out"),
        "model": {"profile": "deepseek", "path": str(clean_target)},
        "sampling": {"max_tokens": 96, "temperature": 1.0, "seed": 0},
        "datasets": [{"name": "chat", "path": str(repo_root / "data/prompts/chat.jsonl"), "max_rows": ROWS}],
        "sources": [{"kind": "transformers", "name": "hf", "num_actors": 1, "num_cpus": 0.5, "batch_size": 2,
                     "resources": {"engine_node": 1}}],
        "training": None,
    }))
    before = nodes.actor_ids()
    driver = start_run(cfg, env)
    holder = next(iter(wait_for(lambda: alive_on(nodes, before, ENGINE), 300, "alive engine actor", driver).values()))
    time.sleep(3)  # the engine is loaded and generating its first batches
    lost: WorkerNode = by_id[holder]
    lost.kill()
    text, _ = driver.communicate(timeout=600)
    assert driver.returncode == 0, text[-4000:]
    survivor = b if lost is a else a
    engines = nodes.actors_since(before, ENGINE)
    assert len(engines) == 1 and engines[0].num_restarts >= 1, [(e.state, e.num_restarts) for e in engines]
    assert engines[0].node_id == survivor.node_id, "the restarted engine actor runs on the other engine node"
    st = check_accounting(cfg, expect_to_do=0)
    t = st["totals"]
    print(f"rows {t['rows']}: passed {t['passed']}, quarantined {t['quarantined']}, to do {t['to_do']}")


def test_a_folder_or_file_a_node_does_not_see_stops_the_run_before_it_starts(tmp_path, nodes, monkeypatch):
    """The shared-paths check (pipeline.run.shared_paths) on real nodes: each alive node reads the driver's token
    back from the output folder (one filesystem here, so all do) and looks for the run's files; a file no node
    sees is named per node, as a config error, and the token file is gone afterwards."""
    from pipeline.base.config import ConfigError
    from pipeline.base.layout import RunLayout
    from pipeline.run import shared_paths

    worker = nodes.add(num_cpus=1)
    layout = RunLayout(tmp_path / "out")
    layout.root.mkdir()
    seen = tmp_path / "prompts.jsonl"
    seen.write_text("{}\n")
    monkeypatch.setattr(shared_paths, "paths_to_check", lambda cfg: [str(seen)])
    shared_paths.check_shared_paths(None, layout)  # every node sees both: no error
    missing = str(tmp_path / "gone.jsonl")
    monkeypatch.setattr(shared_paths, "paths_to_check", lambda cfg: [str(seen), missing])
    with pytest.raises(ConfigError, match="same path on every node") as e:
        shared_paths.check_shared_paths(None, layout)
    assert str(e.value).count(f"{missing} is missing") == 2  # the head and the worker node, each named
    assert worker.node_id[:8] in str(e.value) and nodes.head_node_id()[:8] in str(e.value)
    assert not (layout.root / shared_paths.TOKEN_FILE).exists()
