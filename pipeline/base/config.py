"""The schemas every stage shares: model, sampling, checks, datasets, extraction, Ray, CPU pools, routing, and
what every source kind's schema has (``SourceConfigBase``).

Each source kind's own schema lives beside its adapter (``pipeline.generate.sources.engines.config``,
``...http.config``) and the registry builds the config union from them; the whole run config, ``RunConfig``,
sits on top in ``pipeline.run.config``. This module imports no runtime code (no Ray, engines, sources or
stages). Cross-field rules live in the validators, so ``python -m pipeline check`` catches everything a run
would refuse later.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pipeline.profiles import PROFILE_NAMES


def _takes_number(annotation: Any) -> bool:
    """Whether a field's type takes an int or a float anywhere (alone, optional, as dict values or list items)."""
    return annotation in (int, float) or any(_takes_number(a) for a in get_args(annotation))


def _boolean_in(value: Any, where: str) -> str | None:
    """The dotted key in ``value`` (a scalar, or a dict's values / a list's items) holding a boolean, or None."""
    if isinstance(value, bool):
        return where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    return next((w for k, v in items if (w := _boolean_in(v, f"{where}.{k}"))), None)


class Strict(BaseModel):
    """Every config schema: unknown keys refused, numbers finite and never booleans.

    YAML 1.1 reads an unquoted true/false, yes/no, on/off as a boolean and Python counts a boolean as the int 1
    or 0, so without the check ``budgets: {chat: yes}`` would be a cap of one token and ``default_budget: no`` a
    cap of zero: a slip silently becoming a spending decision. ``.inf``/``.nan`` are refused for every float (a
    NaN threshold never fires, an infinite timeout never ends).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        # a model validator, not a "*" field validator: pydantic allows none of those on a union's `kind`
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                key = field.alias if field.alias and field.alias in data else name
                if key in data and _takes_number(field.annotation) and (where := _boolean_in(data[key], key)):
                    raise ValueError(f"{where}: expected a number, got a boolean (YAML reads unquoted true/false, "
                                     "yes/no and on/off as booleans)")
        return data


_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def check_name(what: str, name: str) -> str:
    """A source or dataset name, which becomes part of file names (``ledger-<source>.json``,
    ``responses/<source>-<id>.jsonl``): no separators, no ``.``/``..``, nothing a path could escape with."""
    if not _SAFE_NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"{what} name {name!r} may hold only letters, digits, '_', '.' and '-' and may not be "
                         "'.' or '..' (it is part of file names)")
    return name


class ModelConfig(Strict):
    """The target: a profile plus, optionally, a model folder whose tokenizer and template win."""

    profile: str = "deepseek"  # a name in pipeline.profiles.PROFILES
    path: str | None = None
    build_tiny: bool = False  # build the tiny CPU target at `path` when it is absent
    # Which tiny target: "well-formed" behaves like a trained reasoning model (a clean run passes every
    # check); "wild" writes </think>, end-of-turn and tool markers at random (the checks' hard cases);
    # "trained" is trained on shop arithmetic (peaked like a real model; give it that domain's prompts);
    # "reasoning" on multi-step word problems worked step by step (100-300 token answers: tiny_reasoning.py).
    # "mixed" on both at once (tiny_mixed.py: two datasets whose drafters learn at different rates).
    tiny_variant: Literal["well-formed", "wild", "trained", "reasoning", "mixed"] = "well-formed"
    # Size of the target's weights in GB (10^9 bytes), for the extraction sizing check made away from the
    # weights (`check --no-paths`); a readable model folder's checkpoint index wins (pipeline.base.sizing).
    weights_gb: float | None = Field(None, gt=0)

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, v: str) -> str:
        if v not in PROFILE_NAMES:
            raise ValueError(f"unknown model profile {v!r} (known: {', '.join(PROFILE_NAMES)})")
        return v


def aux_layer_ids_problem(ids: list[int] | None) -> str | None:
    """Why ``aux_layer_ids`` cannot be captured, or None. vLLM captures ``sorted(set(ids))``: any other order or
    a duplicate breaks the drafter's fc input, and a negative id names no decoder layer. (The upper bound, the
    target's layer count, is checked once the target is known: training.config.resolve_aux_layer_ids.)"""
    if ids is not None and (len(ids) != 3 or sorted(set(ids)) != ids or ids[0] < 0):
        return f"aux_layer_ids must be 3 strictly increasing layer ids >= 0, got {ids}"
    return None


Resources = dict[str, Annotated[float, Field(ge=0)]]  # custom Ray resources: amounts >= 0


class SamplingConfig(Strict):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(128, gt=0)
    seed: int = Field(0, ge=0)


CheckMode = Literal["quarantine", "flag", "off"]


def _check_switch(value: Any) -> Any:
    """An unquoted ``off`` (or ``no``/``false``) is YAML's boolean false: it means the mode ``off``. A true has
    no mode to mean (quarantine or flag?), so it is refused naming them."""
    if value is False:
        return "off"
    if value is True:
        raise ValueError("on/yes/true is not a check mode: write quarantine, flag or off")
    return value


CheckSetting = Annotated[CheckMode, BeforeValidator(_check_switch)]


class ChecksConfig(Strict):
    """What each named check does when it fails: quarantine the sample, flag it, or skip the check."""

    structure: CheckSetting = "quarantine"
    # Engine ids that do not re-encode are real (non-canonical) model output: flag and count them.
    roundtrip: CheckSetting = "flag"
    # Rebuilt ids that do not re-encode mean the rebuild or tokenizer is broken: quarantine.
    roundtrip_rebuilt: CheckSetting = "quarantine"
    # Only rebuilt ids are billed (engines bill nothing): ids that cannot account for the bill,
    # over both thresholds below, are not trustworthy training data.
    billing: CheckSetting = "quarantine"
    tool_semantics: CheckSetting = "quarantine"
    empty_content: CheckSetting = "flag"
    truncated: CheckSetting = "flag"
    repetition: CheckSetting = "quarantine"
    max_length: CheckSetting = "quarantine"
    # Rebuilt ids the API's text and bill do not pin down (a bill a token off fitting two readings, reasoning
    # hidden with no bill to show it was empty, a filtered answer): they may be a token wrong, so quarantine.
    # Engine ids are never judged by it.
    rebuild: CheckSetting = "quarantine"
    repetition_ngram: int = Field(8, gt=0)
    repetition_max_repeats: int = Field(8, gt=0)  # a loop seen once is no repetition
    max_total_tokens: int = Field(32768, gt=0)
    billing_abs_threshold: int = Field(8, ge=0)
    billing_rel_threshold: float = Field(0.05, ge=0)
    # Audit gate: most detections (failed + flagged) a check may have before `audit` exits non-zero.
    # Unlisted checks allow 0 in quarantine mode and any number in flag mode.
    max_failures: dict[str, int] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_gate_names(self) -> ChecksConfig:
        modes = {n for n, f in type(self).model_fields.items() if f.annotation == CheckMode} - {"roundtrip_rebuilt"}
        unknown = sorted(set(self.max_failures) - modes)
        if unknown:
            raise ValueError(f"max_failures names unknown checks {unknown} (known: {sorted(modes)})")
        if any(v < 0 for v in self.max_failures.values()):
            raise ValueError("max_failures values must be >= 0")
        return self


# The fields each dataset format reads, which ``columns:`` may remap (pipeline.prompts.datasets.DEFAULT_COLUMNS
# holds the same keys with their default column names; a test holds the two equal).
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "messages": ("messages", "tools"),
    "sharegpt": ("conversations", "system", "tools"),
    "instruction": ("instruction", "input", "system"),
    "glaive": ("system", "chat"),
}


def may_serve(allowed: Sequence[str] | None, source: str) -> bool:
    """Whether ``source`` may serve a dataset whose ``sources:`` is ``allowed``: None (the key left out) lets
    every source serve it, a list only those it names. The one rule both the router (who gets a prompt) and the
    budget check (who needs a cap) ask, so a source can never be routed a dataset it was not capped for."""
    return allowed is None or source in allowed


class DatasetConfig(Strict):
    """A prompt file, how to read its rows, and how its prompts are generated."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    path: str
    format: Literal["messages", "sharegpt", "instruction", "glaive"] = "messages"
    # Column names in the file for the fields the format reads.
    columns: dict[str, str] = Field(default_factory=dict)
    thinking: bool = True
    max_rows: int | None = Field(None, gt=0)
    sources: list[str] | None = None  # names of the sources allowed to serve this dataset (left out: all)
    checks: ChecksConfig = Field(default_factory=ChecksConfig)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_name("dataset", v)

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, v: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        # an unknown key would be ignored: `columns: {tool: functions}` silently drops every prompt's tools
        fmt = info.data.get("format")
        if fmt in FORMAT_FIELDS and (unknown := sorted(set(v) - set(FORMAT_FIELDS[fmt]))):
            raise ValueError(f"unknown fields {unknown} for format {fmt}: columns maps the fields the format "
                             f"reads to the file's column names (allowed keys: {', '.join(FORMAT_FIELDS[fmt])})")
        return v

    @field_validator("sources")
    @classmethod
    def _some_source(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError("an empty list lets no source serve this dataset: name at least one source, or "
                             "leave sources out to let every source serve it")
        return v


def engine_actor_resources(num_cpus: float, num_gpus: float, tensor_parallel_size: int,
                           resources: dict[str, float]) -> dict[str, float]:
    """What one engine actor needs on one node: its CPUs, its GPUs (the TP group's, when larger; each TP bundle
    takes a CPU) and its custom resources."""
    need: dict[str, float] = {"CPU": float(num_cpus)}
    if num_gpus > 0:
        need["GPU"] = max(float(num_gpus), float(tensor_parallel_size))
        if tensor_parallel_size > 1:
            need["CPU"] = max(need["CPU"], float(tensor_parallel_size))
    for k, v in resources.items():
        need[k] = need.get(k, 0.0) + float(v)
    return need


class SourceConfigBase(Strict):
    """What every source kind's schema has, and the questions the run asks of any source.

    The kinds (``pipeline.generate.sources.registry``) override the answers; nothing else looks at a source's
    kind or probes its fields: the run's cross-checks, the console, placement and the costs ask these.
    """

    kind: str
    name: str
    num_actors: int = Field(1, gt=0)
    max_actors: int | None = Field(None, gt=0)  # > num_actors: Ray Data grows the pool while the queue is backed up
    num_cpus: float = Field(1.0, ge=0)
    batch_size: int = Field(16, gt=0)
    # Custom Ray resources the actor needs in all (e.g. {h200: 8} to stay on cluster.yaml's H200 nodes, {api_node:
    # 1} to keep HTTP actors on the nodes that carry it)
    resources: Resources = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_name("source", v)

    @model_validator(mode="after")
    def _pool_bounds(self) -> SourceConfigBase:
        # the pool would silently stay at num_actors (pipeline.generate.sources.chain takes the larger)
        if self.max_actors is not None and self.max_actors < self.num_actors:
            raise ValueError(f"source {self.name!r}: max_actors ({self.max_actors}) is below num_actors "
                             f"({self.num_actors}); the pool grows from num_actors up to max_actors")
        return self

    def describe(self) -> list[str]:
        """What the console says of this source after its kind: ``model m``, ``2-4 actors``, its caps."""
        span = f"{self.num_actors}-{self.max_actors}" if self.max_actors and self.max_actors != self.num_actors \
            else str(self.num_actors)
        return [f"{span} actor{'s' if span != '1' else ''}"]

    def actor_resources(self) -> dict[str, float]:
        """What one of its actors needs on one node (placement checks it against the cluster's nodes)."""
        return {"CPU": float(self.num_cpus), **{k: float(v) for k, v in self.resources.items()}}

    def tools_sent(self) -> bool:
        """Whether prompts' tool definitions reach the model as tools (engines render them into the prompt)."""
        return False

    def budget_account(self) -> str | None:
        """Whose spend its budget ledger holds (two sources with one account would share a budget); None: it
        spends nothing."""
        return None

    def device_hour_usd(self) -> float | None:
        """Dollars per device-hour that price the engine time of its samples; None: not priced."""
        return None

    def run_problem(self, datasets: Sequence[DatasetConfig]) -> str | None:
        """Why this source cannot serve the run's ``datasets`` as configured (a cap missing, a key naming no
        dataset), or None."""
        return None


@dataclass(frozen=True)
class ExtractionBackend:
    """One extraction backend: what the floors that must not import it ask of it (the config's checks, the
    sizing check, the actor's placement), and, by name, the function that builds its capture in the actor."""

    name: str
    # an engine: TP > 1 runs as the engine's Ray workers in the actor's placement group, and the actor gets the
    # engine actors' runtime env so it stops the engine itself when retired (chain.ENGINE_ACTOR_ENV)
    holds_engine: bool
    capture: str  # "module:function" (pipeline.hidden.extract), imported only in the extraction actor

    def gpus(self, ex: ExtractionConfig) -> tuple[float, str]:
        """(GPUs the weights are spread over, why) for an ``extraction:`` block of this backend."""
        if self.holds_engine:
            return float(ex.tensor_parallel_size), f"backend {self.name} shards it over tensor_parallel_size " \
                                                   f"{ex.tensor_parallel_size}"
        if ex.device_map:
            return float(ex.num_gpus), f"backend {self.name} with device_map {ex.device_map!r} spreads it over num_gpus"
        return min(float(ex.num_gpus), 1.0), f"backend {self.name} without device_map puts the whole model on one GPU"

    def build_capture(self) -> Any:
        module, name = self.capture.split(":")
        return getattr(import_module(module), name)


EXTRACTION_BACKENDS = {b.name: b for b in (
    ExtractionBackend("transformers", holds_engine=False, capture="pipeline.hidden.extract:transformers_capture"),
    ExtractionBackend("vllm", holds_engine=True, capture="pipeline.hidden.extract:vllm_capture"),
)}


class ExtractionConfig(Strict):
    """Hidden-state capture; ``mode: stream`` feeds training directly, ``shards`` stages Arrow shards on disk."""

    aux_layer_ids: list[int] | None = None  # default [2, L//2, L-3]; vLLM convention (input of layer i)
    mode: Literal["stream", "shards"] = "stream"
    backend: Literal["transformers", "vllm"] = "transformers"  # an EXTRACTION_BACKENDS name (a test holds them equal)
    dtype: str = "auto"  # bf16 on GPU, fp32 on CPU
    device_map: str | None = None  # e.g. "auto" for a target that spans several GPUs
    vllm: dict[str, Any] = Field(default_factory=dict)  # engine options for backend vllm
    batch_tokens: int = Field(4096, gt=0)
    rows_per_call: int = Field(128, gt=0)  # rows per actor call: more rows, less padding after sorting
    max_len: int = Field(4096, gt=0)
    too_long: Literal["truncate", "quarantine"] = "truncate"
    samples_per_shard: int = Field(64, gt=0)
    # storage dtype of the captured states, in shards and in rows streamed to training: bfloat16 halves the
    # bytes and is lossless for states captured in bf16 (GPU)
    shard_dtype: Literal["float32", "bfloat16"] = "float32"
    # store the target's full-vocab argmax per token, computed next to the states on the extraction device, so
    # training never multiplies by the full lm_head (false: each training worker computes it once per sample).
    # Unset: on, except for a vllm engine with TP > 1, whose actor holds no GPU of its own
    target_ids: bool | None = None
    num_actors: int = Field(1, gt=0)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    # backend vllm on GPUs: TP > 1 places each actor like a vLLM source's (pipeline.generate.sources.chain): a
    # placement group of TP one-GPU bundles on one node, filled by the engine's Ray TP workers
    tensor_parallel_size: int = Field(1, gt=0)
    resources: Resources = Field(default_factory=dict)  # custom Ray resources, as for engine sources
    # memory of one GPU in GB (10^9 bytes) for the sizing check (pipeline.base.sizing): 141 = H200, 80 = H100
    gpu_memory_gb: float = Field(141.0, gt=0)

    @field_validator("aux_layer_ids")
    @classmethod
    def _capturable(cls, ids: list[int] | None) -> list[int] | None:
        if problem := aux_layer_ids_problem(ids):
            raise ValueError(problem)
        return ids

    @model_validator(mode="after")
    def _parallelism(self) -> ExtractionConfig:
        if "tensor_parallel_size" in self.vllm:
            raise ValueError("set extraction.tensor_parallel_size (it also sizes the actor's placement group), "
                             "not extraction.vllm.tensor_parallel_size")
        if self.tensor_parallel_size > 1 and not self.backend_facts.holds_engine:
            engines = " or ".join(b.name for b in EXTRACTION_BACKENDS.values() if b.holds_engine)
            raise ValueError(f"extraction.tensor_parallel_size {self.tensor_parallel_size} needs backend {engines} "
                             f"(backend {self.backend} spreads a model with device_map: auto instead)")
        if self.tensor_parallel_size > 1 and self.num_gpus <= 0:
            raise ValueError(f"extraction.tensor_parallel_size {self.tensor_parallel_size} needs num_gpus > 0")
        if self.tensor_parallel_size > 1 and self.target_ids:
            raise ValueError("extraction.target_ids true with tensor_parallel_size > 1: the engine's workers hold the "
                             "GPUs, so the full-vocab argmax would run on the actor's CPU; leave target_ids unset "
                             "(the training workers compute it)")
        return self

    @property
    def backend_facts(self) -> ExtractionBackend:
        return EXTRACTION_BACKENDS[self.backend]

    @property
    def stores_target_ids(self) -> bool:
        """Whether extraction stores the target's argmax ids (``target_ids``, resolved)."""
        return self.target_ids if self.target_ids is not None else self.tensor_parallel_size == 1


class RayConfig(Strict):
    address: str | None = None  # else RAY_ADDRESS, else a local Ray
    num_cpus: int | None = Field(None, gt=0)
    # An actor pool that fits on no node gets this long for one to join (an autoscaler is asked), then the run
    # stops with exit 3 naming the missing resources (pipeline.run.placement).
    placement_timeout_s: float = Field(60.0, ge=0)
    # The niceness of the workers of a local Ray the run starts (joining a cluster, its own setting holds). Ray's
    # default, 15, makes its workers yield every contested core to the driver, Ray's agents and anything else on
    # the machine; on one machine the workers are the pipeline (the driver only counts), so they run at 0.
    worker_niceness: int = Field(0, ge=0, le=19)


class PoolConfig(Strict):
    """One CPU stage's autoscaling actor pool: Ray Data grows it from ``min_actors`` to ``max_actors`` while
    its input queue is backed up, and spreads the actors over the cluster's CPU nodes."""

    min_actors: int = Field(1, gt=0)
    # None: follows the sources (pipeline.generate.stages.pool_bounds): render and validate keep up with the most
    # actors the sources may run, capped by the cluster's CPUs.
    max_actors: int | None = Field(None, gt=0)
    num_cpus: float = Field(0.25, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> PoolConfig:
        if self.max_actors is not None and self.max_actors < self.min_actors:
            raise ValueError(f"max_actors ({self.max_actors}) is below min_actors ({self.min_actors})")
        return self


class StagesConfig(Strict):
    """The CPU stages around the sources. The shard writer stays one actor per pass: its memory of what it
    wrote is what keeps a re-executed batch from being written twice."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)  # ``validate`` would shadow BaseModel's

    render: PoolConfig = Field(default_factory=PoolConfig)
    validate_: PoolConfig = Field(default_factory=PoolConfig, alias="validate")


ToolRule = Literal["any", "exact_ids", "tools_sent"]


class SourceRoute(Strict):
    """How one source (by name) takes part in routing."""

    role: Literal["primary", "overflow"] = "primary"
    weight: float = Field(1.0, ge=0)  # share among the sources of its role (mode shares)
    capacity: float | None = Field(None, gt=0)  # samples/s it sustains (mode overflow, primaries)


class RoutingConfig(Strict):
    """The ``routing:`` block (policy in pipeline.generate.router); sources not listed are primaries of weight 1."""

    mode: Literal["shares", "overflow"] = "shares"
    sources: dict[str, SourceRoute] = Field(default_factory=dict)
    deadline_s: float | None = Field(None, gt=0)  # mode overflow: what the local sources must finish in
    reroute: bool = True  # a prompt its source cannot serve goes to its next source instead of quarantine
    max_hops: int = Field(2, ge=0)  # further sources one prompt may try after its first
    spill_late: bool = True  # mode overflow: prompts a local engine has not started by the deadline go to overflow
    tool_prompts: ToolRule = "any"  # default for prompts that carry tools
    tool_prompts_by_dataset: dict[str, ToolRule] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _overflow_needs_capacity(self) -> RoutingConfig:
        if self.mode == "overflow":
            if self.deadline_s is None:
                raise ValueError("routing.mode overflow needs routing.deadline_s")
            if not any(r.role == "overflow" for r in self.sources.values()):
                raise ValueError("routing.mode overflow needs a source with role: overflow")
        return self


def check_routing(routing: RoutingConfig, source_names: Sequence[str], dataset_names: Sequence[str]) -> None:
    """Cross checks between the routing block and the run's sources and datasets; errors name the key."""
    for name in routing.sources:
        if name not in source_names:
            raise ValueError(f"routing.sources names unknown source {name!r} (known: {list(source_names)})")
    for name in routing.tool_prompts_by_dataset:
        if name not in dataset_names:
            raise ValueError(f"routing.tool_prompts_by_dataset names unknown dataset {name!r}")
    if routing.mode == "overflow":
        for name in source_names:
            r = routing.sources.get(name, SourceRoute())
            if r.role == "primary" and r.capacity is None:
                raise ValueError(f"routing.mode overflow: source {name!r} needs a capacity (samples/s)")


class ConfigError(ValueError):
    """A config that cannot be run; the message names the offending key or file."""


class UnreadableFile(ConfigError):
    """A file in a run's folder (manifest, ledger journal, shard) that is not what it should be.

    The run stops with one line naming the file and what to do, rather than guess: a ledger read as empty
    would spend its budget twice, a shard skipped would be generated (and paid for) again."""


