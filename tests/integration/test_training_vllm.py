"""End-to-end proof of the export format: train on a tiny target's own greedy outputs, then let
vLLM (CPU build) load the drafter with method `eagle3` and measure acceptance.

The module runs `python -m training.evaluate` once: a spec-decode engine, then a target-only one, each
in a spawned process that exits before the next starts.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.training import easy_run
from training.export import export_draft
from training.target import load_target_parts

pytestmark = pytest.mark.slow

K = 3  # the drafter's aux ids are explicit ([1, 2, 3]): vLLM's default collides on 4 layers


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(target dir, export dir, held-out rows, simulated acceptance trained/untrained)."""
    run = easy_run()  # greedy data of a 1000-token random Llama + 60 training steps
    parts = load_target_parts(run.target_dir)
    export = export_draft(run.drafter, tmp_path_factory.mktemp("vllm-drafter") / "export", target_config=parts.config)
    return run.target_dir, export, run.held_rows, run.trained, run.untrained


@pytest.fixture(scope="module")
def cli_report(trained, tmp_path_factory):
    """`python -m training.evaluate` on the held-out prompts: a spec-decode engine, then a target-only
    engine, each in its own spawned process (one engine alive at a time)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from training.evaluate import main

    target, export, held, *_ = trained
    prompts = tmp_path_factory.mktemp("eval") / "held.json"
    prompts.write_text(json.dumps([prompt_of(r) for r in held]))
    out = prompts.parent / "report.json"
    report = main(["--target", str(target), "--draft", str(export), "--prompts", str(prompts), "--k", str(K),
                   "--max-tokens", "48", "--max-model-len", "512", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    return report


def prompt_of(row: dict) -> list[int]:
    return row["input_ids"][: int(row["loss_mask"].argmax())].tolist()


def test_vllm_loads_export_and_acceptance_matches_simulation(trained, cli_report):
    _, _, held, sim, untrained = trained
    report = cli_report["spec"]
    print("vLLM", {k: report[k] for k in ("acceptance_length", "per_position_acceptance", "num_drafts")},
          "simulated", sim, "untrained", untrained)
    assert cli_report["num_prompts"] == len(held)
    assert untrained.acceptance_length < 1.05
    assert report["acceptance_length"] >= 1.25  # untrained drafters give 1.00
    # the engine's acceptance agrees with the pure-torch simulation: same aux-layer convention,
    # positions, hidden-state feedback and d2t mapping on both sides
    assert report["acceptance_length"] == pytest.approx(sim.acceptance_length, abs=0.05)
    for got, want in zip(report["per_position_acceptance"], sim.per_position, strict=True):
        assert got == pytest.approx(want, abs=0.05)


def test_greedy_spec_decoding_reproduces_the_target(trained, cli_report):
    """Speculative decoding is lossless: its greedy outputs equal the target-only engine's."""
    _, _, held, *_ = trained
    assert cli_report["identical_outputs"] >= (len(held) - 1) / len(held)  # allow one float near-tie
    assert cli_report["target_only"]["tokens"] == cli_report["spec"]["tokens"] == 48 * len(held)
    assert cli_report["speedup"] > 0


def test_evaluate_cli_reads_token_id_prompts(tmp_path):
    from training.evaluate import read_prompts

    (tmp_path / "a.json").write_text("[[1, 2, 3], [4, 5]]")
    (tmp_path / "b.jsonl").write_text('{"prompt_token_ids": [7, 8]}\n[9]\n')
    assert read_prompts(tmp_path / "a.json") == [[1, 2, 3], [4, 5]]
    assert read_prompts(tmp_path / "b.jsonl") == [[7, 8], [9]]
