"""Config of the HTTP (OpenRouter / OpenAI-compatible) source."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pipeline.config import SamplingConfig, Strict
from pipeline.ledger import HealthPolicy


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

    def policy(self) -> HealthPolicy:
        return HealthPolicy(**self.model_dump())


class OpenRouterSourceConfig(Strict):
    """OpenRouter or any OpenAI-compatible chat-completions endpoint (vLLM, SGLang, gateways)."""

    kind: Literal["openrouter"] = "openrouter"
    name: str = "openrouter"
    base_url: str = "https://openrouter.ai/api/v1"  # POST {base_url}/chat/completions
    model: str
    api_key_env: str = "OPENROUTER_API_KEY"  # name of the variable; the key itself never enters config
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
    # Completion-token budget per dataset name; datasets not listed get default_budget (None: unlimited).
    budgets: dict[str, int] = Field(default_factory=dict)
    default_budget: int | None = Field(None, ge=0)
    # Concurrency: num_actors..max_actors actors, each with up to max_in_flight requests.
    num_actors: int = Field(4, gt=0)
    max_actors: int | None = None
    num_cpus: float = 0.25
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
    # Billing cross-check: drift counts as a validation failure when above both thresholds.
    billing_abs_threshold: int = 8
    billing_rel_threshold: float = 0.05
