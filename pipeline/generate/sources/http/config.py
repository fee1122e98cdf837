"""The HTTP source's schema (OpenRouter or any OpenAI-compatible endpoint), its budgets and key scope, and its
registry entry: the adapter beside this module (``openrouter``) serves it."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BeforeValidator, ConfigDict, Field, field_validator, model_validator

from pipeline.base.config import DatasetConfig, SamplingConfig, SourceConfigBase, Strict, may_serve
from pipeline.base.console import quantity
from pipeline.generate.sources.kind import SourceKind


class MaxPrice(Strict):
    """OpenRouter's ``provider.max_price``: the most a provider may charge, in dollars per million prompt and
    completion tokens, per request and per image; a key left out caps nothing. Its keys are OpenRouter's (a
    misspelt one would cap nothing there), each a finite amount >= 0."""

    prompt: float | None = Field(None, ge=0)
    completion: float | None = Field(None, ge=0)
    request: float | None = Field(None, ge=0)
    image: float | None = Field(None, ge=0)


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
    max_price: MaxPrice | None = None

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


# Header names (lower case) that carry a credential, or that contain one of these words (x-api-key, api-key,
# x-auth-token, x-goog-api-key, ...): refused in `headers:` (see OpenRouterSourceConfig._no_secret_headers).
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})
CREDENTIAL_WORDS = ("auth", "key", "token", "secret", "password", "credential")


def is_credential_header(name: str) -> bool:
    """Whether a header of this name would carry a credential."""
    low = name.strip().lower()
    return low in CREDENTIAL_HEADERS or any(w in low for w in CREDENTIAL_WORDS)


def _price_guard_switch(value: Any) -> Any:
    """An unquoted ``on``/``off`` (YAML 1.1 booleans) means the setting of that name."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


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


class OpenRouterSourceConfig(SourceConfigBase):
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
    headers: dict[str, str] = Field(default_factory=dict)  # e.g. HTTP-Referer, X-Title; never a credential
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
    # With a dollar cap, send provider.max_price at the prices a reservation assumes, so no dearer provider
    # serves the request and the bill stays within the cap. auto: for openrouter.ai and loopback (its stand-in).
    max_price_guard: Annotated[Literal["auto", "on", "off"], BeforeValidator(_price_guard_switch)] = "auto"
    # Budgets follow identity() (model, endpoint, budget_scope), not the name: a new scope starts fresh accounts.
    budget_scope: str = ""
    # Concurrency: num_actors..max_actors actors, each with up to max_in_flight requests.
    num_actors: int = Field(4, gt=0)
    num_cpus: float = Field(0.25, ge=0)
    batch_size: int = Field(128, gt=0)
    max_concurrent_batches: int = Field(4, gt=0)
    max_in_flight: int = Field(500, gt=0)
    # In the actor's process: freeze start-up objects (tokenizer, profile) out of the cyclic GC and collect
    # young objects less often; with hundreds of requests in flight this cuts client CPU per request by ~20%.
    tune_gc: bool = True
    request_timeout_s: float = Field(600.0, gt=0)
    connect_timeout_s: float = Field(30.0, gt=0)
    keepalive_s: float = Field(60.0, ge=0)
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
    billing_abs_threshold: int = Field(8, ge=0)
    billing_rel_threshold: float = Field(0.05, ge=0)
    # Config errors: the same 4xx answer on this many distinct prompts in a row halts the source (nothing is
    # quarantined for it); a 4xx with no verdict within config_error_wait_s stays to do
    # (pipeline.generate.sources.http.engine).
    config_error_prompts: int = Field(3, ge=2)
    config_error_wait_s: float = Field(30.0, gt=0)
    # Leases: an actor silent to the ledger this long is taken as dead, its reservations in doubt (spent, not
    # blocking); a prompt waiting this long in all for budget held by in-flight requests is left to do.
    lease_s: float = Field(60.0, gt=0)
    budget_wait_max_s: float = Field(600.0, gt=0)

    @field_validator("base_url")
    @classmethod
    def _usable_url(cls, v: str) -> str:
        if problem := base_url_problem(v):
            raise ValueError(f"base_url {problem}")
        return v

    @field_validator("api_key_env")
    @classmethod
    def _variable_name(cls, v: str) -> str:
        # "" or a typo such as "$MY_KEY" names no variable: the actors would halt saying it is not set
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(f"{v!r} is not an environment variable name (letters, digits and '_', not starting "
                             "with a digit): name the variable that holds the key, not the key")
        return v

    @field_validator("headers")
    @classmethod
    def _no_secret_headers(cls, v: dict[str, str]) -> dict[str, str]:
        """Refuse a credential written into ``headers`` (Authorization, api-key, x-api-key, a cookie, ...),
        wherever it would go, not only over plain http: the key itself never enters a config, which is a file
        that gets committed, shared and pasted into issues. The key comes from the environment variable named
        by ``api_key_env`` (sent as ``Authorization: Bearer``), which also keeps it to https or loopback; a
        header-borne key would bypass both rules, and an Authorization header would clash with that one."""
        if secret := sorted(k for k in v if is_credential_header(k)):
            raise ValueError(f"{secret} would carry a credential, written into the config: put the key in an "
                             "environment variable and name it with api_key_env (sent as Authorization: Bearer)")
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

    def guards_price(self) -> bool:
        """Whether requests under a dollar cap carry ``provider.max_price`` (``max_price_guard``)."""
        if self.max_price_guard != "auto":
            return self.max_price_guard == "on"
        host = _url_host(self.base_url)
        return host == OPENROUTER_HOST or is_loopback_host(host)

    def usd_budget(self, dataset: str) -> float | None:
        """Dollar cap of one dataset; None: no dollar cap (it may still have a token cap)."""
        return self.budgets_usd[dataset] if dataset in self.budgets_usd else self.default_budget_usd

    def has_cap_decision(self, dataset: str) -> bool:
        """Whether the config says how much this source may spend on ``dataset`` (a cap or "unlimited")."""
        return (dataset in self.budgets or dataset in self.budgets_usd
                or bool({"default_budget", "default_budget_usd"} & self.model_fields_set))

    def describe(self) -> list[str]:
        caps = [f"model {self.model}", *super().describe()]
        if self.budgets:
            caps.append("budgets " + ", ".join(f"{d} {UNLIMITED if b is None else quantity(b)}"
                                               for d, b in self.budgets.items()))
        if self.budgets_usd:
            caps.append("budgets_usd " + ", ".join(f"{d} {UNLIMITED if b is None else f'${b:,.2f}'}"
                                                   for d, b in self.budgets_usd.items()))
        return caps

    def tools_sent(self) -> bool:
        return self.send_tools

    def budget_account(self) -> str | None:
        return self.identity()

    def key_problem(self) -> str | None:
        """Why no key would go out although ``api_key_required`` says one is needed, or None. The default
        variable goes only to openrouter.ai over https (``key_env``): another endpoint left without
        ``api_key_env`` would send no key and halt in its actors with a misleading "not set" error."""
        if not self.api_key_required or self.key_env() is not None:
            return None
        return (f"source {self.name!r}: base_url (host {_url_host(self.base_url)}) is not openrouter.ai over "
                f"https, and {self.api_key_env} (the default key) goes only there: set api_key_env: <VAR> for this "
                "endpoint, or api_key_required: false")

    def run_problem(self, datasets: Sequence[DatasetConfig]) -> str | None:
        if problem := self.key_problem():
            return problem
        names = [d.name for d in datasets]
        for key, caps in (("budgets", self.budgets), ("budgets_usd", self.budgets_usd)):
            if unknown := sorted(set(caps) - set(names)):
                return (f"source {self.name!r}: {key} name unknown datasets {unknown} (known: {names}); a misspelt "
                        "key would leave that dataset without a cap")
        for d in datasets:
            if may_serve(d.sources, self.name) and not self.has_cap_decision(d.name):
                return (f"source {self.name!r} may spend on dataset {d.name!r} without a cap: set budgets: "
                        f"{{{d.name}: <completion tokens>}} or budgets_usd: {{{d.name}: <dollars>}} (or a "
                        f"default_budget / default_budget_usd) on the source, or opt out with budgets: "
                        f"{{{d.name}: {UNLIMITED}}}")
        return None


KINDS = (
    SourceKind("openrouter", OpenRouterSourceConfig, "pipeline.generate.sources.http.openrouter:OpenRouterFlight",
               exact_ids=False, spends=True, layout="async_http",
               manifest=("model", "provider", "reasoning_style", "reasoning", "send_tools", "sampling",
                         "extra_body")),
)
