"""The console's text (pipeline.base.console) and where logs go (pipeline.base.logs): pure functions, a writer on
a buffer."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
from pathlib import Path

import pytest

from pipeline.base.console import (
    Console,
    ExtractWatch,
    GenerateSnapshot,
    TrainWatch,
    describe_source,
    describe_training,
    duration,
    eta,
    extract_line,
    generate_line,
    header_lines,
    heldout_line,
    last_json_line,
    quantity,
    spend_text,
    train_line,
)
from pipeline.base.layout import RunLayout
from pipeline.base.logs import Repeats, RunLogs, component_of, repeat_key, worker_component
from training.config import DraftTrainConfig

REPO = Path(__file__).resolve().parents[2]


def test_duration_and_quantity():
    assert [duration(s) for s in (0, 42.4, 65, 3600 * 2 + 7 * 60 + 5)] == ["0s", "42s", "1m05s", "2h07m"]
    assert duration(None) == duration(float("inf")) == duration(-1) == "--"
    assert [quantity(n) for n in (950, 3461, 12_345, 1_234_567)] == ["950", "3.5k", "12k", "1.2M"]
    assert quantity(None) == "--"


def test_eta():
    assert eta(0, 10, 5.0) is None
    assert eta(5, 10, 10.0) == 10.0
    assert eta(12, 10, 10.0) == 0.0  # more done than planned (re-routes): nothing left


def test_generate_line_live_and_final():
    s = GenerateSnapshot(done=17, total=68, passed=16, quarantined=1, not_generated=0, tokens=949, cost=0.0,
                         elapsed_s=20.0)
    live = generate_line(s)
    assert live.startswith("[generate] 17/68 done (16 passed, 1 quarantined, 0 not generated)")
    assert "949 tokens" in live and "47 tok/s" in live and live.endswith("ETA 1m00s")
    final = generate_line(s, final=True)
    assert final.startswith("[generate] 17/68 done in 20s") and "ETA" not in final


def test_generate_line_shows_spend_against_each_budget():
    s = GenerateSnapshot(10, 20, 10, 0, 0, 500, 0.0123, 10.0)
    spend = {"api": {"chat": (1200, 20_000), "code": (300, None)}}
    line = generate_line(s, spend)
    assert "spend api: chat 1.2k/20k, code 300/no cap tokens, $0.0123" in line
    assert spend_text({}) == "" and spend_text({}, 0.5) == "spend $0.5000"


def test_extract_train_heldout_lines():
    assert extract_line(34, 61, 2300, 5.0) == "[extract] 34/61 samples, 2.3k tokens, 460 tok/s, ETA 4s"
    assert extract_line(61, 61, 4000, 8.0, final=True) == "[extract] 61/61 samples in 8s, 4.0k tokens, 500 tok/s"
    m = {"step": 20, "loss": 71.7188, "acc_0": 0.0, "acc_1": 0.01, "acc_2": 0.02, "acc_10": 0.5,
         "tokens_per_s": 4335.0}
    line = train_line(m, 40, 10.0, start_step=10)
    assert line == "[train] step 20/40, loss 71.719, acc/position [0.00 0.01 0.02 0.50], 4.3k tok/s, ETA 20s"
    assert train_line(m, 40, 47.0, final=True).startswith("[train] step 20/40 done in 47s, loss 71.719")
    held = {"acceptance_length": 1.0049, "k": 3, "samples": 4, "per_position": [0.0, 0.0, 0.0]}
    assert heldout_line(held, 11.0) == ("[held-out] acceptance length 1.005 at k=3 on 4 samples never trained on, "
                                        "done in 11s")
    assert heldout_line({"skipped": "no samples held out"}, 1.0) == "[held-out] no samples held out"


def test_header_lines():
    lines = header_lines("configs/tiny.yaml", [("chat", 20), ("code", 14)], ["vllm-cpu (vllm, 1 actor)"],
                         "/tmp/out", 0, 34, "/tmp/out/logs")
    assert lines[0] == "pipeline run configs/tiny.yaml"
    assert lines[1] == "  datasets  chat 20, code 14 (34 rows)"
    assert "  to do     34 prompts" in lines and lines[-1].startswith("  logs      /tmp/out/logs/")
    resumed = header_lines("c.yaml", [("chat", 20)], [], "/o", 12, 8, None)
    assert "  resume    12 rows already done, 8 to do" in resumed and not any("logs" in x for x in resumed)
    fresh = header_lines("c.yaml", [("chat", 20)], [], "/o", 0, 20, None, estimated=True)
    assert "  to do     at most 20 prompts (malformed rows are counted while generation starts)" in fresh


def test_generate_line_marks_a_total_still_being_counted():
    s = GenerateSnapshot(5, 20, 5, 0, 0, 100, 0.0, 10.0, estimated=True)
    assert generate_line(s).startswith("[generate] 5/~20 done (5 passed")


def test_the_header_says_what_trains_and_when_training_is_only_defaulted():
    from pipeline.run.config import load_config

    lines = header_lines("c.yaml", [("chat", 20)], ["s"], "/o", 0, 20, None, "80 steps, 3 TTT steps")
    assert lines[3] == "  training  80 steps, 3 TTT steps"
    cfg = load_config(REPO / "configs/tiny.yaml", check_paths=False)
    assert describe_training(cfg.training, True) == "80 steps, 3 TTT steps, draft vocab 256, 10% held out"
    defaulted = describe_training(DraftTrainConfig(), False)
    assert defaulted.startswith("1,000 steps, 7 TTT steps, draft vocab 32,000, 2% held out (defaults: ")
    assert "training: null turns it off" in defaulted
    assert describe_training(None, True) == "off (training: null)"


def test_describe_source_from_each_kinds_schema():
    """What follows the kind is the schema's own ``describe``: no field is probed on a source config."""
    from pipeline.generate.sources.engines.config import SGLangSourceConfig, VLLMSourceConfig
    from pipeline.generate.sources.http.config import OpenRouterSourceConfig

    assert describe_source(VLLMSourceConfig(name="vllm-cpu")) == "vllm-cpu (vllm, 1 actor)"
    assert describe_source(SGLangSourceConfig(num_actors=2, max_actors=2)) == "sglang (sglang, 2 actors)"
    api = OpenRouterSourceConfig(name="api", model="m/x", num_actors=2, max_actors=4, budgets={"chat": 20_000},
                                 budgets_usd={"chat": 1.5, "code": "unlimited"})
    assert describe_source(api) == ("api (openrouter, model m/x, 2-4 actors, budgets chat 20k, "
                                    "budgets_usd chat $1.50, code unlimited)")


def api_source(name: str, **caps: object) -> object:
    from pipeline.generate.sources.http.config import OpenRouterSourceConfig

    return OpenRouterSourceConfig(name=name, model="m", **caps)


def test_read_spend_from_ledger_journals(tmp_path: Path):
    """Both journal layouts: the ledger's own (format 2, tokens and dollars) and the first one."""
    from pipeline.generate.ledger import Ledger, read_spend

    layout = RunLayout(tmp_path)
    ledger = Ledger(budgets={"chat": 20_000, "code": 14_000}, journal=str(layout.ledger("api")))
    assert ledger.apply([("reserve", "chat", 1200)])[0] == ["granted"]  # the actors' batched entry point
    assert "#format" in json.loads(layout.ledger("api").read_text())  # what a run's ledger writes today
    src = api_source("api", budgets={"chat": 20_000, "code": 14_000})
    fresh = api_source("new", default_budget=500)
    assert read_spend(layout, [src, fresh]) == {"api": {"chat": (1200, 20_000), "code": (0, 14_000)}, "new": {}}
    layout.ledger("old").write_text(json.dumps({"chat": 700}))
    assert read_spend(layout, [api_source("old", default_budget="unlimited")]) == {
        "old": {"chat": (700, None)}}
    layout.ledger("torn").write_text('{"#format": 2, "tok')
    assert read_spend(layout, [api_source("torn", budgets={"chat": 5})]) == {
        "torn": {"chat": (0, 5)}}


def test_last_json_line_skips_a_torn_tail(tmp_path: Path):
    p = tmp_path / "metrics.jsonl"
    assert last_json_line(p) is None
    p.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert last_json_line(p) == {"step": 2}


def test_watches_count_only_what_happens_after_they_start(tmp_path: Path):
    stats = tmp_path / "extract_stats"
    stats.mkdir()
    (stats / "extract-h-1.json").write_text(json.dumps({"samples": 10, "tokens": 100}))  # an earlier pass
    watch = ExtractWatch(stats, total=5)
    assert watch.line() == "[extract] starting the extraction actors (5 samples)"
    (stats / "extract-h-1.json").write_text(json.dumps({"samples": 12, "tokens": 150}))
    (stats / "extract-h-2.json").write_text(json.dumps({"samples": 3, "tokens": 30}))
    assert watch.counts() == (5, 80)

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 40, "loss": 1.0, "acc_0": 0.5, "tokens_per_s": 10}) + "\n")
    os.utime(metrics, (time.time() - 60, time.time() - 60))  # a finished earlier attempt's log
    train = TrainWatch(metrics, 40, watch)
    shown = train.lines()  # no new step yet: the extraction feeding it is what shows
    assert len(shown) == 1 and shown[0].startswith("[extract] 5/5 samples, 80 tokens,")
    with metrics.open("a") as fh:
        fh.write(json.dumps({"step": 41, "loss": 0.5, "acc_0": 0.6, "tokens_per_s": 20}) + "\n")
    first = train.lines()
    assert first[0].startswith("[extract] 5/5 samples in") and first[1].startswith("[train] step 41/40")
    assert [x[:7] for x in train.lines(final=True)] == ["[train]"]


def test_console_plain_prints_phase_lines_and_final(monkeypatch):
    buf = io.StringIO()
    console = Console(buf, tty=False, every_s=1000)
    calls = []

    def render(final: bool) -> list[str]:
        calls.append(final)
        return ["[x] a sub-phase done", "[x] final"] if final else ["[x] working"]

    with console.phase(render, announce=True):
        pass
    assert buf.getvalue().splitlines() == ["[x] working", "[x] a sub-phase done", "[x] final"]
    assert calls[0] is False and calls[-1] is True


def test_console_terminal_redraws_in_place():
    buf = io.StringIO()
    console = Console(buf, tty=True)
    console.live("[generate] 1/2")
    console.live("[generate] 2/2")
    console.line("done")
    assert buf.getvalue() == "\r\x1b[K[generate] 1/2\r\x1b[K[generate] 2/2\r\x1b[Kdone\n"
    assert not Console(io.StringIO(), tty=True, verbose=True).tty  # log lines would tear a redrawn line


def test_console_phase_clears_its_line_on_failure():
    buf = io.StringIO()
    console = Console(buf, tty=True)
    try:
        with console.phase(lambda final: "[x] working"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert buf.getvalue().endswith("\r\x1b[K") and "\n" not in buf.getvalue()


def test_components_and_worker_files():
    assert component_of("pipeline.run.job") == component_of("training.train") == "pipeline"
    assert component_of("ray.data._internal.logging") == "ray" and component_of("raylet") == "other"
    assert component_of("vllm.v1.engine") == "vllm" and component_of("huggingface_hub.file") == "transformers"
    assert component_of("py.warnings") == "warnings"
    assert worker_component("MapWorker(MapBatches(VLLMGenerator))") == "worker-VLLMGenerator"
    assert worker_component("RayTrainWorker") == "worker-RayTrainWorker"
    assert worker_component(None, "ReadParquet->SplitBlocks(2)") == "worker-ReadParquet-_SplitBlocks_2"
    assert worker_component(None, None, "autoscaler") == "ray-autoscaler"
    assert worker_component("", "") == "worker-task"


def test_repeated_warnings_are_counted_errors_never():
    assert repeat_key("INFO 12-01 [core.py:12] started") is None
    assert repeat_key("WARNING 12-01 07:28:12 [cpu.py:224] Triton is not installed.") == \
        repeat_key("WARNING 12-01 08:00:01 [cpu.py:224] Triton is not installed.")
    r = Repeats()
    line = "(pid=5400) Failed to query state. WARNING: State API may be temporarily unavailable."
    assert [r.seen("worker-PGC", line) for _ in range(3)] == [False, True, True]
    assert not r.seen("worker-other", line)  # counted per file
    assert not r.seen("worker-PGC", "Traceback (most recent call last):")  # not a warning: always written
    assert not r.seen("worker-PGC", "Traceback (most recent call last):")
    assert r.summary() == [("worker-PGC", f"(repeated 2 more times) {line}")]


def test_run_logs_route_records_to_component_files(tmp_path: Path):
    noisy = logging.getLogger("vllm.fake")
    own_handler = logging.StreamHandler(sys.stderr)  # a library's own console handler
    noisy.addHandler(own_handler)
    noisy.propagate = False
    buf = io.StringIO()
    logs = RunLogs(tmp_path, verbose=False, console=Console(buf, tty=False))
    logs.install()
    try:
        noisy.warning("kv cache is small")
        noisy.warning("kv cache is small")
        logging.getLogger("pipeline.prompts.datasets").warning("dataset 'x' holds no rows")
        logging.getLogger("pipeline.prompts.datasets").debug("a debug line of ours")
        logging.getLogger("ray.data").debug("Ray Data's debug chatter")
        logging.getLogger("ray.data").info("execution finished")
        import warnings

        warnings.warn("an unknown warning", UserWarning, stacklevel=1)
    finally:
        logs.close()
    assert noisy.handlers == [own_handler] and noisy.propagate is False  # put back as it was
    vllm = (tmp_path / "vllm.log").read_text()
    assert vllm.count("kv cache is small") == 2 and "(repeated 1 more times) WARNING vllm.fake: kv cache" in vllm
    own = (tmp_path / "pipeline.log").read_text()
    assert "holds no rows" in own and "a debug line of ours" in own
    ray_log = (tmp_path / "ray.log").read_text()
    assert "execution finished" in ray_log and "chatter" not in ray_log
    assert "an unknown warning" in (tmp_path / "warnings.log").read_text()
    assert buf.getvalue() == "! dataset 'x' holds no rows\n"  # the pipeline's own warning needs the user


def test_worker_output_goes_to_its_file(tmp_path: Path):
    logs = RunLogs(tmp_path, verbose=False)
    batch = {"pid": 3279, "ip": "10.0.0.1", "localhost": "10.0.0.1",
             "actor_name": "MapWorker(MapBatches(VLLMGenerator))", "is_err": True,
             "lines": ["(EngineCore pid=4022) INFO loading", "Traceback (most recent call last):"]}
    logs.worker_output(batch)
    again = ["WARNING 1 a warning", "WARNING 2 a warning"]
    logs.worker_output(dict(batch, ip="10.0.0.2", lines=again))
    logs.close()
    text = (tmp_path / "worker-VLLMGenerator.log").read_text()
    assert "(pid=3279) (EngineCore pid=4022) INFO loading" in text and "Traceback" in text
    assert "(pid=3279, ip=10.0.0.2) WARNING 1 a warning" in text and "WARNING 2" not in text
    assert "(repeated 1 more times) (pid=3279, ip=10.0.0.2) WARNING 1 a warning" in text


def test_transformers_is_imported_only_where_used_and_then_logs_to_its_file(tmp_path: Path) -> None:
    """A run's start does not import transformers (~0.7 s before the first answer of a run that neither builds a
    tiny target nor trains); where the driver first uses it, its own stderr handler is taken over, so its lines
    land in ``transformers.log`` and not, through that handler, in ``output.log``. In a fresh interpreter: this
    one has imported transformers long ago."""
    import subprocess

    code = (
        "import sys\n"
        "from pipeline.base.logs import adopt_transformers_logging, capture\n"
        "with capture(sys.argv[1]):\n"
        "    assert 'transformers' not in sys.modules, 'the start imported transformers'\n"
        "    adopt_transformers_logging()\n"
        "    from transformers.utils import logging as hf_logging\n"
        "    hf_logging.get_logger('transformers.models').warning('a line from transformers')\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a line from transformers" in (tmp_path / "transformers.log").read_text()
    assert "a line from transformers" not in (tmp_path / "output.log").read_text()


@pytest.mark.parametrize(("raw", "every"), [("5", 5.0), (" 0.5 ", 0.5), ("", 30.0), ("abc", 30.0), ("0", 30.0),
                                            ("-5", 30.0), ("nan", 30.0), ("inf", 30.0)])
def test_the_progress_interval_from_the_environment(monkeypatch, capsys, raw, every):
    """A bad ``PIPELINE_PROGRESS_S`` falls back to the default with one warning: it stopped the run with a
    traceback (``abc``) or flooded the console (``0``) before."""
    monkeypatch.setenv("PIPELINE_PROGRESS_S", raw)
    console = Console(io.StringIO(), tty=False)
    assert console.every_s == every
    warned = capsys.readouterr().err
    assert ("PIPELINE_PROGRESS_S" in warned) == (raw.strip() not in ("", "5", "0.5"))
