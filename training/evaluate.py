"""Measure a drafter with vLLM speculative decoding (method `eagle3`) against the target alone.

    python -m training.evaluate --target DIR --draft DIR [--prompts FILE] [--k 3] [--max-tokens N]

Prompts are token ids: a JSON list of lists, or JSONL lines that are lists or objects with
`prompt_token_ids` (or `input_ids`). Without --prompts, seeded random ids are used. Greedy
decoding; acceptance comes from vLLM's counters (`vllm:spec_decode_*`), so loading the export in
vLLM is itself the format check. Each engine runs in its own spawned process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

from pipeline.base.layout import atomic_write_json

SPEC_PREFIX = "vllm:spec_decode_"


class PromptFileError(ValueError):
    """A prompts file that cannot be read as token-id prompts; the message names the file and the place."""


def read_prompts(path: str | Path) -> list[list[int]]:
    """Token-id prompts from JSON (list of lists) or JSONL (lists or objects per line). Any other content
    raises PromptFileError with the reason (the CLIs print it as one line), never a bare traceback."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{path}: cannot read it ({type(e).__name__})") from None
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise PromptFileError(f"{path}:{n}: not JSON ({e.msg})") from None
    if not isinstance(items, list):
        raise PromptFileError(f"{path}: expected a list of prompts, got {type(items).__name__}")
    if not items:  # else a run starts its engines for minutes to report nothing (acceptance NaN)
        raise PromptFileError(f"{path}: holds no prompts")
    if items and isinstance(items[0], int):  # a single JSONL line parsed as one prompt
        items = [items]
    prompts = []
    for n, item in enumerate(items, 1):
        if isinstance(item, dict):
            item = item.get("prompt_token_ids", item.get("input_ids"))
        # JSON true/false are ints to Python: refused like any other non-id
        if not isinstance(item, list) or not item or not all(type(t) is int and t >= 0 for t in item):
            raise PromptFileError(f"{path}: prompt {n} is not a non-empty list of token ids")
        prompts.append(list(item))
    return prompts


def fit_problem(prompts: list[list[int]], max_tokens: int, max_model_len: int) -> str | None:
    """Why the prompts cannot be measured at `max_tokens` new tokens each within `max_model_len` (None: they can).
    vLLM refuses a prompt longer than `max_model_len` only in the engine process, after its start-up, and
    cuts a shorter one's output at the limit, so the fixed amount of work per prompt would not hold."""
    if not prompts:
        return "no prompts to measure"
    for n, p in enumerate(prompts, 1):
        if len(p) + max_tokens > max_model_len:
            return (f"prompt {n} has {len(p)} tokens: with --max-tokens {max_tokens} it needs --max-model-len "
                    f"{len(p) + max_tokens} or more (got {max_model_len})")
    return None


def random_prompts(n: int, vocab_size: int, length: int | tuple[int, int], seed: int) -> list[list[int]]:
    """Seeded random token-id prompts (fixed or uniformly drawn length)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lo, hi = (length, length) if isinstance(length, int) else length
    return [rng.integers(3, vocab_size, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def spec_counters(metrics) -> dict:
    """Sum vLLM's spec-decode counters (they may be split by engine labels)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in metrics:
        if not m.name.startswith(SPEC_PREFIX):
            continue
        key = m.name.removeprefix(SPEC_PREFIX)
        if key == "num_accepted_tokens_per_pos":
            per = out["accepted_per_pos"]
            per.extend([0] * (len(m.values) - len(per)))
            out["accepted_per_pos"] = [a + b for a, b in zip(per, m.values, strict=False)]
        elif key in out:
            out[key] += int(m.value)
    return out


def acceptance_report(counters: dict) -> dict:
    """Acceptance length = 1 + accepted / drafts; per-position rate = accepted_i / drafts."""
    drafts = max(counters["num_drafts"], 1)
    return {
        "acceptance_length": 1.0 + counters["num_accepted_tokens"] / drafts,
        "per_position_acceptance": [a / drafts for a in counters["accepted_per_pos"]],
        **counters,
    }


def make_engine(target: str, draft: str | None, k: int, max_model_len: int, dtype: str, tokenizer: bool = False):
    """A vLLM engine for `target`, with the EAGLE-3 drafter when `draft` is given. Token ids in and out; the
    `tokenizer` loads only where the end of turn must be known (vLLM takes its stop ids from it)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    kwargs = dict(
        model=target, skip_tokenizer_init=not tokenizer, dtype=dtype, max_model_len=max_model_len,
        disable_log_stats=False, enforce_eager=True, seed=0,
    )
    if draft is not None:
        kwargs["speculative_config"] = {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
    return LLM(**kwargs)


def run_prompts(llm, prompts: list[list[int]], max_tokens: int, stop_at_eos: bool = False
                ) -> tuple[list[list[int]], float]:
    """Greedy generation per prompt; returns (outputs, seconds). Exactly `max_tokens` tokens each (a fixed
    amount of work, for throughput), or with `stop_at_eos` up to the end of turn, as a served request ends
    (the acceptance users see: a draft round that straddles the end counts)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    fixed = {} if stop_at_eos else {"min_tokens": max_tokens, "ignore_eos": True}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, **fixed)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


def measure(llm, prompts: list[list[int]], max_tokens: int, stop_at_eos: bool = False) -> dict:
    """Generate once on an existing engine and report throughput plus acceptance (if any)."""
    before = spec_counters(llm.get_metrics())
    outputs, seconds = run_prompts(llm, prompts, max_tokens, stop_at_eos)
    after = spec_counters(llm.get_metrics())
    delta = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    per = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    delta["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], per, strict=True)]
    tokens = sum(len(o) for o in outputs)
    report = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9), "outputs": outputs}
    if delta["num_drafts"]:
        report.update(acceptance_report(delta))
    return report


def shutdown_engine(llm) -> None:
    """Stop vLLM's engine-core and worker processes now (otherwise they can outlive the caller)."""
    llm.llm_engine.engine_core.shutdown()


def _child(target, draft, prompts, k, max_tokens, max_model_len, dtype, stop_at_eos, queue) -> None:
    try:
        llm = make_engine(target, draft, k, max_model_len, dtype, tokenizer=stop_at_eos)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which would otherwise wait out its timeout
        queue.put({"error": f"{type(e).__name__}: {e}"})
        raise
    try:
        run_prompts(llm, prompts[:2], 4)  # warm-up outside the timing and counters
        queue.put(measure(llm, prompts, max_tokens, stop_at_eos))
    except Exception as e:  # noqa: BLE001 - e.g. vLLM refusing a prompt: the parent would only see an exit code
        queue.put({"error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        shutdown_engine(llm)


def measure_in_subprocess(target, draft, prompts, k, max_tokens, max_model_len, dtype, stop_at_eos: bool = False
                          ) -> dict:
    """One engine per spawned process, so two engines never share this process. Raises RuntimeError when
    the engine fails or its process dies (the reason in the message), instead of waiting out a timeout."""
    import queue as queues

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(target, draft, prompts, k, max_tokens, max_model_len, dtype,
                                            stop_at_eos, queue))
    proc.start()
    result: dict | None = None
    deadline = time.monotonic() + 1800
    try:
        while result is None and time.monotonic() < deadline:
            try:
                result = queue.get(timeout=2)
            except queues.Empty:
                if not proc.is_alive():  # one last look: it may have put its result just before exiting
                    try:
                        result = queue.get(timeout=2)
                    except queues.Empty:
                        result = {"error": f"the engine process exited with code {proc.exitcode}"}
    finally:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.terminate()
    if result is None:
        result = {"error": "no result within 30 minutes"}
    if "error" in result:
        raise RuntimeError(f"vLLM could not measure {draft or target}: {result['error']}")
    return result


def evaluate(target: str, draft: str, prompts: list[list[int]], k: int, max_tokens: int,
             max_model_len: int = 1024, dtype: str = "float32", baseline: bool = True) -> dict:
    """Spec-decode run (and optionally a target-only run) with a comparison of outputs."""
    spec = measure_in_subprocess(target, draft, prompts, k, max_tokens, max_model_len, dtype)
    report = {"target": target, "draft": draft, "k": k, "num_prompts": len(prompts), "max_tokens": max_tokens,
              "spec": {key: v for key, v in spec.items() if key != "outputs"}}
    if baseline:
        base = measure_in_subprocess(target, None, prompts, k, max_tokens, max_model_len, dtype)
        report["target_only"] = {key: v for key, v in base.items() if key != "outputs"}
        report["speedup"] = spec["tokens_per_s"] / max(base["tokens_per_s"], 1e-9)
        same = sum(a == b for a, b in zip(spec["outputs"], base["outputs"], strict=True))
        report["identical_outputs"] = same / max(len(prompts), 1)
    return report


def format_report(report: dict) -> str:
    spec = report["spec"]
    lines = [
        f"draft {report['draft']}  k={report['k']}  prompts={report['num_prompts']}  max_tokens={report['max_tokens']}",
        f"acceptance length {spec.get('acceptance_length', float('nan')):.3f} tokens/step  "
        f"(drafts {spec.get('num_drafts', 0)}, accepted {spec.get('num_accepted_tokens', 0)})",
        "per-position acceptance " + " / ".join(f"{x:.3f}" for x in spec.get("per_position_acceptance", [])),
        f"spec decode {spec['tokens_per_s']:.1f} tok/s",
    ]
    if "target_only" in report:
        base = report["target_only"]["tokens_per_s"]
        lines.append(f"target alone {base:.1f} tok/s  speedup {report['speedup']:.2f}x  "
                     f"identical outputs {report['identical_outputs']:.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", help="JSON/JSONL token-id prompts (held out from training)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-random-prompts", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-baseline", action="store_true", help="skip the target-only run")
    ap.add_argument("--out", default=None, help="JSON report path (default: DRAFT/eval_k{K}.json)")
    args = ap.parse_args(argv)
    if args.prompts:
        try:
            prompts = read_prompts(args.prompts)
        except PromptFileError as e:
            raise SystemExit(f"error: {e}") from None
    else:
        from training.target import read_target_config

        vocab = int(read_target_config(args.target)["vocab_size"])
        prompts = random_prompts(args.num_random_prompts, vocab, (8, 32), seed=12345)
    if problem := fit_problem(prompts, args.max_tokens, args.max_model_len):
        raise SystemExit(f"error: {problem}")
    report = evaluate(args.target, args.draft, prompts, args.k, args.max_tokens, args.max_model_len,
                      args.dtype, baseline=not args.no_baseline)
    print(format_report(report))
    out = Path(args.out or Path(args.draft) / f"eval_k{args.k}.json")
    atomic_write_json(out, report)
    print(f"report written to {out}")
    return report


if __name__ == "__main__":
    main()
