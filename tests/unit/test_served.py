"""The served measure's pure parts: the agreement rule, the held-out prompts it serves, where it runs, its lines."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.base.console import served_line
from pipeline.generate.sources.engines.config import TransformersSourceConfig, VLLMSourceConfig
from pipeline.generate.sources.http.config import OpenRouterSourceConfig
from pipeline.generate.sources.registry import drafter_server
from pipeline.hidden.served_eval import heldout_prompts
from training.served import agreement, tolerance


def test_tolerance_is_three_standard_errors_of_a_difference_of_rates():
    assert tolerance(0.5, 200, 200) == pytest.approx(3 * math.sqrt(0.25 * 2 / 200))
    assert tolerance(0.5, 2000, 2000) < tolerance(0.5, 200, 200)  # more drafts, tighter
    assert tolerance(1.0, 200, 200) == 0.01  # a rate at its bound still allows a rounding's worth
    assert tolerance(0.5, 0, 200) == 1.0  # nothing measured: nothing can disagree


def test_agreement_flags_a_third_position_that_halves():
    """The issue's served-vs-trained shape (0.35 simulated, 0.17 served at the third position, ~200 drafts
    each) is outside the tolerance; a difference of a few drafts is not."""
    sim = {"per_position": [0.71, 0.56, 0.35], "drafts": 200}
    halved = agreement({"per_position": [0.68, 0.49, 0.17], "drafts": 210}, sim)
    assert not halved["within"] and [abs(r["gap"]) <= r["tolerance"] for r in halved["per_position"]] == \
        [True, True, False]
    close = agreement({"per_position": [0.72, 0.55, 0.33], "drafts": 205}, sim)
    assert close["within"]


def test_heldout_prompts_are_the_samples_own_prompt_ids(tmp_path):
    for i, rows in enumerate([[("a", [1, 2]), ("b", [3])], [("c", [4, 5, 6]), ("a", [1, 2])]]):
        table = pa.table({"sample_id": [r[0] for r in rows], "prompt_ids": [r[1] for r in rows],
                          "output_ids": [[9]] * len(rows)})
        pq.write_table(table, tmp_path / f"part-{i}.parquet")
    assert heldout_prompts(tmp_path, {"a", "c"}) == [[1, 2], [4, 5, 6]]  # one per id, a copy counted once
    assert heldout_prompts(tmp_path, {"z"}) == []


def test_the_drafter_is_served_on_the_first_vllm_source():
    api = OpenRouterSourceConfig(name="api", model="m", api_key_required=False, budgets={"d": 10})
    hf = TransformersSourceConfig(name="hf")
    vllm = VLLMSourceConfig(name="gpu", num_gpus=1)
    assert drafter_server([api, hf, vllm]) is vllm
    assert drafter_server([api, hf]) is None


def test_served_line_says_whether_served_and_simulated_agree():
    base = {"acceptance_length": 2.5, "k": 3, "prompts": 20, "per_position": [0.7, 0.5, 0.3], "drafts": 200}
    ok = served_line(base | {"agreement": {"within": True}}, 30.0)
    assert ok.startswith("[served] acceptance length 2.500 at k=3 in vLLM on 20 held-out prompts, agrees")
    assert "DIFFERS" in served_line(base | {"agreement": {"within": False}}, 30.0)
    assert served_line({"skipped": "no source"}, 0.0) == "[served] no source"
    assert served_line({"error": "RuntimeError: boom"}, 0.0) == "[served] RuntimeError: boom"


def test_the_report_prints_served_beside_held_out_with_the_verdict():
    from pathlib import Path

    from pipeline.report.summary import format_report

    r = {"rows_in": 1, "passed": 1, "quarantined": 0, "quarantine_by_stage": {}, "not_generated": 0, "flagged": {},
         "tokens_generated": 0, "this_attempt": {"cost_usd": 0.0}, "seconds": {}, "audit": {"samples": 0},
         "throughput": {}, "training": {
             "heldout": {"samples": 20, "k": 3, "acceptance_length": 2.5, "per_position": [0.7, 0.5, 0.3],
                         "drafts": 200},
             "served": {"k": 3, "prompts": 20, "acceptance_length": 2.2, "per_position": [0.68, 0.42, 0.1],
                        "drafts": 210, "agreement": {"within": False}}}}
    text = format_report(r, Path("/out"))
    assert ("served       acceptance length 2.200 at k=3 (per position [0.68 0.42 0.10]) in vLLM on the same 20 "
            "prompts, 210 drafts; DIFFERS from the simulated figure beyond sampling noise") in text
    r["training"]["served"] = {"skipped": "no source whose engine serves an EAGLE-3 drafter (kind vllm) in this run"}
    assert "served       no source whose engine serves" in format_report(r, Path("/out"))


def test_a_bad_prompts_file_is_one_clear_error(tmp_path):
    from training.evaluate import PromptFileError, read_prompts

    cases = {"a.jsonl": '[1, 2]\n{"oops"\n', "b.json": '{"x": 1}', "c.json": '[[1, "two"]]', "d.json": "[[]]",
             "e.bin": b"\xff\xfe\x00"}
    for name, body in cases.items():
        path = tmp_path / name
        path.write_bytes(body if isinstance(body, bytes) else body.encode())
        with pytest.raises(PromptFileError, match=name):
            read_prompts(path)
    with pytest.raises(PromptFileError, match="cannot read"):
        read_prompts(tmp_path / "missing.json")
    (tmp_path / "ok.jsonl").write_text('{"prompt_token_ids": [7, 8]}\n[9]\n')
    assert read_prompts(tmp_path / "ok.jsonl") == [[7, 8], [9]]
