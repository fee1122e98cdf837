"""The trained tiny target as the pipeline sees it: the checkpoint through transformers, over all 129,280 ids.

Built once a session (``trained_target``, a few minutes). A second full build to compare digests would
double that, so determinism is asserted on a short build made twice instead: the same code path
(seeded corpus and init, fixed threads, deterministic kernels), fewer steps.
"""

from __future__ import annotations

import hashlib
import json

import torch

from pipeline.base.config import ChecksConfig
from pipeline.checks.validate import validate_sample
from pipeline.demo.tiny_domain import conversations, prompt_rows
from pipeline.demo.tiny_model import EOS_ID, built_variant, tiny_config
from pipeline.demo.tiny_trained import HELDOUT_SEED, build_weights, encode
from pipeline.profiles import load_profile


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_heldout_continuations_are_peaked(trained_target):
    assert built_variant(trained_target) == "trained"
    report = json.loads((trained_target / "build_report.json").read_text())
    assert report["heldout"]["top1_prob"] >= 0.5 and report["heldout"]["unused_mass"] < 1e-6
    model, profile = _model(trained_target), load_profile("deepseek", str(trained_target))
    head = model.lm_head.weight.detach()
    tied = (head == head[profile.think_start_id]).all(-1)  # <think> is never a target: it has the shared row
    assert int(tied.sum()) == tiny_config()["vocab_size"] - report["output_ids"]
    top1, nll, unused, forbidden, n = 0.0, 0.0, 0.0, 0.0, 0
    rows = [encode(c, profile) for c in conversations(40, HELDOUT_SEED + 1)]  # a stream the build never scored
    with torch.no_grad():
        for ids, start in rows:
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, start - 1 : -1], -1)
            targets = torch.tensor(ids[start:])
            top1 += float(logp.max(-1).values.exp().sum())
            nll -= float(logp.gather(1, targets[:, None]).sum())
            unused = max(unused, float(logp[:, tied].exp().sum(-1).max()))
            forbidden = max(forbidden, float(logp[:, sorted(profile.forbidden_output_ids)].exp().sum(-1).max()))
            n += len(targets)
    print(f"held-out: {n} tokens, nll {nll / n:.3f}, top-1 prob {top1 / n:.3f}, unused mass <= {unused:.2e}; "
          f"build: {report}")
    assert top1 / n >= 0.5 and nll / n < 1.5
    assert unused < 1e-6 and forbidden < 1e-9


def test_sampled_responses_pass_every_quarantining_check(trained_target):
    model, profile = _model(trained_target), load_profile("deepseek", str(trained_target))
    torch.manual_seed(0)
    finished = 0
    for i, row in enumerate(prompt_rows(12, seed=77)):
        thinking = i % 3 != 0
        prompt = profile.render_prompt(row["messages"], None, thinking)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt.ids]), do_sample=True, temperature=1.0, top_p=1.0,
                                 max_new_tokens=96, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
        ids = out[0, len(prompt.ids):].tolist()
        sample = {"output_ids": ids, "prompt_ids": prompt.ids, "thinking": thinking, "tools": "",
                  "messages": json.dumps(row["messages"]), "finish_reason": "stop" if ids[-1] == EOS_ID else "length"}
        verdict = validate_sample(sample, profile, ChecksConfig())
        assert verdict.passed, (verdict.failed, profile.decode(ids))
        finished += ids[-1] == EOS_ID
    assert finished == 12  # responses are ~30 tokens against a 96-token cap


def test_a_build_is_reproducible():
    def digest(weights: dict[str, torch.Tensor]) -> str:
        h = hashlib.sha256()
        for k in sorted(weights):
            h.update(k.encode() + weights[k].numpy().tobytes())
        return h.hexdigest()

    (a, report), (b, _) = build_weights(tiny_config("trained"), steps=4), build_weights(tiny_config("trained"), steps=4)
    assert digest(a) == digest(b) and report["steps"] == 4
