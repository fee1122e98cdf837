"""The Ray Data stages as plain callables (no Ray): render, with the pre-generation length gate."""

from __future__ import annotations

import json

import pyarrow as pa

from pipeline.stages import RenderPrompts


def prompt(i: int, text: str, dataset: str = "chat") -> dict:
    return {"sample_id": f"{dataset}:{i}:h", "dataset": dataset, "row_index": i, "tools": "", "thinking": True,
            "messages": json.dumps([{"role": "user", "content": text}])}


def test_a_prompt_too_long_for_its_dataset_is_quarantined_before_generation():
    """A 200 KB prompt (tens of thousands of tokens) must never reach a source that bills for it."""
    huge = " ".join(f"word{i}" for i in range(40_000))
    rows = [prompt(0, "Name three rivers."), prompt(1, huge), prompt(2, huge, dataset="other")]
    stage = RenderPrompts("deepseek", None, {"chat": 32768})
    out = stage(pa.Table.from_pylist(rows)).to_pylist()
    assert out[0]["status"] == "ok" and 0 < len(out[0]["prompt_ids"]) < 100
    assert (out[1]["status"], out[1]["stage"]) == ("quarantine", "render")
    assert out[1]["reason"].startswith("max_length: prompt of ") and "max_total_tokens 32768" in out[1]["reason"]
    assert out[2]["status"] == "ok" and len(out[2]["prompt_ids"]) > 32768  # no limit configured for "other"
