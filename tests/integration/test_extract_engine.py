"""Consistency with the serving engine: the target's argmax over captured final states is vLLM's greedy output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.hidden.extract import capture_groups, extract_rows, load_target

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_argmax_of_captured_final_states_reproduces_vllm_greedy_output(tiny_llm, tiny_target):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from pipeline.profiles import load_profile

    profile = load_profile("deepseek", str(tiny_target))
    convs = [json.loads(line) for name in ("chat", "tools") for line in (REPO / f"data/prompts/{name}.jsonl").open()]
    picked = [convs[0], convs[15], convs[20 + 2], convs[20 + 9]]  # single turn, multi-turn, tool results
    rendered = [profile.render_prompt(c["messages"], c.get("tools"), True) for c in picked]
    outs = tiny_llm.generate([TokensPrompt(prompt_token_ids=r.ids) for r in rendered],
                             SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    rows = [{"sample_id": f"s{j}", "dataset": "d", "row_index": j, "prompt_ids": r.ids,
             "prompt_assistant_mask": r.assistant_mask, "output_ids": list(o.outputs[0].token_ids)}
            for j, (r, o) in enumerate(zip(rendered, outs, strict=True))]
    model = load_target(str(tiny_target))[0]
    lm_head = model.lm_head.weight.detach()
    got, bad, _ = extract_rows(rows, lambda s, g: capture_groups(model, s, g, [1, 2, 3], lm_head), max_len=2048,
                               too_long="truncate", batch_tokens=256, hidden=128, n_aux=3)
    assert not bad
    by_id = {r["sample_id"]: r for r in got}
    for row in rows:
        g = by_id[row["sample_id"]]
        p, n = len(row["prompt_ids"]), len(row["output_ids"])
        with torch.inference_mode():
            predicted = (torch.from_numpy(g["final_hidden"][p - 1: p + n - 1]) @ lm_head.T).argmax(-1).tolist()
        assert predicted == row["output_ids"], row["sample_id"]
        assert g["target_ids"][p - 1: p + n - 1].tolist() == row["output_ids"]  # what extraction stores
        assert g["loss_mask"][p:].all() and np.array_equal(g["loss_mask"][:p], row["prompt_assistant_mask"])
    assert sum(len(r["output_ids"]) for r in rows) > 100
