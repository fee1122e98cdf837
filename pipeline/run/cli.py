"""Command line: run a job, see where it stands, audit shards, serve a local OpenRouter stand-in, build the
tiny target."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.run.config import RunConfig


def _load(args: argparse.Namespace, check_paths: bool = True) -> RunConfig | None:
    """The config named on the command line (``--output-dir`` applied), or None after printing why not."""
    from pipeline.base.config import ConfigError
    from pipeline.run.config import load_config

    try:
        cfg = load_config(args.config, check_paths=check_paths)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return None
    if getattr(args, "output_dir", None):
        cfg.output_dir = args.output_dir
    return cfg


# Exit codes of `run` (README: "Exit codes"): done; rows left to do (a re-run resumes them); refused to start
# (config, input, a folder written with other settings, a folder another run holds) or stopped because another run
# took the folder's lock over; an unexpected failure is 1; Ctrl-C is 130, one line and no traceback.
EXIT_DONE, EXIT_FAILED, EXIT_REFUSED, EXIT_LEFT_TO_DO = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # Ctrl-C: the shell's code for SIGINT; a re-run resumes as after any kill


def _refusals() -> dict[type[Exception], str]:
    """What `run` refuses to start on, and the word its message starts with (exit EXIT_REFUSED)."""
    from pipeline.base.config import ConfigError
    from pipeline.base.run_lock import LockHeld
    from pipeline.prompts.datasets import DatasetError
    from pipeline.run.manifest import ManifestMismatch

    return {ManifestMismatch: "refusing to resume", LockHeld: "refusing to start", ConfigError: "config error",
            DatasetError: "input error"}


def _run(args: argparse.Namespace) -> int:
    from pipeline.base.console import Console
    from pipeline.run.job import run

    cfg = _load(args)
    if cfg is None:
        return EXIT_REFUSED
    from pipeline.base.run_lock import LockLost
    from pipeline.generate.sources.chain import StageDied
    from pipeline.run.placement import NoPlacement

    refusals = _refusals()
    resume = f"python -m pipeline run {args.config}" + (f" --output-dir {args.output_dir}"
                                                         if getattr(args, "output_dir", None) else "")
    try:
        # the run's own lines on the console; vLLM, Ray, transformers, torch and the rest in OUTPUT/logs/
        report = run(cfg, Console.for_cli(verbose=args.verbose, title=args.config))
    except LockLost as e:  # another run took the folder over: it owns what is left; the message names it
        print(f"stopped: {e} (exit {EXIT_REFUSED})", file=sys.stderr)
        return EXIT_REFUSED
    except StageDied as e:  # a stage process died past its bounded restarts: one line, not a Ray traceback
        print(f"stopped: {e}; rows left to do; re-run: {resume} (exit {EXIT_LEFT_TO_DO})", file=sys.stderr)
        return EXIT_LEFT_TO_DO
    except NoPlacement as e:  # nothing was started: every prompt is still to do
        print(f"! {e}", flush=True)
        left = getattr(e, "left", 0)
        what = f"{left} prompts" if left else "extraction and training"
        print(f"{what} left to do (exit {EXIT_LEFT_TO_DO}); resume with: {resume}", flush=True)
        return EXIT_LEFT_TO_DO
    except tuple(refusals) as e:
        word = next(w for cls, w in refusals.items() if isinstance(e, cls))
        print(f"{word}: {e}", file=sys.stderr)
        return EXIT_REFUSED
    left = report["not_generated"]
    if left:
        print(f"{left} prompts left to do (exit {EXIT_LEFT_TO_DO}); resume with: {resume}", flush=True)
        return EXIT_LEFT_TO_DO
    print(f"done: every prompt passed or quarantined (exit {EXIT_DONE})", flush=True)
    return EXIT_DONE


def _check(args: argparse.Namespace) -> int:
    cfg = _load(args, check_paths=not args.no_paths)
    if cfg is None:
        return 2
    if not args.no_paths and (problem := _run_problem(cfg)):
        print(problem, file=sys.stderr)
        return 2
    print(f"{args.config}: ok — {len(cfg.datasets)} datasets, sources "
          f"{[f'{s.kind}:{s.name}' for s in cfg.sources]}, output {cfg.output_dir}")
    from pipeline.base.console import describe_training

    print(f"training: {describe_training(cfg.training, 'training' in cfg.model_fields_set)}")
    from pipeline.base.sizing import sizing_note

    print(sizing_note(cfg.model, cfg.extraction))
    return 0


def _run_problem(cfg: RunConfig) -> str | None:
    """What ``run`` would refuse before Ray starts, found without writing anything: the output folder, the API
    keys (local Ray), the prompt files, the files a resume reads first and the manifest; one line, or None."""
    from pipeline.base.layout import RunLayout
    from pipeline.base.records import read_rows
    from pipeline.prompts.read import check_prompt_files
    from pipeline.run.job import check_api_keys, check_budget_journals, has_finished_rows, output_problem
    from pipeline.run.manifest import read_manifest
    from pipeline.run.status import manifest_status

    layout = RunLayout(cfg.output_dir)
    if problem := output_problem(layout.root):
        return f"config error: {problem}"
    refusals = _refusals()
    try:
        check_api_keys(cfg)
        check_prompt_files(cfg)
        if layout.manifest.is_file():
            read_manifest(layout.manifest)
        check_budget_journals(cfg, layout)
        for folder in (layout.samples, layout.quarantine):
            read_rows(folder, ["sample_id"])
    except tuple(refusals) as e:
        return f"{next(w for cls, w in refusals.items() if isinstance(e, cls))}: {e}"
    if has_finished_rows(layout) and (diffs := manifest_status(cfg, layout.root)["differences"]):
        listing = "\n".join(f"  {d}" for d in diffs)
        return (f"refusing to resume: {layout.root} holds samples made with other settings; resuming would mix "
                f"them:\n{listing}")
    return None


def _status(args: argparse.Namespace) -> int:
    import json

    from pipeline.run.status import collect_status, format_status

    cfg = _load(args, check_paths=False)  # the model may live elsewhere: the folder is what is read
    if cfg is None:
        return 2
    from pipeline.base.config import ConfigError
    from pipeline.prompts.datasets import DatasetError

    try:
        status = collect_status(cfg)
    except (FileNotFoundError, DatasetError, ConfigError) as e:
        print(f"status: {e}", file=sys.stderr)
        return 2
    print(json.dumps(status, indent=2, default=str) if args.json else format_status(status))
    return 0


def _numbers(text: str, kind: type) -> tuple:
    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, not {text!r}") from None


def _mix(items: list[str]) -> dict[str, float] | str:
    out = {}
    for item in items:
        name, eq, weight = item.partition("=")
        try:
            out[name] = float(weight) if eq and name else float("nan")
        except ValueError:
            out[name] = float("nan")
        if out[name] != out[name]:
            return f"--mix takes dataset=weight, not {item!r}"
    return out


def _value(args: argparse.Namespace) -> int:
    from pipeline.base.console import Console
    from pipeline.run.value import ValueOptions, run_value

    cfg = _load(args)
    if cfg is None:
        return EXIT_REFUSED
    fractions = args.fractions
    if not fractions or any(not 0 <= f < 1 for f in fractions):
        print(f"config error: --fractions takes one or more fractions in [0, 1), not {list(fractions)}",
              file=sys.stderr)
        return EXIT_REFUSED
    if not args.seeds:
        print("config error: --seeds takes one or more seeds", file=sys.stderr)
        return EXIT_REFUSED
    if args.steps is not None and args.steps < 1:
        print(f"config error: --steps must be at least 1, not {args.steps}", file=sys.stderr)
        return EXIT_REFUSED
    opts = ValueOptions(datasets=tuple(x for x in args.datasets.split(",") if x), fractions=fractions,
                        seeds=args.seeds, steps=args.steps)
    refusals = _refusals()
    try:
        out = run_value(cfg, opts, Console.for_cli(verbose=args.verbose, title=f"value {args.config}"))
    except tuple(refusals) as e:
        word = next(w for cls, w in refusals.items() if isinstance(e, cls))
        print(f"{word}: {e}", file=sys.stderr)
        return EXIT_REFUSED
    if out["failed"]:
        print(f"{len(out['failed'])} drafters left to train (exit {EXIT_LEFT_TO_DO}); resume with the same command",
              flush=True)
        return EXIT_LEFT_TO_DO
    return EXIT_DONE


def _plan(args: argparse.Namespace) -> int:
    from pipeline.run.plan import run_plan
    from pipeline.value.plan import PlanRefused

    cfg = _load(args, check_paths=False)
    if cfg is None:
        return EXIT_REFUSED
    mix = _mix(args.mix)
    if isinstance(mix, str):
        print(f"plan refused: {mix}", file=sys.stderr)
        return EXIT_REFUSED
    from pipeline.base.config import ConfigError
    from pipeline.prompts.datasets import DatasetError

    try:
        _, lines = run_plan(cfg, args.budget_usd, mix or None)
    except (PlanRefused, ConfigError, DatasetError) as e:
        print(f"plan refused: {e}", file=sys.stderr)
        return EXIT_REFUSED
    print("\n".join(lines))
    return EXIT_DONE


def _build_tiny(args: argparse.Namespace) -> int:
    from pipeline.demo.tiny_model import build_tiny_target, weights_digest

    out = build_tiny_target(args.out, variant=args.variant, force=args.force)
    print(f"tiny target ({args.variant}) at {out} (weights sha256 {weights_digest(out)})")
    return 0


class ConsoleFormat(logging.Formatter):
    """Log records that reach the console outside a run's logs (before ``run`` holds its folder's lock, e.g. the
    lock of a killed attempt broken on resume; ``status``, ``check``, ``plan``): the pipeline's own warnings as
    the console marks what needs the user (``! message``), a library's with its name; no timestamped log lines,
    and nothing below WARNING (a run's logs keep that, pipeline.base.logs)."""

    def format(self, record: logging.LogRecord) -> str:
        from pipeline.base.logs import OWN

        if record.name.startswith(OWN):
            return f"! {record.getMessage()}"
        return f"{record.levelname} {record.name}: {super().format(record)}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except KeyboardInterrupt:  # the user's Ctrl-C, not a bug: one line, not a traceback (the run's logs keep it)
        import shlex

        print(f"interrupted (exit {EXIT_INTERRUPTED}); nothing written is lost; re-run: "
              f"python -m pipeline {shlex.join(argv)}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _main(argv: list[str]) -> int:
    # Subcommands owned by their modules take their own flags.
    if argv and argv[0] == "audit":
        from pipeline.checks.audit import main as audit_main

        return audit_main(argv[1:])
    if argv and argv[0] == "serve-openrouter":
        from pipeline.demo.openrouter_server import main as serve_main

        return serve_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the pipeline from a YAML config")
    p.add_argument("config")
    p.add_argument("--output-dir", help="override output_dir from the config")
    p.add_argument("--verbose", action="store_true",
                   help="also print every log (vLLM, Ray, transformers, torch, the pipeline's own) on the console; "
                        "they always go to OUTPUT/logs/")
    p.set_defaults(fn=_run)
    p = sub.add_parser("check", help="validate a config without running anything")
    p.add_argument("config")
    p.add_argument("--no-paths", action="store_true", help="skip checks that model and dataset files exist")
    p.set_defaults(fn=_check)
    p = sub.add_parser("status", help="where a run stands (prompts done / to do, spend, training), from its folder")
    p.add_argument("config")
    p.add_argument("--output-dir", help="override output_dir from the config")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(fn=_status)
    p = sub.add_parser("value", help="train short drafters on cuts of each dataset: what its samples bought "
                                     "(value/value.json)")
    p.add_argument("config")
    p.add_argument("--output-dir", help="override output_dir from the config")
    p.add_argument("--datasets", default="", help="comma-separated datasets to cut (default: every dataset with "
                                                  "samples; the others stay whole in every drafter)")
    p.add_argument("--fractions", type=lambda t: _numbers(t, float), default=(0.0, 0.25, 0.5),
                   help="the fractions each dataset is cut to, each in [0, 1), the others whole (default "
                        "0,0.25,0.5; the full drafter is always trained too)")
    p.add_argument("--seeds", type=lambda t: _numbers(t, int), default=(0,), help="seeds per arm (default 0)")
    p.add_argument("--steps", type=int, help="steps of every drafter (default: the training config's); give them "
                                             "the steps the drafter the plan is for will train")
    p.add_argument("--verbose", action="store_true", help="also print every log on the console")
    p.set_defaults(fn=_value)
    p = sub.add_parser("plan", help="per-dataset budgets for the next spend, from value/value.json")
    p.add_argument("config")
    p.add_argument("--output-dir", help="override output_dir from the config")
    p.add_argument("--budget-usd", type=float, required=True, help="dollars to spend next")
    p.add_argument("--mix", nargs="*", default=[], metavar="DATASET=WEIGHT",
                   help="the serving mix to maximise acceptance on (default: the held-out mix)")
    p.set_defaults(fn=_plan)
    from pipeline.demo.tiny_model import VARIANTS

    p = sub.add_parser("build-tiny", help="build the tiny CPU target model folder")
    p.add_argument("out")
    p.add_argument("--variant", choices=VARIANTS, default="well-formed",
                   help="well-formed: clean reasoning-model behaviour; wild: random format tokens; "
                        "trained: trained on shop arithmetic (about a minute on 2 cores); "
                        "reasoning: trained on multi-step word problems, 100-300 token traces (about 3 minutes)")
    p.add_argument("--force", action="store_true")
    p.set_defaults(fn=_build_tiny)
    sub.add_parser("audit", help="audit sample shards (see `audit --help`)")
    sub.add_parser("serve-openrouter", help="local OpenRouter-compatible server (see `serve-openrouter --help`)")
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ConsoleFormat())
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    return args.fn(args)

