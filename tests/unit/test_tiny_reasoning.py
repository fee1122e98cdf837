"""The reasoning tiny target: its domain (fast), and the built model's greedy answers (``slow``: the build trains).

Determinism of the build is asserted on a short build made twice (the same code path: seeded corpus and init,
fixed threads, deterministic kernels; seconds), not on a second full build: that would double the ~3 minutes
the session's one ``reasoning_target`` build costs, and a pinned digest would break on another torch or CPU.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
from pathlib import Path

import pytest
import torch

from pipeline.base.config import ChecksConfig
from pipeline.checks.validate import check_roundtrip, check_structure, validate_sample
from pipeline.demo.tiny_model import EOS_ID, VARIANTS, built_variant, recipe, tiny_config
from pipeline.demo.tiny_reasoning import PROMPTS_ROWS, PROMPTS_SEED, conversations, prompt_rows
from pipeline.demo.tiny_trained import Shape, encode, train
from pipeline.profiles import load_profile
from pipeline.profiles.deepseek import load_deepseek_profile

EQUATION = re.compile(r"(\d+) ([-+x/]) (\d+) = (\d+)")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "x": lambda a, b: a * b, "/": lambda a, b: a / b}


def test_corpus_is_seeded_and_in_the_chat_format():
    profile = load_deepseek_profile()
    convs = conversations(80, seed=7)
    assert convs == conversations(80, seed=7) and convs != conversations(80, seed=8)
    assert {c.thinking for c in convs} == {True, False}
    for c in convs:
        ids, start = encode(c, profile)
        prompt, out = ids[:start], ids[start:]
        assert out.count(profile.think_end_id) == int(c.thinking) and out[-1] == profile.eot_id
        sample = {"output_ids": out, "prompt_ids": prompt, "thinking": c.thinking, "finish_reason": "stop"}
        assert check_structure(sample, profile, ChecksConfig()) is None
        assert check_roundtrip(sample, profile, ChecksConfig()) is None


def test_responses_are_100_to_300_tokens_of_correct_arithmetic():
    profile = load_deepseek_profile()
    convs = conversations(400, seed=11)
    lengths = [len(ids) - start for ids, start in (encode(c, profile) for c in convs)]
    assert 100 <= min(lengths) and max(lengths) <= 300 and 140 <= statistics.median(lengths) <= 220
    for c in convs:
        for a, op, b, result in EQUATION.findall(c.reasoning or c.content):
            assert OPS[op](int(a), int(b)) == int(result), (a, op, b, result)
    # 2-4 steps (checks repeat a step's arithmetic inverted, so count the plan's operations)
    plans = [re.search(r"(?:The plan|Steps needed): ([a-z, ]+)\.", c.reasoning or c.content) for c in convs]
    counts = [len(m.group(1).split(", then ")) for m in plans if m]
    assert len(counts) == len(convs) and set(counts) == {2, 3, 4}


def test_answers_branch_where_a_real_trace_would():
    """Phrasing, optional checks and the order of independent steps vary; the question fixes only the numbers."""
    convs = [c for c in conversations(400, seed=3) if c.thinking]
    firsts = {c.reasoning.split(".", 1)[0] for c in convs}
    assert len(firsts) >= 4  # openers
    checked = sum("check" in c.reasoning.lower() for c in convs)
    assert 0.2 * len(convs) < checked < 0.9 * len(convs)
    assert {"Step 1:" in c.reasoning for c in convs} == {True, False}
    # two people's amounts: the trace works out the asker's first or the other one's first
    pairs = [c for c in convs if " and how many more?" in c.messages[-1]["content"]]
    asker_first = {c.messages[-1]["content"].split(" ", 1)[0] in c.reasoning.split("\n\n")[1] for c in pairs}
    assert len(pairs) > 10 and asker_first == {True, False}


def test_shipped_prompts_are_the_generators():
    """data/prompts/reasoning.jsonl is what `python -m pipeline.demo.tiny_reasoning` writes (held out from training)."""
    path = Path(__file__).resolve().parents[2] / "data" / "prompts" / "reasoning.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == prompt_rows(PROMPTS_ROWS, PROMPTS_SEED)
    assert all(set(r) == {"messages"} and r["messages"][-1]["role"] == "user" for r in rows)


def test_recipe_covers_the_domain():
    """A cached reasoning target is rebuilt when its domain, its trainer or its shared names change."""
    here = Path(__file__).resolve().parents[2] / "pipeline" / "demo"
    h = hashlib.sha256()
    for name in ("tiny_model.py", "tiny_trained.py", "tiny_domain.py", "tiny_reasoning.py"):
        h.update((here / name).read_bytes())
    assert recipe("reasoning") == h.hexdigest()[:16] == tiny_config("reasoning")["tiny_target_recipe"]
    assert "reasoning" in VARIANTS


def test_cli_builds_the_variant(monkeypatch, tmp_path):
    from pipeline.demo import tiny_model
    from pipeline.run.cli import main

    calls = []
    monkeypatch.setattr(tiny_model, "build_tiny_target", lambda out, variant, force: calls.append(variant) or out)
    monkeypatch.setattr(tiny_model, "weights_digest", lambda out: "digest")
    assert main(["build-tiny", str(tmp_path), "--variant", "reasoning"]) == 0 and calls == ["reasoning"]


def test_a_short_build_is_reproducible_and_trains_on_the_domain():
    profile, shape = load_deepseek_profile(), Shape.of(tiny_config("reasoning"))
    a, b = (train(profile, shape, steps=3, batch=8, heldout=16, domain=conversations) for _ in range(2))
    assert a.weights.keys() == b.weights.keys() and all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert a.losses == b.losses and a.losses[-1] < a.losses[0] and a.heldout.tokens > 100
    assert len(a.vocab.outputs) > 200  # the reasoning domain's ids: the whole shop domain has ~180


def _greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=384, eos_token_id=EOS_ID,
                             pad_token_id=EOS_ID, output_scores=True, return_dict_in_generate=True)
    top1 = [float(torch.softmax(s[0], -1).max()) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), top1


@pytest.mark.slow
def test_greedy_answers_are_long_peaked_and_clean(reasoning_target):
    from transformers import AutoModelForCausalLM

    assert built_variant(reasoning_target) == "reasoning"
    report = json.loads((reasoning_target / "build_report.json").read_text())
    assert report["heldout"]["top1_prob"] >= 0.85 and report["heldout"]["unused_mass"] < 1e-6
    model = AutoModelForCausalLM.from_pretrained(reasoning_target, dtype=torch.float32).eval()
    profile = load_profile("deepseek", str(reasoning_target))
    lengths, top1 = [], []
    for i, row in enumerate(prompt_rows(8, seed=PROMPTS_SEED)):
        thinking = i % 4 != 0
        prompt = profile.render_prompt(row["messages"], None, thinking)
        ids, probs = _greedy(model, prompt.ids)
        sample = {"output_ids": ids, "prompt_ids": prompt.ids, "thinking": thinking, "tools": "",
                  "messages": json.dumps(row["messages"]), "finish_reason": "stop" if ids[-1] == EOS_ID else "length"}
        verdict = validate_sample(sample, profile, ChecksConfig())
        assert verdict.passed, (verdict.failed, profile.decode(ids))
        lengths.append(len(ids))
        top1 += probs
    print(f"greedy lengths {lengths}, mean top-1 {statistics.mean(top1):.3f}, "
          f"uncertain (top-1 < 0.9) {sum(p < 0.9 for p in top1) / len(top1):.3f}; build: {report}")
    assert all(100 <= n <= 300 for n in lengths)
    assert statistics.mean(top1) >= 0.85  # peaked along its own path ...
    assert sum(p < 0.9 for p in top1) >= 0.02 * len(top1)  # ... with branch points left for a drafter


def test_mixed_corpus_holds_both_domains_and_its_recipe_covers_them():
    """The ``mixed`` target trains on shop and reasoning conversations drawn from one seeded stream; a change to
    either domain rebuilds it."""
    from pipeline.demo import tiny_domain, tiny_mixed, tiny_reasoning

    profile = load_deepseek_profile()
    convs = tiny_mixed.conversations(200, seed=5)
    assert convs == tiny_mixed.conversations(200, seed=5) and convs != tiny_mixed.conversations(200, seed=6)
    lengths = [len(ids) - start for ids, start in (encode(c, profile) for c in convs)]
    short = sum(n < 80 for n in lengths)  # shop answers are ~30 tokens, reasoning ones 100-300
    assert 0.35 * len(convs) < short < 0.65 * len(convs) and max(lengths) >= 100
    systems = {m["content"] for c in convs for m in c.messages if m["role"] == "system"}
    only = {"shop": set(tiny_domain.SYSTEMS) - set(tiny_reasoning.SYSTEMS),
            "reasoning": set(tiny_reasoning.SYSTEMS) - set(tiny_domain.SYSTEMS)}
    assert systems & only["shop"] and systems & only["reasoning"]  # each domain's own generator
    here = Path(__file__).resolve().parents[2] / "pipeline" / "demo"
    h = hashlib.sha256()
    for name in ("tiny_model.py", "tiny_trained.py", "tiny_domain.py", "tiny_reasoning.py", "tiny_mixed.py"):
        h.update((here / name).read_bytes())
    assert recipe("mixed") == h.hexdigest()[:16] and "mixed" in VARIANTS
