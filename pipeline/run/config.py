"""The whole run config: the shared schemas (``pipeline.base.config``) with every source kind's
(``pipeline.generate.sources.registry`` builds the ``sources:`` union), loaded from YAML and checked before Ray
starts. It sits on the top floor because it names every kind; the floors below take a ``RunConfig`` only as a
type (``if TYPE_CHECKING``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import ConfigDict, Field, ValidationError, model_validator

from pipeline.base.config import (
    ConfigError,
    DatasetConfig,
    ExtractionConfig,
    ModelConfig,
    RayConfig,
    RoutingConfig,
    SamplingConfig,
    StagesConfig,
    Strict,
    check_routing,
)
from pipeline.generate.sources.registry import SourceConfig
from training.config import DraftTrainConfig

__all__ = ["ConfigError", "RunConfig", "load_config"]


def _duplicates(names: Sequence[str]) -> list[str]:
    return sorted(n for n, c in Counter(names).items() if c > 1)


class RunConfig(Strict):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # as for OpenRouterSourceConfig

    output_dir: str
    model: ModelConfig
    datasets: list[DatasetConfig] = Field(min_length=1)
    sources: list[SourceConfig] = Field(min_length=1)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    extraction: ExtractionConfig = Field(default_factory=ExtractionConfig)
    training: DraftTrainConfig | None = Field(default_factory=DraftTrainConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    stages: StagesConfig = Field(default_factory=StagesConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        names = [s.name for s in self.sources]
        if dup := _duplicates(names):
            raise ValueError(f"source names must be unique: {dup} appear more than once")
        ds_names = [d.name for d in self.datasets]
        if dup := _duplicates(ds_names):
            raise ValueError(f"dataset names must be unique: {dup} appear more than once")
        by_account: dict[str, list[str]] = {}
        for s in self.sources:
            if (account := s.budget_account()) is not None:
                by_account.setdefault(account, []).append(s.name)
        if shared := [v for v in by_account.values() if len(v) > 1]:
            raise ValueError(f"API sources {shared[0]} have the same model and base_url, so they would share one "
                             "budget account: give each its own budget_scope (budgets follow model, base_url and "
                             "budget_scope, not the name)")
        for d in self.datasets:
            for s in d.sources or []:
                if s not in names:
                    raise ValueError(f"dataset {d.name!r} names unknown source {s!r} (known: {names})")
        for s in self.sources:
            if problem := s.run_problem(self.datasets):
                raise ValueError(problem)
        check_routing(self.routing, names, ds_names)
        if self.training and self.training.aux_layer_ids and self.extraction.aux_layer_ids \
                and self.training.aux_layer_ids != self.extraction.aux_layer_ids:
            raise ValueError(f"training.aux_layer_ids {self.training.aux_layer_ids} differ from "
                             f"extraction.aux_layer_ids {self.extraction.aux_layer_ids}")
        if self.model.path is None and self.model.build_tiny:
            raise ValueError("model.build_tiny needs model.path")
        ex = self.extraction
        if ex.tensor_parallel_size > 1 and ex.mode == "stream" and self.training and not self.training.materialize:
            # each epoch's pass would start new engine actors in new placement groups, released only at the end
            raise ValueError(f"extraction.tensor_parallel_size {ex.tensor_parallel_size} with mode stream and "
                             "training.materialize false re-runs the engine extraction every epoch, each time in "
                             "new placement groups: use extraction.mode shards (one pass; epochs read the "
                             "shards) or training.materialize true")
        return self

    def sizing_misfit(self) -> str | None:
        """Why the extraction actor cannot hold the target's weights, or None (see pipeline.base.sizing)."""
        from pipeline.base.sizing import extraction_misfit

        return extraction_misfit(self.model, self.extraction)




class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping: PyYAML keeps the last silently, so a
    pasted ``budgets_usd:`` below the first would drop a dollar cap without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # ``<<: *anchor`` merges; a key written beside it overrides it, as YAML means
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
                seen.setdefault(key, line)
            except TypeError:
                continue  # an unhashable key: the base constructor says so
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"key {key!r} appears twice (lines {first} and {line}): YAML would keep the last one "
                    "silently; keep one", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _resolve(path: str, base: Path) -> str:
    p = Path(path)
    return str(p if p.is_absolute() else (base / p))


def load_config(path: str | Path, *, base_dir: str | Path | None = None, check_paths: bool = True) -> RunConfig:
    """Load and validate a run config. Relative paths resolve against ``base_dir`` (default: cwd).

    ``check_paths=False`` validates the schema only, for a cluster config checked away from its cluster.
    Either way the extraction sizing check runs (pipeline.base.sizing): on the model folder's checkpoint index
    when the folder can be read, else on ``model.weights_gb``.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.load(path.read_bytes().decode("utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 (safe)
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text: byte {e.object[e.start]:#04x} at offset {e.start} cannot be "
                          "decoded; save the file as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(whole config)"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {loc}: {msg}")
        raise ConfigError(f"{path}: invalid config\n" + "\n".join(lines)) from None
    base = Path(base_dir) if base_dir else Path.cwd()
    cfg.output_dir = _resolve(cfg.output_dir, base)
    if cfg.model.path:
        cfg.model.path = _resolve(cfg.model.path, base)
        if check_paths and not cfg.model.build_tiny and not Path(cfg.model.path).is_dir():
            raise ConfigError(f"{path}: model.path does not exist: {cfg.model.path}")
    for d in cfg.datasets:
        d.path = _resolve(d.path, base)
        if check_paths and Path(d.path).is_dir():
            raise ConfigError(f"{path}: dataset {d.name!r}: is a folder, expected a .jsonl, .json or .parquet file: "
                              f"{d.path}")
        if check_paths and not Path(d.path).is_file():
            raise ConfigError(f"{path}: dataset {d.name!r}: file not found: {d.path}")
        if not d.path.endswith((".jsonl", ".json", ".parquet")):
            raise ConfigError(f"{path}: dataset {d.name!r}: expected a .jsonl, .json or .parquet file: {d.path}")
    if misfit := cfg.sizing_misfit():  # after paths resolve: the model folder's checkpoint index is read
        raise ConfigError(f"{path}: {misfit}")
    if cfg.model.path and check_paths and not cfg.model.build_tiny:
        from pipeline.profiles import check_model_folder

        # the tokenizer and template the folder claims, before Ray starts: never a silent fallback
        if reason := check_model_folder(cfg.model.profile, cfg.model.path):
            raise ConfigError(f"{path}: model.path: {reason}")
    return cfg
