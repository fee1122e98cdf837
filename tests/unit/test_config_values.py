"""Config values a YAML file can hold but the run cannot use: booleans where numbers go, infinities and NaNs,
counts and thresholds out of range, YAML's off/on. Each is a ConfigError naming the key, never a silent value."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import yaml

from pipeline.base.config import ChecksConfig, ConfigError
from pipeline.run.config import RunConfig, load_config

BASE = {
    "output_dir": "out",
    "model": {"profile": "deepseek"},
    "datasets": [{"name": "chat", "path": "chat.jsonl"}],
    "sources": [{"kind": "vllm", "name": "local"},
                {"kind": "openrouter", "name": "api", "model": "m", "budgets": {"chat": 1000}}],
    "training": {"steps": 5},
}
API = 1  # index of the openrouter source in BASE


def _set(cfg: dict, dotted: str, value: object) -> dict:
    *parents, leaf = dotted.split(".")
    node = cfg
    for key in parents:
        node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
    node[int(leaf) if leaf.isdigit() else leaf] = value
    return cfg


def _load(tmp_path: Path, text: str) -> RunConfig:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(path, base_dir=tmp_path, check_paths=False)


def _error(tmp_path: Path, **changes: object) -> str:
    cfg = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        _set(cfg, dotted.replace("__", "."), value)
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, yaml.safe_dump(cfg))
    return str(err.value)


# -- booleans are not numbers -------------------------------------------------------


@pytest.mark.parametrize(("key", "where"), [
    (f"sources__{API}__budgets", "budgets.chat"),
    (f"sources__{API}__budgets_usd", "budgets_usd.chat"),
    (f"sources__{API}__default_budget", "default_budget"),
    (f"sources__{API}__default_budget_usd", "default_budget_usd"),
    (f"sources__{API}__max_in_flight", "max_in_flight"),
    (f"sources__{API}__num_actors", "num_actors"),
    (f"sources__{API}__resources", "resources.api_node"),
    ("sampling__max_tokens", "max_tokens"),
    ("sampling__seed", "seed"),
    ("training__steps", "training: steps"),
    ("training__aux_layer_ids", "aux_layer_ids.1"),
    ("datasets__0__max_rows", "max_rows"),
    ("datasets__0__checks__max_failures", "max_failures.billing"),
    ("extraction__num_actors", "num_actors"),
    ("routing__max_hops", "max_hops"),
])
def test_a_boolean_where_a_number_goes_is_refused_naming_the_key(tmp_path, key, where):
    """YAML reads an unquoted yes/no/true/false/on/off as a boolean and Python counts it as 1 or 0: ``budgets:
    {chat: yes}`` was a one-token cap and ``default_budget: no`` a cap of zero (a cap decision!)."""
    value: object = False
    if key.endswith(("budgets", "budgets_usd")):
        value = {"chat": True}
    elif key.endswith("resources"):
        value = {"api_node": True}
    elif key.endswith("aux_layer_ids"):
        value = [1, True, 3]
    elif key.endswith("max_failures"):
        value = {"billing": True}
    msg = _error(tmp_path, **{key: value})
    assert f"{where}: expected a number, got a boolean" in msg, msg


def test_the_yaml_words_themselves_are_refused(tmp_path):
    text = yaml.safe_dump(BASE).replace("chat: 1000", "chat: yes")
    with pytest.raises(ConfigError, match=r"sources\.1\.openrouter: budgets\.chat: expected a number"):
        _load(tmp_path, text)


# -- off and on are the modes of those names ------------------------------------------


def test_unquoted_off_and_on_mean_the_documented_modes(tmp_path):
    """README documents `roundtrip: off` and `max_price_guard: on`; YAML 1.1 made them booleans, refused."""
    text = yaml.safe_dump(BASE).replace("- name: chat\n", "- name: chat\n  checks: {roundtrip: off, billing: no, "
                                                          "repetition: off}\n")
    text = text.replace("name: api\n", "name: api\n  max_price_guard: on\n")
    cfg = _load(tmp_path, text)
    checks = cfg.datasets[0].checks
    assert (checks.roundtrip, checks.billing, checks.repetition, checks.structure) == ("off", "off", "off",
                                                                                     "quarantine")
    assert cfg.sources[API].max_price_guard == "on" and cfg.sources[API].guards_price()
    off = _load(tmp_path, text.replace("max_price_guard: on", "max_price_guard: off")).sources[API]
    assert off.max_price_guard == "off" and not off.guards_price()
    assert ChecksConfig.model_validate(yaml.safe_load("billing: off\nmax_failures: {billing: 3}")).billing == "off"


def test_on_is_no_check_mode(tmp_path):
    """`on` could mean quarantine or flag: refused naming the modes, never guessed."""
    msg = _error(tmp_path, datasets__0__checks={"billing": True})
    assert re.search(r"datasets\.0\.checks\.billing: on/yes/true is not a check mode: write quarantine, flag or off",
                     msg), msg


# -- finite numbers in range ------------------------------------------------------------


@pytest.mark.parametrize("key", [
    "training__lr", "training__grad_clip", "training__step_decay", f"sources__{API}__lease_s",
    f"sources__{API}__budget_wait_max_s", f"sources__{API}__request_timeout_s", "sampling__temperature",
    "ray__placement_timeout_s", "routing__deadline_s", "extraction__gpu_memory_gb",
])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_infinity_and_nan_are_refused(tmp_path, key, value):
    msg = _error(tmp_path, **{key: value})
    assert f"{key.replace('__', '.').replace(f'sources.{API}.', f'sources.{API}.openrouter.')}: Input should be a " \
           "finite number" in msg, msg


@pytest.mark.parametrize(("key", "value"), [
    ("datasets__0__checks__billing_rel_threshold", math.nan),  # the billing check would never fire
    ("datasets__0__checks__billing_rel_threshold", -0.1),  # every sample would be quarantined
    ("datasets__0__checks__billing_abs_threshold", -1),
    ("datasets__0__checks__repetition_ngram", 0),
    ("datasets__0__checks__repetition_ngram", -1),
    ("datasets__0__checks__repetition_max_repeats", 0),
    ("datasets__0__checks__max_total_tokens", -5),
    (f"sources__{API}__billing_abs_threshold", -1),
    (f"sources__{API}__billing_rel_threshold", math.nan),
    (f"sources__{API}__keepalive_s", -1),
    (f"sources__{API}__resources", {"api_node": -1}),
    (f"sources__{API}__resources", {"api_node": math.nan}),
    ("sources__0__resources", {"GPU": -1}),
    ("extraction__num_actors", 0),
    ("extraction__num_actors", -2),
    ("extraction__num_cpus", -1),
    ("extraction__num_gpus", -1),
    ("extraction__num_gpus", math.nan),
    ("extraction__resources", {"h200": -8}),
    ("training__resources_per_worker", {"CPU": -1}),
    ("ray__num_cpus", 0),
])
def test_out_of_range_values_are_refused_naming_the_key(tmp_path, key, value):
    dotted = key.replace("__", ".")
    dotted = dotted.replace(f"sources.{API}.", f"sources.{API}.openrouter.").replace("sources.0.", "sources.0.vllm.")
    msg = _error(tmp_path, **{key: value})
    assert re.search(rf"^\s*{re.escape(dotted)}(\.\w+)?: Input should be", msg, re.M), msg


@pytest.mark.parametrize("ids", [[1, 2], [3, 1, 2], [-5, 0, 1], [1, 1, 2]])
def test_extraction_aux_layer_ids_follow_the_rule_training_does(tmp_path, ids):
    """vLLM captures sorted(set(ids)): extraction accepted ids that training refused, so a run extracted states
    its drafter could not be built on."""
    for key in ("extraction__aux_layer_ids", "training__aux_layer_ids"):
        msg = _error(tmp_path, **{key: ids})
        assert f"{key.replace('__', '.')}: aux_layer_ids must be 3 strictly increasing layer ids >= 0, got {ids}" \
            in msg, msg
    assert _load(tmp_path, yaml.safe_dump(_set(copy.deepcopy(BASE), "extraction.aux_layer_ids", [0, 2, 5])))


@pytest.mark.parametrize(("max_actors", "expected"), [
    (0, "max_actors: Input should be greater than 0"),
    (-3, "max_actors: Input should be greater than 0"),
    (2, "max_actors (2) is below num_actors (4)"),  # the API source's default num_actors is 4
])
def test_max_actors_below_the_pool_is_refused(tmp_path, max_actors, expected):
    """The pool silently stayed at num_actors (the chain takes the larger)."""
    assert expected in _error(tmp_path, **{f"sources__{API}__max_actors": max_actors})
    assert _load(tmp_path, yaml.safe_dump(_set(copy.deepcopy(BASE), f"sources.{API}.max_actors", 4)))


@pytest.mark.parametrize(("max_price", "expected"), [
    ({"promt": 1}, "max_price.promt: Extra inputs are not permitted"),
    ({"prompt": -1}, "max_price.prompt: Input should be greater than or equal to 0"),
    ({"completion": math.nan}, "max_price.completion: Input should be a finite number"),
    ({"request": math.inf}, "max_price.request: Input should be a finite number"),
])
def test_provider_max_price_takes_openrouters_keys_as_finite_amounts(tmp_path, max_price, expected):
    msg = _error(tmp_path, **{f"sources__{API}__provider": {"max_price": max_price}})
    assert f"sources.{API}.openrouter.provider.{expected}" in msg, msg


def test_provider_max_price_goes_on_the_wire_as_written_and_lowers_the_guard():
    from pydantic import ValidationError

    from pipeline.generate.sources.http.config import OpenRouterSourceConfig
    from pipeline.generate.sources.http.engine import max_price

    with pytest.raises(ValidationError, match="max_price.imgae"):  # misspelt: it would cap nothing there
        OpenRouterSourceConfig(model="m", default_budget=10, provider={"max_price": {"prompt": 0.5, "imgae": 2}})
    src = OpenRouterSourceConfig(model="m", default_budget=10,
                                 provider={"max_price": {"prompt": 0.5, "image": 2, "request": 0}})
    wire = src.provider.wire()
    assert wire == {"max_price": {"prompt": 0.5, "image": 2.0, "request": 0.0}}
    # the guard's caps (dollars per token -> per million) lowered to the config's own, its other keys kept
    assert max_price((1e-6, 3e-6), wire["max_price"]) == {"prompt": 0.5, "completion": 3.0, "image": 2.0,
                                                          "request": 0.0}
