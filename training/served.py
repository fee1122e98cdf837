"""Served acceptance: the exported drafter in vLLM's EAGLE-3 speculative decoding, beside the simulation.

Users only ever see the served figure, so every training run and bench measures it and holds it next to
the simulated one (``training.simulate``) per position:

* ``served_acceptance``: greedy spec decoding of token-id prompts up to the end of turn (a round that
  straddles the end counts, as in a served request), vLLM's own counters.
* ``served_vs_simulated``: that at several draft lengths, and the simulation on the very tokens vLLM
  produced. Greedy spec decoding is lossless, so those outputs are the target's greedy continuations:
  the simulation verifies the same drafts against the same argmax, and the two agree up to float
  near-ties between HF's and vLLM's kernels (measured: the same 233 drafts and per-position counts on
  the quick start's drafter). A gap beyond that is a structural difference between training and serving.
* ``agreement``: two per-position figures from different samples (the run's held-out samples and the
  served outputs, which differ when the run sampled at T > 0) agree when each position's difference is
  within three standard errors of the difference of two binomial rates over their drafts.

    python -m training.served --target DIR --draft DIR --prompts FILE [--k 3 5 7] [--max-tokens 256]

FILE: token-id prompts (JSON / JSONL, as ``training.evaluate`` reads them) or, with ``--text``, one user
message per line rendered by the target's chat template (what vLLM's ``LLM.chat`` sends).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.base.layout import atomic_write_json
from training.evaluate import PromptFileError, measure_in_subprocess, read_prompts

MIN_TOLERANCE = 0.01


def served_acceptance(target: str, draft: str, prompts: list[list[int]], k: int, max_tokens: int,
                      max_model_len: int = 2048, dtype: str = "float32") -> dict[str, Any]:
    """vLLM's greedy EAGLE-3 acceptance of `draft` at draft length `k`; its outputs come along."""
    rep = measure_in_subprocess(target, draft, prompts, k, max_tokens, max_model_len, dtype, stop_at_eos=True)
    return {"k": k, "prompts": len(prompts), "acceptance_length": rep.get("acceptance_length", 1.0),
            "per_position": rep.get("per_position_acceptance", [0.0] * k), "drafts": rep.get("num_drafts", 0),
            "tokens": rep["tokens"], "seconds": rep["seconds"], "outputs": rep["outputs"]}


def tolerance(p: float, drafts_a: int, drafts_b: int) -> float:
    """Three standard errors of the difference of two binomial rates near `p` over the two draft counts."""
    if drafts_a <= 0 or drafts_b <= 0:
        return 1.0
    return max(MIN_TOLERANCE, 3.0 * math.sqrt(max(p * (1 - p), 0.0) * (1 / drafts_a + 1 / drafts_b)))


def agreement(served: dict[str, Any], simulated: dict[str, Any]) -> dict[str, Any]:
    """Per position: served - simulated, the tolerance at that rate, and whether every one is within it.
    Both dicts carry ``per_position`` and ``drafts``."""
    rows = []
    for s, m in zip(served["per_position"], simulated["per_position"], strict=False):
        tol = tolerance((s + m) / 2, served["drafts"], simulated["drafts"])
        rows.append({"served": round(s, 4), "simulated": round(m, 4), "gap": round(s - m, 4),
                     "tolerance": round(tol, 4)})
    return {"per_position": rows, "within": all(abs(r["gap"]) <= r["tolerance"] for r in rows)}


def rows_for(target: str, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
             aux_layer_ids: list[int]) -> list[dict[str, Any]]:
    """Extraction-contract rows (states by an HF forward of the target on CPU) of prompt + output."""
    import numpy as np

    from pipeline.hidden.extract import capture, load_target

    model, _, _ = load_target(target, device="cpu", dtype="float32")
    rows = []
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        (aux, final), = capture(model, [list(p) + list(o)], aux_layer_ids)
        rows.append({"sample_id": f"served-{i}", "input_ids": np.asarray(list(p) + list(o), np.int64),
                     "loss_mask": np.asarray([0] * len(p) + [1] * len(o), np.int8), "aux_hidden": aux,
                     "final_hidden": final})
    return rows


def served_vs_simulated(target: str, draft: str, prompts: list[list[int]], ks: Sequence[int], max_tokens: int,
                        max_model_len: int = 2048, dtype: str = "float32") -> dict[str, Any]:
    """For each k: vLLM's figures, the simulation on vLLM's own outputs, and their agreement."""
    import torch

    from training.export import load_exported
    from training.simulate import simulate_acceptance
    from training.target import load_target_parts

    parts = load_target_parts(target)
    try:
        drafter = load_exported(draft, parts)
    except (KeyError, ValueError, TypeError, OSError) as e:  # another trainer's format (e.g. speculators'): serve only
        drafter, why = None, f"not simulated: {draft} is not this project's export ({type(e).__name__}: {e})"
    report: dict[str, Any] = {"target": target, "draft": draft, "prompts": len(prompts), "max_tokens": max_tokens,
                              "by_k": {}}
    rows, first_outputs = None, None
    for k in ks:
        served = served_acceptance(target, draft, prompts, k, max_tokens, max_model_len, dtype)
        outputs = served.pop("outputs")
        first_outputs = outputs if first_outputs is None else first_outputs
        same = sum(a == b for a, b in zip(outputs, first_outputs, strict=True)) / max(len(prompts), 1)
        entry: dict[str, Any] = {"served": served, "outputs_as_at_first_k": same}
        if drafter is None:
            report["by_k"][k] = entry | {"simulated": None, "skipped": why}
            continue
        if rows is None:
            rows = rows_for(target, prompts, first_outputs, list(drafter.config.eagle_aux_hidden_state_layer_ids))
        with torch.no_grad():
            sim = simulate_acceptance(drafter, rows, parts.lm_head, k=k)
        simulated = {"acceptance_length": sim.acceptance_length, "per_position": sim.per_position,
                     "drafts": sim.num_drafts}
        report["by_k"][k] = entry | {"simulated": simulated, "agreement": agreement(served, simulated)}
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [f"draft {report['draft']}: {report['prompts']} prompts, up to {report['max_tokens']} tokens, greedy"]
    for k, r in report["by_k"].items():
        s, m = r["served"], r["simulated"]
        if m is None:
            lines.append(f"k={k}  served {s['acceptance_length']:.3f} ({s['drafts']} drafts)  ({r['skipped']})")
            lines.append("      served    " + " ".join(f"{p:.3f}" for p in s["per_position"]))
            continue
        lines.append(f"k={k}  served {s['acceptance_length']:.3f} ({s['drafts']} drafts)  simulated "
                     f"{m['acceptance_length']:.3f} ({m['drafts']} drafts)  "
                     f"{'agree' if r['agreement']['within'] else 'DISAGREE'}")
        lines.append("      served    " + " ".join(f"{p:.3f}" for p in s["per_position"]))
        lines.append("      simulated " + " ".join(f"{p:.3f}" for p in m["per_position"]))
    return "\n".join(lines)


def text_prompts(target: str, path: str | Path) -> list[list[int]]:
    """One user message per line, rendered by the target's chat template with the generation prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    lines = [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip()]
    return [list(tok.apply_chat_template([{"role": "user", "content": ln}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)) for ln in lines]


def unservable(prompts: list[list[int]], max_model_len: int) -> str | None:
    """Why the engine could not answer these prompts (None: it can). Answers stop at the end of turn, so only a
    prompt that leaves no room for one token is refused; vLLM would say so only after its engine's start-up."""
    if not prompts:
        return "no prompts to measure"
    for n, p in enumerate(prompts, 1):
        if len(p) >= max_model_len:
            return (f"prompt {n} has {len(p)} tokens: it needs --max-model-len {len(p) + 1} or more "
                    f"(got {max_model_len})")
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--text", action="store_true", help="--prompts holds one user message per line")
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-prompts", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None, help="JSON report (default: DRAFT/served.json)")
    args = ap.parse_args(argv)
    try:
        prompts = text_prompts(args.target, args.prompts) if args.text else read_prompts(args.prompts)
    except (PromptFileError, OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: {e}") from None
    prompts = prompts[: args.max_prompts] if args.max_prompts else prompts
    if problem := unservable(prompts, args.max_model_len):
        raise SystemExit(f"error: {problem}")
    report = served_vs_simulated(args.target, args.draft, prompts, args.k, args.max_tokens, args.max_model_len,
                                 args.dtype)
    print(format_report(report))
    out = Path(args.out or Path(args.draft) / "served.json")
    atomic_write_json(out, json.loads(json.dumps(report)))
    print(f"report written to {out}")
    return report


if __name__ == "__main__":
    main()
