"""EAGLE-3.1 through a real engine, on the reasoning target: train a drafter with fc_norm + norm_output on the
target's own greedy step-by-step answers, let vLLM (CPU build) serve its export with method `eagle3` at k=5,
and check that the served acceptance equals the simulated one position by position -- which it only does
when vLLM reads both flags, the norm weights land on its `model.fc_norm.{i}` parameters, and the simulation
counts drafts as vLLM does (the last rounds of an answer included).

One spawned spec-decode engine (`training.served.served_vs_simulated`, one k).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from pipeline.demo.tiny_reasoning import prompt_rows
from pipeline.profiles import load_profile
from tests.helpers.training import load_hf_target, rows_from_target, torch_threads
from training.config import DraftTrainConfig
from training.export import export_draft
from training.simulate import simulate_acceptance
from training.target import load_target_parts
from training.train import train_loop
from training.vocab import build_vocab_mapping

pytestmark = pytest.mark.slow

K = 5
AUX = [1, 2, 3]  # 4 layers: vLLM's default ids collide
MAX_TOKENS = 384


@torch.no_grad()
def greedy_answers(model, prompts: list[list[int]], eos: int, batch: int = 32) -> list[list[int]]:
    """The target's greedy answers up to and including the end of turn (HF generate, left padding)."""
    out = []
    for s in range(0, len(prompts), batch):
        chunk = prompts[s : s + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)[:, width:].tolist()
        out += [g[: g.index(eos) + 1] if eos in g else g for g in gen]
    return out


@pytest.fixture(scope="module")
def trained31(reasoning_target, tmp_path_factory):
    """(export dir, held-out prompts, simulated stats, the same with pre-norm feedback)."""
    profile = load_profile("deepseek")
    train = [profile.render_prompt(r["messages"], None, True).ids for r in prompt_rows(64, seed=1)]
    held = [p for p in (profile.render_prompt(r["messages"], None, True).ids for r in prompt_rows(40, seed=2))
            if p not in train][:16]
    eos = json.loads((reasoning_target / "config.json").read_text())["eos_token_id"]
    with torch_threads(1):
        model = load_hf_target(reasoning_target)
        answers = greedy_answers(model, train + held, eos)
        rows = rows_from_target(reasoning_target, [p + a for p, a in zip(train + held, answers, strict=True)],
                                [[0] * len(p) + [1] * len(a) for p, a in zip(train + held, answers, strict=True)],
                                AUX, model=model)
        train_rows, held_rows = rows[: len(train)], rows[len(train):]
        assert min(len(a) for a in answers) >= 60, "the reasoning target's answers should be long"
        cfg = DraftTrainConfig(steps=60, batch_tokens=2048, max_len=2048, draft_vocab_size=512, aux_layer_ids=AUX,
                               ttt_steps=K, lr=3e-3, warmup_steps=10, checkpoint_every=10_000, log_every=20,
                               trackers=[], fc_norm=True, norm_output=True)
        parts = load_target_parts(reasoning_target)
        vocab = build_vocab_mapping(train_rows, parts.vocab_size, cfg.draft_vocab_size)
        root = tmp_path_factory.mktemp("eagle31")
        drafter, _ = train_loop(cfg, reasoning_target, root / "run", lambda epoch: train_rows, vocab)
        assert drafter.fc_norm is not None and drafter.norm_output, "train_loop ignored the EAGLE-3.1 flags"
        sim = simulate_acceptance(drafter, held_rows, parts.lm_head, k=K)
        drafter.norm_output = False  # what an engine that ignored norm_output would do
        sim_prenorm = simulate_acceptance(drafter, held_rows, parts.lm_head, k=K)
        drafter.norm_output = True
    export = export_draft(drafter, root / "export", target_config=parts.config)
    return export, held, sim, sim_prenorm


def test_vllm_serves_an_eagle31_export_exactly_as_simulated(reasoning_target, trained31):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from training.served import served_vs_simulated

    export, held, sim, sim_prenorm = trained31
    config = json.loads((export / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert "norm_before_fc" not in config and "norm_before_residual" not in config
    with safe_open(str(export / "model.safetensors"), "pt") as fh:
        assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(fh.keys())
    report = served_vs_simulated(str(reasoning_target), str(export), held, [K], MAX_TOKENS)["by_k"][K]
    served, on_outputs = report["served"], report["simulated"]
    print("served", served, "simulated on vLLM's outputs", on_outputs, "simulated on HF's greedy answers", sim,
          "simulated with pre-norm feedback", sim_prenorm)
    assert served["acceptance_length"] >= 1.5  # an untrained drafter gives 1.0
    # Greedy spec decoding is lossless: vLLM's outputs are the target's greedy answers, so the simulation on them
    # verifies the same drafts. They may differ only by a float near-tie between vLLM's and HF's kernels.
    assert abs(served["drafts"] - on_outputs["drafts"]) <= 2
    for got, want in zip(served["per_position"], on_outputs["per_position"], strict=True):
        assert got == pytest.approx(want, abs=0.02)
    assert report["agreement"]["within"]
    # the held-out simulation made at training time (HF's greedy answers) agrees too
    assert served["acceptance_length"] == pytest.approx(sim.acceptance_length, abs=0.05)

    # and it is closer to it than to a simulation that feeds the pre-norm state on (an engine ignoring norm_output)
    def error(stats) -> float:
        return sum(abs(g - w) for g, w in zip(served["per_position"], stats.per_position, strict=True))

    assert error(sim) < error(sim_prenorm)
