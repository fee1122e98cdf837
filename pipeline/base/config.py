"""Every schema of a run config, loaded from YAML and checked before Ray starts.

This module imports no runtime code (no Ray, engines, sources or stages): the runtime
imports it, never the other way round. Cross-field rules live in the validators, so
``python -m pipeline check`` catches everything a run would refuse later.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.profiles import PROFILE_NAMES
from training.config import DraftTrainConfig


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class SamplingConfig(Strict):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(128, gt=0)
    seed: int = Field(0, ge=0)


CheckMode = Literal["quarantine", "flag", "off"]


class ChecksConfig(Strict):
    """What each named check does when it fails: quarantine the sample, flag it, or skip the check."""

    structure: CheckMode = "quarantine"
    # Engine ids that do not re-encode are real (non-canonical) model output: flag and count them.
    roundtrip: CheckMode = "flag"
    # Rebuilt ids that do not re-encode mean the rebuild or tokenizer is broken: quarantine.
    roundtrip_rebuilt: CheckMode = "quarantine"
    # Only rebuilt ids are billed (engines bill nothing): ids that cannot account for the bill,
    # over both thresholds below, are not trustworthy training data.
    billing: CheckMode = "quarantine"
    tool_semantics: CheckMode = "quarantine"
    empty_content: CheckMode = "flag"
    truncated: CheckMode = "flag"
    repetition: CheckMode = "quarantine"
    max_length: CheckMode = "quarantine"
    repetition_ngram: int = 8
    repetition_max_repeats: int = 8
    max_total_tokens: int = 32768
    billing_abs_threshold: int = 8
    billing_rel_threshold: float = 0.05
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


class DatasetConfig(Strict):
    """A prompt file, how to read its rows, and how its prompts are generated."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    path: str
    format: Literal["messages", "sharegpt", "instruction", "glaive"] = "messages"
    # Column names in the file for the fields the format reads.
    columns: dict[str, str] = Field(default_factory=dict)
    thinking: bool = True
    max_rows: int | None = Field(None, gt=0)
    sources: list[str] | None = None  # names of the sources allowed to serve this dataset
    checks: ChecksConfig = Field(default_factory=ChecksConfig)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_name("dataset", v)


class EngineSourceConfig(Strict):
    """What every local engine source has: an actor pool, its resources, and what an engine error does."""

    name: str
    num_actors: int = Field(1, gt=0)
    max_actors: int | None = None  # > num_actors: Ray Data grows the pool while the queue is backed up
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    tensor_parallel_size: int = Field(1, gt=0)
    batch_size: int = Field(16, gt=0)
    dtype: str = "auto"
    max_model_len: int = Field(4096, gt=0)
    on_error: Literal["quarantine", "raise"] = "quarantine"  # raise: let Ray retry the batch
    isolate_errors: bool = True  # retry a failed batch one row at a time so one bad prompt fails alone
    # Custom Ray resources the actor needs in all (e.g. {h200: 8} to stay on cluster.yaml's H200 nodes);
    # with TP > 1 in a placement group they are split evenly over its TP bundles.
    resources: dict[str, float] = Field(default_factory=dict)
    # Dollars per device-hour (a GPU, or the whole actor for a CPU engine): prices the engine time each sample
    # used (``engine_s``) in the report and `status`. None: the time is reported, in device-hours only.
    gpu_hour_usd: float | None = Field(None, ge=0, allow_inf_nan=False)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_name("source", v)

    def devices(self) -> float:
        """Devices one actor holds while it generates: its GPUs (the TP group's, when larger), or 1 on CPU."""
        if self.num_gpus > 0:
            return max(self.num_gpus, float(self.tensor_parallel_size)) if self.tensor_parallel_size > 1 \
                else self.num_gpus
        return 1.0


class VLLMSourceConfig(EngineSourceConfig):
    kind: Literal["vllm"] = "vllm"
    name: str = "vllm"
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU
    enforce_eager: bool = True
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)


class SGLangSourceConfig(EngineSourceConfig):
    kind: Literal["sglang"] = "sglang"
    name: str = "sglang"
    num_gpus: float = Field(1.0, ge=0)
    batch_size: int = Field(64, gt=0)
    mem_fraction_static: float | None = None
    attention_backend: str | None = None
    deterministic: bool | None = None  # None: on when temperature > 0 (needed for per-sample seeds)
    log_level: str = "error"
    extra_engine_args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _tp_needs_gpus(self) -> SGLangSourceConfig:
        # SGLang forks its TP workers on the actor's own GPUs (no placement group), so the actor holds them all.
        if self.num_gpus and self.tensor_parallel_size > self.num_gpus:
            raise ValueError(f"source {self.name!r}: tensor_parallel_size {self.tensor_parallel_size} needs "
                             f"num_gpus >= {self.tensor_parallel_size}")
        return self


class TransformersSourceConfig(EngineSourceConfig):
    kind: Literal["transformers"] = "transformers"
    name: str = "transformers"
    batch_size: int = Field(8, gt=0)
    dtype: str = "float32"


class ExtractionConfig(Strict):
    """Hidden-state capture; ``mode: stream`` feeds training directly, ``shards`` stages Arrow shards on disk."""

    aux_layer_ids: list[int] | None = None  # default [2, L//2, L-3]; vLLM convention (input of layer i)
    mode: Literal["stream", "shards"] = "stream"
    backend: Literal["transformers", "vllm"] = "transformers"
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
    num_actors: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # backend vllm on GPUs: TP > 1 places each actor like a vLLM source's (pipeline.generate.sources.chain): a
    # placement group of TP one-GPU bundles on one node, filled by the engine's Ray TP workers
    tensor_parallel_size: int = Field(1, gt=0)
    resources: dict[str, float] = Field(default_factory=dict)  # custom Ray resources, as for engine sources
    # memory of one GPU in GB (10^9 bytes) for the sizing check (pipeline.base.sizing): 141 = H200, 80 = H100
    gpu_memory_gb: float = Field(141.0, gt=0)

    @model_validator(mode="after")
    def _parallelism(self) -> ExtractionConfig:
        if "tensor_parallel_size" in self.vllm:
            raise ValueError("set extraction.tensor_parallel_size (it also sizes the actor's placement group), "
                             "not extraction.vllm.tensor_parallel_size")
        if self.tensor_parallel_size > 1 and self.backend != "vllm":
            raise ValueError(f"extraction.tensor_parallel_size {self.tensor_parallel_size} needs backend vllm "
                             f"(backend {self.backend} spreads a model with device_map: auto instead)")
        if self.tensor_parallel_size > 1 and self.num_gpus <= 0:
            raise ValueError(f"extraction.tensor_parallel_size {self.tensor_parallel_size} needs num_gpus > 0")
        if self.tensor_parallel_size > 1 and self.target_ids:
            raise ValueError("extraction.target_ids true with tensor_parallel_size > 1: the engine's workers hold the "
                             "GPUs, so the full-vocab argmax would run on the actor's CPU; leave target_ids unset "
                             "(the training workers compute it)")
        return self

    @property
    def stores_target_ids(self) -> bool:
        """Whether extraction stores the target's argmax ids (``target_ids``, resolved)."""
        return self.target_ids if self.target_ids is not None else self.tensor_parallel_size == 1


class RayConfig(Strict):
    address: str | None = None  # else RAY_ADDRESS, else a local Ray
    num_cpus: int | None = None
    # An actor pool that fits on no node gets this long for one to join (an autoscaler is asked), then the run
    # stops with exit 3 naming the missing resources (pipeline.run.placement).
    placement_timeout_s: float = Field(60.0, ge=0)


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


class ProviderPreferences(Strict):
    """OpenRouter's ``provider`` routing object, passed through as is (unknown keys are rejected there too)."""

    order: list[str] | None = None
    only: list[str] | None = None
    ignore: list[str] | None = None
    allow_fallbacks: bool | None = None
    require_parameters: bool | None = None
    data_collection: Literal["allow", "deny"] | None = None
    quantizations: list[str] | None = None
    sort: Literal["price", "throughput", "latency"] | None = None
    max_price: dict[str, float] | None = None

    def wire(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class HealthConfig(Strict):
    """When a provider is routed around automatically (over its last ``window`` outcomes)."""

    window: int = Field(50, gt=0)
    min_requests: int = Field(20, gt=0)
    max_error_rate: float = Field(0.5, ge=0, le=1)
    max_invalid_rate: float = Field(0.2, ge=0, le=1)  # billing drift or malformed structure


OPENROUTER_HOST = "openrouter.ai"
UNLIMITED = "unlimited"


def _url_host(url: str) -> str:
    """The host a URL's requests go to, lower case without a trailing dot ('' when there is none)."""
    return (urlsplit(url).hostname or "").rstrip(".")


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: traffic that never leaves the machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def base_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a source's endpoint, or None. Total: a malformed URL is a reason, never a raise."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as e:
        return f"not a valid URL ({e})"
    if parts.scheme not in ("http", "https"):
        return f"must start with https:// (or http:// for a loopback server), not {parts.scheme or 'nothing'!r}"
    if "@" in parts.netloc:  # user:password@host: a secret in the config, and a host easy to misread
        return "must not hold user info (user:password@...); the key comes from api_key_env"
    if not _url_host(url):
        return "has no host"
    return None


def normalised_base_url(url: str) -> str:
    """``url`` with case, trailing dots and slashes, default ports and fragments that name the same endpoint
    folded together (budget identity: the same endpoint written two ways keeps its spend)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return url.strip()
    host = (parts.hostname or "").rstrip(".")
    host = f"[{host}]" if ":" in host else host
    if port is not None and (parts.scheme, port) not in (("https", 443), ("http", 80)):
        host += f":{port}"
    query = f"?{parts.query}" if parts.query else ""
    return f"{parts.scheme.lower()}://{host}{parts.path.rstrip('/')}{query}"


def _cap(value: Any) -> Any:
    """A budget value: ``"unlimited"`` is the explicit opt-out (stored as None); an empty value is refused,
    so a key left blank in YAML never means "no cap"."""
    if value == UNLIMITED:
        return None
    if value is None:
        raise ValueError(f"empty budget: write a number, or {UNLIMITED!r} to spend without a cap")
    return value


TokenCap = Annotated[Annotated[int, Field(ge=0)] | None, BeforeValidator(_cap)]
UsdCap = Annotated[Annotated[float, Field(ge=0, allow_inf_nan=False)] | None, BeforeValidator(_cap)]


class PricesConfig(Strict):
    """Dollars per million tokens, assumed when reserving ahead before any price was observed."""

    prompt_usd_per_mtok: float = Field(ge=0, allow_inf_nan=False)
    completion_usd_per_mtok: float = Field(ge=0, allow_inf_nan=False)


class OpenRouterSourceConfig(Strict):
    """OpenRouter or any OpenAI-compatible chat-completions endpoint (vLLM, SGLang, gateways)."""

    # a refused base_url may carry a secret (user:password@, ?key=): errors never echo the input
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    kind: Literal["openrouter"] = "openrouter"
    name: str = "openrouter"
    base_url: str = "https://openrouter.ai/api/v1"  # POST {base_url}/chat/completions
    model: str
    # Name of the variable; the key itself never enters config. Left unset, OPENROUTER_API_KEY goes to
    # openrouter.ai over https only; any other endpoint gets a key only when the config names its variable.
    api_key_env: str = "OPENROUTER_API_KEY"
    api_key_required: bool = True  # local servers may take no key
    headers: dict[str, str] = Field(default_factory=dict)  # e.g. HTTP-Referer, X-Title
    provider: ProviderPreferences | None = None
    exclude_providers: list[str] = Field(default_factory=list)  # always routed around
    health: HealthConfig = Field(default_factory=HealthConfig)
    # Reasoning: OpenRouter's `reasoning` object, vLLM/SGLang chat_template_kwargs, or nothing.
    reasoning_style: Literal["openrouter", "chat_template_kwargs", "none"] = "openrouter"
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"enabled": True})
    send_tools: bool = False  # off: tool-call markers come back as text and rebuild as special ids
    sampling: SamplingConfig | None = None  # overrides the run's sampling for this source
    extra_body: dict[str, Any] = Field(default_factory=dict)
    # Caps per dataset name, in completion tokens (budgets) and in dollars (budgets_usd); a dataset not listed
    # gets the default of each. A value is a number or "unlimited" (stored as None). Every dataset this source
    # may serve needs a cap or an explicit "unlimited" (RunConfig refuses it otherwise), and every key must
    # name a dataset of the run (a typo would otherwise leave that dataset unlimited).
    budgets: dict[str, TokenCap] = Field(default_factory=dict)
    default_budget: TokenCap = None
    budgets_usd: dict[str, UsdCap] = Field(default_factory=dict)
    default_budget_usd: UsdCap = None
    prices: PricesConfig | None = None  # what reserving ahead in dollars assumes before a price is seen
    # Budgets follow identity() (model, endpoint, budget_scope), not the name: a new scope starts fresh accounts.
    budget_scope: str = ""
    # Concurrency: num_actors..max_actors actors, each with up to max_in_flight requests.
    num_actors: int = Field(4, gt=0)
    max_actors: int | None = None
    num_cpus: float = 0.25
    # Custom Ray resources each actor needs (e.g. {api_node: 1} to keep the actors on the nodes that carry it,
    # such as cluster.yaml's cpu_http nodes), as for engine sources.
    resources: dict[str, float] = Field(default_factory=dict)
    batch_size: int = Field(128, gt=0)
    max_concurrent_batches: int = Field(4, gt=0)
    max_in_flight: int = Field(500, gt=0)
    # In the actor's process: freeze start-up objects (tokenizer, profile) out of the cyclic GC and collect
    # young objects less often; with hundreds of requests in flight this cuts client CPU per request by ~20%.
    tune_gc: bool = True
    request_timeout_s: float = Field(600.0, gt=0)
    connect_timeout_s: float = Field(30.0, gt=0)
    keepalive_s: float = 60.0
    # Retries: attempts per prompt, full-jitter exponential backoff, Retry-After honoured up to a cap.
    max_attempts: int = Field(6, gt=0)
    backoff_base_s: float = Field(1.0, ge=0)
    backoff_max_s: float = Field(60.0, ge=0)
    max_retry_after_s: float = Field(120.0, ge=0)
    budget_poll_s: float = Field(0.05, gt=0)  # first wait while in-flight reservations may free budget
    # Outages: after circuit_failures transient failures in a row an actor stops sending, probes after a
    # cool-down (doubling up to circuit_max_cooldown_s) and, open for circuit_give_up_s, leaves its rows to do.
    circuit_failures: int = Field(20, gt=0)
    circuit_cooldown_s: float = Field(5.0, gt=0)
    circuit_max_cooldown_s: float = Field(120.0, gt=0)
    circuit_give_up_s: float = Field(600.0, gt=0)
    # A prompt whose retries ran out on transient failures stays to do; in this many runs, it is quarantined.
    transient_runs: int = Field(3, gt=0)
    journal_flush_s: float = Field(1.0, gt=0)  # response journal: fsync at most this often
    # Billing cross-check: drift counts as a validation failure when above both thresholds.
    billing_abs_threshold: int = 8
    billing_rel_threshold: float = 0.05
    # Config errors: the same 4xx answer on this many distinct prompts in a row halts the source (nothing is
    # quarantined for it); a 4xx with no verdict within config_error_wait_s stays to do
    # (pipeline.generate.sources.http.engine).
    config_error_prompts: int = Field(3, ge=2)
    config_error_wait_s: float = Field(30.0, gt=0)
    # Leases: an actor silent to the ledger this long is taken as dead, its reservations in doubt (spent, not
    # blocking); a prompt waiting this long in all for budget held by in-flight requests is left to do.
    lease_s: float = Field(60.0, gt=0)
    budget_wait_max_s: float = Field(600.0, gt=0)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_name("source", v)

    @field_validator("base_url")
    @classmethod
    def _usable_url(cls, v: str) -> str:
        if problem := base_url_problem(v):
            raise ValueError(f"base_url {problem}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _empty_default_is_unset(cls, data: Any) -> Any:
        # `default_budget: null` (or a blank value) means "not set", never the explicit "unlimited" opt-out
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (k in ("default_budget", "default_budget_usd") and v is None)}
        return data

    @model_validator(mode="after")
    def _no_key_in_clear(self) -> OpenRouterSourceConfig:
        if self._key_in_clear():
            raise ValueError(f"source {self.name!r}: base_url is plain http to {_url_host(self.base_url)}, not a "
                             f"loopback host, so the key in {self.api_key_env} would cross the network unencrypted; "
                             "use https (or http only to 127.0.0.1, ::1 or localhost)")
        return self

    def _key_in_clear(self) -> bool:
        """Whether a key this config may send would go over plain http off this machine."""
        names_key = "api_key_env" in self.model_fields_set or _url_host(self.base_url) == OPENROUTER_HOST
        return names_key and urlsplit(self.base_url).scheme != "https" \
            and not is_loopback_host(_url_host(self.base_url))

    def key_env(self) -> str | None:
        """The environment variable whose value may be sent as this source's key, or None: send no key.

        The default variable (``api_key_env`` not set in the config) goes only to openrouter.ai over https,
        and not at all with ``api_key_required: false``; a variable the config names goes to its base_url.
        Never over plain http off this machine, whatever was assigned after validation.
        """
        if base_url_problem(self.base_url) or self._key_in_clear():
            return None
        if "api_key_env" in self.model_fields_set:
            return self.api_key_env
        https_openrouter = urlsplit(self.base_url).scheme == "https" and _url_host(self.base_url) == OPENROUTER_HOST
        return self.api_key_env if self.api_key_required and https_openrouter else None

    def identity(self) -> str:
        """Whose spend a ledger journal holds: a digest of model, endpoint and budget_scope (not the name), so
        renaming a source keeps its spend and a new scope (the explicit budget reset) starts from zero."""
        key = json.dumps([self.model, normalised_base_url(self.base_url), self.budget_scope])
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def token_budget(self, dataset: str) -> int | None:
        """Completion-token cap of one dataset; None: no token cap (it may still have a dollar cap)."""
        return self.budgets[dataset] if dataset in self.budgets else self.default_budget

    def usd_budget(self, dataset: str) -> float | None:
        """Dollar cap of one dataset; None: no dollar cap (it may still have a token cap)."""
        return self.budgets_usd[dataset] if dataset in self.budgets_usd else self.default_budget_usd

    def has_cap_decision(self, dataset: str) -> bool:
        """Whether the config says how much this source may spend on ``dataset`` (a cap or "unlimited")."""
        return (dataset in self.budgets or dataset in self.budgets_usd
                or bool({"default_budget", "default_budget_usd"} & self.model_fields_set))


SourceConfig = Annotated[
    VLLMSourceConfig | SGLangSourceConfig | TransformersSourceConfig | OpenRouterSourceConfig,
    Field(discriminator="kind"),
]


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
        spenders = [s for s in self.sources if isinstance(s, OpenRouterSourceConfig)]
        by_identity: dict[str, list[str]] = {}
        for s in spenders:
            by_identity.setdefault(s.identity(), []).append(s.name)
        if shared := [v for v in by_identity.values() if len(v) > 1]:
            raise ValueError(f"API sources {shared[0]} have the same model and base_url, so they would share one "
                             "budget account: give each its own budget_scope (budgets follow model, base_url and "
                             "budget_scope, not the name)")
        for d in self.datasets:
            for s in d.sources or []:
                if s not in names:
                    raise ValueError(f"dataset {d.name!r} names unknown source {s!r} (known: {names})")
        for s in self.sources:
            for key in ("budgets", "budgets_usd"):
                unknown = sorted(set(getattr(s, key, None) or {}) - set(ds_names))
                if unknown:
                    raise ValueError(f"source {s.name!r}: {key} name unknown datasets {unknown} (known: {ds_names}); "
                                     "a misspelt key would leave that dataset without a cap")
        for s in self.sources:
            if not isinstance(s, OpenRouterSourceConfig):
                continue
            for d in self.datasets:
                if (d.sources is None or s.name in d.sources) and not s.has_cap_decision(d.name):
                    raise ValueError(
                        f"source {s.name!r} may spend on dataset {d.name!r} without a cap: set budgets: "
                        f"{{{d.name}: <completion tokens>}} or budgets_usd: {{{d.name}: <dollars>}} (or a "
                        f"default_budget / default_budget_usd) on the source, or opt out with budgets: "
                        f"{{{d.name}: {UNLIMITED}}}")
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


class ConfigError(ValueError):
    """A config that cannot be run; the message names the offending key or file."""


class UnreadableFile(ConfigError):
    """A file in a run's folder (manifest, ledger journal, shard) that is not what it should be.

    The run stops with one line naming the file and what to do, rather than guess: a ledger read as empty
    would spend its budget twice, a shard skipped would be generated (and paid for) again."""


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
        raw = yaml.safe_load(path.read_bytes().decode("utf-8"))
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
