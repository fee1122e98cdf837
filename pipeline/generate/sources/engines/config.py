"""The local engine sources' schemas (vLLM, SGLang, transformers) and their registry entries: the adapters
beside this module (``vllm_source``, ``sglang_source``, ``transformers_source``) serve them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from pipeline.base.config import SourceConfigBase, engine_actor_resources
from pipeline.generate.sources.kind import SourceKind


class EngineSourceConfig(SourceConfigBase):
    """What every local engine source has: an actor pool, its resources, and what an engine error does.

    ``resources`` (custom Ray resources) with TP > 1 in a placement group are split evenly over its TP bundles.
    """

    num_gpus: float = Field(0.0, ge=0)
    tensor_parallel_size: int = Field(1, gt=0)
    dtype: str = "auto"
    max_model_len: int = Field(4096, gt=0)
    on_error: Literal["quarantine", "raise"] = "quarantine"  # raise: let Ray retry the batch
    isolate_errors: bool = True  # retry a failed batch one row at a time so one bad prompt fails alone
    # Dollars per device-hour (a GPU, or the whole actor for a CPU engine): prices the engine time each sample
    # used (``engine_s``) in the report and `status`. None: the time is reported, in device-hours only.
    gpu_hour_usd: float | None = Field(None, ge=0, allow_inf_nan=False)

    def devices(self) -> float:
        """Devices one actor holds while it generates: its GPUs (the TP group's, when larger), or 1 on CPU."""
        if self.num_gpus > 0:
            return max(self.num_gpus, float(self.tensor_parallel_size)) if self.tensor_parallel_size > 1 \
                else self.num_gpus
        return 1.0

    def actor_resources(self) -> dict[str, float]:
        return engine_actor_resources(self.num_cpus, self.num_gpus, self.tensor_parallel_size, self.resources)

    def device_hour_usd(self) -> float | None:
        return self.gpu_hour_usd


class VLLMSourceConfig(EngineSourceConfig):
    kind: Literal["vllm"] = "vllm"
    name: str = "vllm"
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU
    enforce_eager: bool = True
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)


# ``sglang.Engine`` arguments the SGLang adapter sets itself, with the key that sets them: ``extra_engine_args``
# may not override them (a silent override would change the ids or their provenance).
SGLANG_OWNED_ARGS: dict[str, str] = {
    "model_path": "it is the run's model folder",
    "tp_size": "set tensor_parallel_size instead",
    "dtype": "set dtype instead",
    "context_length": "set max_model_len instead",
    "skip_tokenizer_init": "prompts go in and answers come back as ids",
    "random_seed": "it follows sampling.seed",
    "enable_deterministic_inference": "set deterministic instead",
    "preferred_sampling_params": "SGLang would merge it under every request's sampling",
    "sampling_defaults": "only the configured sampling applies",
    "log_level": "set log_level instead",
    "mem_fraction_static": "set mem_fraction_static instead",
    "attention_backend": "set attention_backend instead",
}


class SGLangSourceConfig(EngineSourceConfig):
    kind: Literal["sglang"] = "sglang"
    name: str = "sglang"
    num_gpus: float = Field(1.0, ge=0)
    batch_size: int = Field(64, gt=0)
    mem_fraction_static: float | None = None
    attention_backend: str | None = None
    # None: on when temperature > 0 (needed for per-sample seeds). False at temperature > 0 sends no seed: the
    # samples record request_seed null and cannot be made again (allowed: the flashinfer sampler is faster).
    deterministic: bool | None = None
    log_level: str = "error"
    extra_engine_args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _tp_needs_gpus(self) -> SGLangSourceConfig:
        # SGLang forks its TP workers on the actor's own GPUs (no placement group), so the actor holds them all.
        if self.num_gpus and self.tensor_parallel_size > self.num_gpus:
            raise ValueError(f"source {self.name!r}: tensor_parallel_size {self.tensor_parallel_size} needs "
                             f"num_gpus >= {self.tensor_parallel_size}")
        return self

    @model_validator(mode="after")
    def _extra_args_not_owned(self) -> SGLangSourceConfig:
        owned = sorted(set(self.extra_engine_args) & set(SGLANG_OWNED_ARGS))
        if owned:
            key = owned[0]
            raise ValueError(f"source {self.name!r}: extra_engine_args.{key} is owned by the adapter "
                             f"({SGLANG_OWNED_ARGS[key]}); remove it")
        return self


class TransformersSourceConfig(EngineSourceConfig):
    kind: Literal["transformers"] = "transformers"
    name: str = "transformers"
    batch_size: int = Field(8, gt=0)
    dtype: str = "float32"


_HERE = "pipeline.generate.sources.engines"
KINDS = (
    SourceKind("vllm", VLLMSourceConfig, f"{_HERE}.vllm_source:VLLMGenerator", exact_ids=True, spends=False,
               layout="engine", serves_drafter=True),
    SourceKind("sglang", SGLangSourceConfig, f"{_HERE}.sglang_source:SGLangGenerator", exact_ids=True, spends=False,
               layout="engine_forks"),
    SourceKind("transformers", TransformersSourceConfig, f"{_HERE}.transformers_source:TransformersGenerator",
               exact_ids=True, spends=False, layout="engine"),
)
