"""The main job: prompts -> render -> generate -> validate -> shards -> hidden states -> drafter.

Read top to bottom: each function is one phase; the Ray Data stages they wire
together live in stages.py, sources/ and extract.py.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.audit import AuditAccumulator, summary_lines
from pipeline.config import ChecksConfig, RunConfig
from pipeline.datasets import load_dataset
from pipeline.manifest import check_or_write_manifest
from pipeline.records import QUARANTINE_SCHEMA, quarantine_row, read_rows
from pipeline.router import spilled_from
from pipeline.stages import FLIGHT_SCHEMA, RenderPrompts, ValidateSamples, WriteShards, _atomic_write, shard_name
from pipeline.validate import Verdict, assert_conservation

if TYPE_CHECKING:
    from training.vocab import VocabMapping

log = logging.getLogger("pipeline")


@dataclass
class Timings:
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, t0: float) -> None:
        self.seconds[name] = round(time.perf_counter() - t0, 2)


def init_ray(cfg: RunConfig) -> None:
    """Join the cluster named by config or RAY_ADDRESS; otherwise start a private local Ray."""
    import ray

    if ray.is_initialized():
        return
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    loopback = {"_node_ip_address": "127.0.0.1"}
    if address:
        # Inside `ray job submit` the job's runtime env (working dir, env vars) already applies.
        local_head = address.split("://")[-1].startswith(("127.0.0.1", "localhost"))
        ray.init(address=address, **(loopback if local_head else {}))
    else:
        env = {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}}
        ray.init(address="local", num_cpus=cfg.ray.num_cpus, include_dashboard=False, runtime_env=env, **loopback)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False


def read_prompts(cfg: RunConfig, out: Path) -> tuple[list[dict[str, Any]], Counter]:
    """All prompt rows not yet finished; malformed rows go straight to quarantine."""
    done = finished_ids(out)
    prompts, bad_rows, counts = [], [], Counter()
    for d in cfg.datasets:
        rows, bad = load_dataset(d)
        counts[f"{d.name}.rows"] = len(rows) + len(bad)
        prompts += [r for r in rows if r["sample_id"] not in done]
        bad_rows += [b for b in bad if b["sample_id"] not in done]
    if bad_rows:
        qdir = out / "quarantine"
        qdir.mkdir(parents=True, exist_ok=True)
        # quarantine_row keeps the offending line (``raw``) in the detail column
        q = [quarantine_row({k: v for k, v in b.items() if k not in ("stage", "reason")}, b["stage"], b["reason"])
             for b in bad_rows]
        table = pa.Table.from_pylist(q, schema=QUARANTINE_SCHEMA)
        _atomic_write(table, qdir / shard_name([b["sample_id"] for b in bad_rows]))
    counts["resumed_done"] = len(done)
    return prompts, counts


def has_finished_rows(out: Path) -> bool:
    return any(any((out / sub).glob("*.parquet")) for sub in ("samples", "quarantine"))


def finished_ids(out: Path) -> set[str]:
    """Sample ids already written as passed or quarantined (a resumed run skips them)."""
    ids: set[str] = set()
    for sub in ("samples", "quarantine"):
        for f in sorted((out / sub).glob("*.parquet")):
            ids.update(pq.read_table(f, columns=["sample_id"]).column("sample_id").to_pylist())
    return ids


def generate(cfg: RunConfig, prompts: list[dict[str, Any]], out: Path, ledgers: dict[str, Any]) -> Tally:
    """Stream prompts through render -> routed sources -> validate -> shard writer, tallying what comes out.

    A prompt whose source fails it is handed to the next source the router names; when that source sits
    earlier in the chain the prompt comes back as ``reroute`` and is fed to one more pass.
    """
    import ray.data

    from pipeline.router import build_router, map_routed, reroute_overrides
    from pipeline.sources.vllm_source import release_placement_groups

    tally = Tally(len(prompts), cfg.datasets[0].checks)
    if not prompts:
        return tally
    model = cfg.model
    # The overflow deadline runs from here (engine start-up counts: it is wall clock the user waits).
    router = build_router(cfg.sources, cfg.datasets, cfg.routing, len(prompts), started_at=time.time())
    checks = {d.name: d.checks.model_dump() for d in cfg.datasets}
    block_rows = min(s.batch_size for s in cfg.sources)
    todo, overrides = prompts, {}
    for _ in range(cfg.routing.max_hops + 2):
        ds = ray.data.from_items(todo, override_num_blocks=max(1, len(todo) // block_rows))
        ds = ds.map_batches(RenderPrompts, fn_constructor_args=(model.profile, model.path), batch_format="pyarrow",
                            compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.25)
        ds = map_routed(ds, cfg.sources, model_dir=model.path, profile=model.profile,
                        sampling=cfg.sampling.model_dump(), router=router, ledgers=ledgers, overrides=overrides)
        ds = ds.map_batches(ValidateSamples, fn_constructor_args=(model.profile, model.path, checks),
                            batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.25)
        ds = ds.map_batches(WriteShards, fn_constructor_args=(str(out),), batch_format="pyarrow",
                            compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.25)
        rerouted = []
        try:
            for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
                for row in batch.to_pylist():
                    tally.note_start_failure(row)
                    if row["status"] == "reroute":
                        rerouted.append(row)
                    else:
                        tally.add(row)
                tally.progress()
        finally:
            release_placement_groups()  # TP > 1 engine actors' GPU bundles outlive the actors
        overrides = reroute_overrides(rerouted)
        todo = [p for p in prompts if p["sample_id"] in overrides]
        router = replace(router, spill_at=None)  # later passes carry only re-routes: none spills
        if not todo:
            break
    if todo:
        raise RuntimeError(f"{len(todo)} prompts still re-routed after {cfg.routing.max_hops + 2} passes")
    tally.progress(final=True)
    return tally


def create_ledgers(cfg: RunConfig, out: Path) -> dict[str, Any]:
    """One budget ledger per API source, restored from what earlier attempts already spent.

    Restored spend is the larger of what written samples were billed and what the ledger's journal
    had committed (spent + in flight) when the last attempt stopped.
    """
    from pipeline.sources.openrouter import ledger_for

    ledgers = {}
    for src in cfg.sources:
        if src.kind == "openrouter":
            journal = out / f"ledger-{src.name}.json"
            ledgers[src.name] = ledger_for(src, spent=spent_by_dataset(out, src.name), journal=str(journal))
    return ledgers


def spent_by_dataset(out: Path, source: str) -> dict[str, int]:
    """Billed completion tokens of one source in written samples and quarantined (but billed) samples."""
    spent: Counter = Counter()
    for r in read_rows(out / "samples", ["dataset", "source", "billed_completion_tokens"]):
        if r["source"] == source and (r["billed_completion_tokens"] or 0) > 0:
            spent[r["dataset"]] += r["billed_completion_tokens"]
    for r in read_rows(out / "quarantine", ["dataset", "source", "detail"]):
        if r["source"] == source:
            billed = json.loads(r["detail"] or "{}").get("billed_completion_tokens") or 0
            spent[r["dataset"]] += max(int(billed), 0)
    return dict(spent)


class Tally:
    """Folds per-sample summaries as they stream out of the pipeline: counts, audit figures, spend.

    Prints a one-line status every few seconds that stays readable in `ray job logs`.
    """

    def __init__(self, total: int, checks: ChecksConfig, every_s: float = 10.0) -> None:
        self.total, self.every_s = total, every_s
        self.status: Counter = Counter()
        self.audit = AuditAccumulator(checks)
        self.tokens = 0
        self.cost = 0.0
        self.t0 = self.last = time.perf_counter()
        self.printed = -1
        self.start_errors: dict[str, str] = {}  # source -> why its engine did not start (from row reasons)
        self.served: Counter = Counter()  # source -> samples it generated (this attempt)
        self.spilled: Counter = Counter()  # local source -> its prompts an overflow source took past the deadline

    @property
    def done(self) -> int:
        return sum(self.status.values())

    def add(self, row: dict[str, Any]) -> None:
        self.status[row["status"]] += 1
        if row.get("output_ids") is not None:
            self.served[row.get("source") or ""] += 1
        origin = spilled_from(row)
        if origin:
            self.spilled[origin] += 1
        self.tokens += len(row["output_ids"] or [])
        self.cost += row.get("cost") or 0.0
        if row.get("checks_ran"):
            details = json.loads(row["check_details"] or "{}")
            verdict = Verdict(failed={k: details.get(k, "") for k in row["checks_failed"]},
                              flagged={k: details.get(k, "") for k in row["checks_flagged"]},
                              ran=list(row["checks_ran"]))
            self.audit.add(row, verdict)

    def note_start_failure(self, row: dict[str, Any]) -> None:
        """Remember a source whose engine failed to start, as its re-routed or quarantined rows tell it."""
        from pipeline.sources.vllm_source import start_failure

        failed = start_failure(row)
        if failed:
            self.start_errors.setdefault(*failed)

    def progress(self, final: bool = False) -> None:
        now = time.perf_counter()
        if (not final and now - self.last < self.every_s) or self.done == self.printed:
            return
        self.last, self.printed = now, self.done
        rate = self.done / max(now - self.t0, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        print(f"[generate] {self.done}/{self.total} done, {self.status['quarantine']} quarantined, "
              f"{self.status['not_generated']} not generated, {self.tokens} tokens, ${self.cost:.4f}, "
              f"{rate:.2f} samples/s, ETA {eta:.0f}s", flush=True)


SAMPLE_INPUT_COLUMNS = ["sample_id", "dataset", "row_index", "source", "prompt_ids", "prompt_assistant_mask",
                        "output_ids"]


def extract_and_train(cfg: RunConfig, out: Path, timings: Timings) -> dict[str, Any]:
    """Hidden states from the extraction actors into the Ray Train loop: streamed, or via shards on disk."""
    import ray.data
    from transformers import AutoConfig

    from pipeline.extract import HiddenStateExtractor, bytes_per_token, read_extract_stats
    from training.config import DraftTrainConfig, resolve_aux_layer_ids
    from training.heldout import heldout_acceptance, select_heldout

    samples_dir = out / "samples"
    if not any(samples_dir.glob("*.parquet")):
        return {"skipped": "no passed samples to train on"}
    tcfg, ex = cfg.training, cfg.extraction
    if tcfg is None and ex.mode == "stream":
        return {"skipped": "training is off and extraction streams into training: nothing to extract"}
    target_cfg = AutoConfig.from_pretrained(cfg.model.path)
    heldout = tcfg.heldout_fraction if tcfg is not None else 0.0

    def heldout_split(rows: Any, keep: bool) -> Any:
        """Only the held-out rows (at most ``heldout_max_samples``, for evaluation), or all the others."""
        split = rows.map_batches(select_heldout, fn_kwargs={"fraction": heldout, "keep": keep},
                                 batch_format="pyarrow", num_cpus=0)
        return split.limit(tcfg.heldout_max_samples) if keep else split

    aux_ids = ex.aux_layer_ids or resolve_aux_layer_ids(tcfg or DraftTrainConfig(), target_cfg.num_hidden_layers)
    stats_dir = out / "extract_stats"
    extractor_kwargs = {"backend": ex.backend, "dtype": ex.dtype, "device_map": ex.device_map,
                        "vllm_options": ex.vllm, "stats_dir": str(stats_dir)}
    t0 = time.perf_counter()
    if ex.mode == "shards":
        from pipeline.hidden_shards import extract_to_shards, hidden_shards_dataset

        extract_to_shards(samples_dir, out / "hidden", model_dir=cfg.model.path, aux_layer_ids=aux_ids,
                          max_len=ex.max_len, too_long=ex.too_long, batch_tokens=ex.batch_tokens,
                          quarantine_dir=out / "quarantine", samples_per_shard=ex.samples_per_shard,
                          rows_per_call=ex.rows_per_call, dtype=ex.shard_dtype, num_actors=ex.num_actors,
                          num_cpus=ex.num_cpus, num_gpus=ex.num_gpus, extractor_kwargs=extractor_kwargs)
        timings.add("extract", t0)
        all_rows = hidden_shards_dataset(out / "hidden")
        ds = heldout_split(all_rows, keep=False) if heldout else all_rows
    else:
        def extracted(keep_heldout: bool) -> Any:  # the samples (all but the held-out, or only them), extracted
            samples = ray.data.read_parquet(str(samples_dir), columns=SAMPLE_INPUT_COLUMNS)
            if heldout:
                samples = heldout_split(samples, keep=keep_heldout)
            return samples.map_batches(
                HiddenStateExtractor,
                fn_constructor_args=(cfg.model.path, aux_ids, ex.max_len, ex.too_long, ex.batch_tokens,
                                     str(out / "quarantine")),
                fn_constructor_kwargs=extractor_kwargs | {"out_dtype": ex.shard_dtype},
                batch_format="pyarrow", batch_size=ex.rows_per_call,
                compute=ray.data.ActorPoolStrategy(size=ex.num_actors), num_cpus=ex.num_cpus,
                num_gpus=ex.num_gpus,
            )

        ds = extracted(keep_heldout=False)
    result: dict[str, Any] = {"aux_layer_ids": aux_ids, "extraction_mode": ex.mode,
                              "bytes_per_token": bytes_per_token(target_cfg.hidden_size, len(aux_ids))}
    t0 = time.perf_counter()
    if tcfg is None:
        result["extracted"] = ds.count()
        timings.add("extract" if ex.mode == "stream" else "read_shards", t0)
    else:
        from training.train import train_drafter

        # counted from the samples, not the stream: counting the stream would run the extraction once more
        vocab = draft_vocab_from_samples(samples_dir, target_cfg.vocab_size, tcfg.draft_vocab_size, ex.max_len,
                                         ex.too_long, heldout) if ex.mode == "stream" else None
        res = train_drafter(ds, tcfg.model_copy(update={"aux_layer_ids": aux_ids}), cfg.model.path,
                            out / "drafter", vocab=vocab)
        timings.add("extract+train" if ex.mode == "stream" else "train", t0)
        result.update(checkpoint=str(res.checkpoint_path), export_dir=str(res.export_dir),
                      metrics={k: v for k, v in res.metrics.items() if isinstance(v, (int, float, str))})
        if heldout:
            t0 = time.perf_counter()
            # stream mode: a second, small extraction pass (one more engine start-up); shards: a re-read
            held = extracted(keep_heldout=True) if ex.mode == "stream" else heldout_split(all_rows, keep=True)
            result["heldout"] = heldout_acceptance(res.export_dir, cfg.model.path, held.take_all(), tcfg.eval_k)
            timings.add("heldout_eval", t0)
    result["extraction"] = read_extract_stats(stats_dir) if stats_dir.exists() else {}
    return result


def draft_vocab_from_samples(samples_dir: Path, vocab_size: int, draft_vocab_size: int, max_len: int,
                             too_long: str, heldout_fraction: float = 0.0) -> VocabMapping:
    """The draft vocabulary over the loss-masked tokens the extraction stage will emit for the training
    samples (held-out samples excluded)."""
    from pipeline.extract import prepare_sample
    from training.heldout import is_held_out
    from training.vocab import build_vocab_mapping

    def rows() -> Iterator[dict[str, Any]]:
        for f in sorted(samples_dir.glob("*.parquet")):
            table = pq.read_table(f, columns=["sample_id", "prompt_ids", "prompt_assistant_mask", "output_ids"])
            for r in table.to_pylist():
                if is_held_out(r["sample_id"], heldout_fraction):
                    continue
                prepared = prepare_sample(r["prompt_ids"], r["prompt_assistant_mask"], r["output_ids"], max_len,
                                          too_long)
                if not isinstance(prepared, str):  # a reason: the extraction stage quarantines it
                    yield {"input_ids": prepared[0], "loss_mask": prepared[1]}

    return build_vocab_mapping(rows(), vocab_size, draft_vocab_size)


def summarize(tally: Tally, counts: Counter, out: Path) -> dict[str, Any]:
    """Figures over everything written for this run (including earlier, resumed attempts)."""
    samples = read_rows(out / "samples", ["sample_id", "dataset", "output_ids", "checks_flagged"])
    quarantine = read_rows(out / "quarantine", ["sample_id", "dataset", "stage", "reason"])
    passed_ids = {r["sample_id"] for r in samples}
    q_ids = {r["sample_id"] for r in quarantine if r["sample_id"] not in passed_ids}
    rows_in = sum(v for k, v in counts.items() if k.endswith(".rows"))
    datasets = sorted(k.rsplit(".", 1)[0] for k in counts if k.endswith(".rows"))
    # Extraction may quarantine a sample already written as passed: it stays counted as passed
    # generation and shows up under quarantine_by_stage.extract.
    return {
        "rows_in": rows_in,
        "passed": len(passed_ids),
        "quarantined": len(q_ids),
        "not_generated": tally.status["not_generated"],
        "quarantine_by_stage": dict(Counter(r["stage"] for r in quarantine)),
        "quarantine_reasons": dict(Counter(_reason_key(r["reason"]) for r in quarantine).most_common(10)),
        "flagged": dict(Counter(c for r in samples for c in r["checks_flagged"])),
        "tokens_generated": sum(len(r["output_ids"]) for r in samples),
        "duplicates_in_shards": len(samples) - len(passed_ids),
        "this_attempt": {"samples": tally.done, "resumed_done": counts["resumed_done"],
                         "status": dict(tally.status), "tokens": tally.tokens, "cost_usd": round(tally.cost, 6)},
        "audit": tally.audit.report(),
        "by_dataset": {
            d: {"rows": counts[f"{d}.rows"], "passed": sum(r["dataset"] == d for r in samples),
                "quarantined": sum(r["dataset"] == d and r["sample_id"] in q_ids for r in quarantine)}
            for d in datasets
        },
    }


def source_report(sources: list[Any], tally: Tally) -> dict[str, dict[str, Any]]:
    """Per configured source, this attempt: samples it generated, prompts it spilled past the overflow
    deadline, and, when its engine failed to start, why."""
    return {s.name: {"kind": s.kind, "served": tally.served[s.name], "spilled": tally.spilled[s.name],
                     "start_error": tally.start_errors.get(s.name)} for s in sources}


def _ledger_report(ledger: Any) -> dict[str, Any]:
    import ray

    rep = ledger.report.remote() if hasattr(ledger.report, "remote") else ledger.report()
    return ray.get(rep) if isinstance(rep, ray.ObjectRef) else rep


def _reason_key(reason: str) -> str:
    """The reason's leading words (check name or error kind), for grouping."""
    return reason.split(":", 1)[0][:80]


def run(cfg: RunConfig) -> dict[str, Any]:
    """Run the whole job and return its report (also written to OUTPUT/report.json)."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings = Timings()
    t_all = time.perf_counter()
    if cfg.model.build_tiny:
        from pipeline.tiny_model import build_tiny_target

        build_tiny_target(cfg.model.path, variant=cfg.model.tiny_variant)
    # before Ray starts: a folder written with other settings must fail in a second, not after start-up
    check_or_write_manifest(cfg, out, has_samples=has_finished_rows(out))
    t0 = time.perf_counter()
    init_ray(cfg)
    timings.add("ray_init", t0)

    t0 = time.perf_counter()
    prompts, counts = read_prompts(cfg, out)
    timings.add("read", t0)
    t0 = time.perf_counter()
    ledgers = create_ledgers(cfg, out)
    tally = generate(cfg, prompts, out, ledgers)
    timings.add("generate", t0)
    report: dict[str, Any] = summarize(tally, counts, out)
    assert_conservation(report["rows_in"], report["passed"], report["quarantined"], report["not_generated"])
    report["spend"] = {name: _ledger_report(ledger) for name, ledger in ledgers.items()}
    report["sources"] = source_report(cfg.sources, tally)
    report["training"] = extract_and_train(cfg, out, timings)
    timings.add("total", t_all)
    report["seconds"] = timings.seconds
    gen_s = timings.seconds.get("generate") or 0.0
    report["throughput"] = {
        "samples_per_s": round(tally.done / gen_s, 2) if gen_s else None,
        "tokens_per_s": round(tally.tokens / gen_s, 1) if gen_s else None,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(format_report(report, out), flush=True)
    return report


def format_report(r: dict[str, Any], out: Path) -> str:
    lines = [
        "",
        "=" * 64,
        f"Run report ({out})",
        f"  rows in      {r['rows_in']}",
        f"  passed       {r['passed']}",
        f"  quarantined  {r['quarantined']}  by stage {r['quarantine_by_stage']}",
        f"  not generated {r['not_generated']} (budget spent; resumable)",
        f"  flagged      {r['flagged']}",
        f"  tokens generated {r['tokens_generated']}, spend ${r['this_attempt']['cost_usd']:.4f}",
        f"  throughput   {r['throughput']}",
        f"  seconds      {r['seconds']}",
    ]
    if r["audit"]["samples"]:
        lines.append("  audit (this attempt):")
        lines += [f"    {line}" for line in summary_lines(r["audit"])]
    for name, src in (r.get("sources") or {}).items():
        spilled = f", {src['spilled']} spilled past the overflow deadline" if src.get("spilled") else ""
        lines.append(f"  source {name} ({src['kind']}) generated {src.get('served', 0)}{spilled}")
        if src.get("start_error"):
            lines.append(f"  source {name} failed to start (its prompts re-routed or quarantined): "
                         f"{src['start_error'][:200]}")
    for name, spend in (r.get("spend") or {}).items():
        lines.append(f"  spend {name}: {json.dumps(spend.get('datasets', spend), default=str)[:300]}")
    t = r.get("training") or {}
    x = t.get("extraction") or {}
    if x:
        lines.append(f"  extraction   {x['samples']} samples, {x['tokens']} tokens, {x['tokens_per_s_per_actor']} "
                     f"tok/s/actor, {x['bytes_per_token']} bytes/token, peak RSS {x['peak_rss_mb']:.0f} MB")
    m = t.get("metrics") or {}
    if m:
        accs = " ".join(f"{m[k]:.2f}" for k in sorted(m) if k.startswith("acc_"))
        lines.append(f"  training     step {m.get('step')} loss {m.get('loss', float('nan')):.3f} "
                     f"acc/position [{accs}] {m.get('tokens_per_s', 0):.0f} tok/s")
    if t.get("export_dir"):
        lines.append(f"  drafter      {t['export_dir']}")
    h = t.get("heldout") or {}
    if h.get("acceptance_length") is not None:
        per = " ".join(f"{p:.2f}" for p in h["per_position"])
        lines.append(f"  held-out     acceptance length {h['acceptance_length']:.3f} at k={h['k']} (per position "
                     f"[{per}]) on {h['samples']} samples never trained on (simulated greedy verification)")
    elif h:
        lines.append(f"  held-out     {h.get('skipped')}")
    lines.append("=" * 64)
    return "\n".join(lines)


__all__ = ["run", "FLIGHT_SCHEMA"]
