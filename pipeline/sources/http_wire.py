"""OpenAI-compatible chat-completions wire logic, as pure functions.

Request bodies, response interpretation (including errors that arrive inside
HTTP 200 bodies), error classification, backoff and secret redaction. Nothing
here touches the network, Ray or a clock, so every rule is unit-tested.
"""

from __future__ import annotations

import email.utils
import json
import math
import random
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.profiles.base import Completion
from pipeline.reconstruct import completion_from_message as _shared_completion

# Statuses worth another try: the request was fine, the serving side was not (yet).
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504, 524, 529})
# Statuses that waiting will not fix: the request, the key, credits or moderation.
FATAL_STATUS = frozenset({400, 401, 402, 403})
# Statuses about the account (key, credits, permissions): every further request fails the same way.
ACCOUNT_STATUS = frozenset({401, 402, 403})
# Statuses that say nothing about one provider's health (rate limits, routing, our request).
NEUTRAL_STATUS = frozenset({400, 401, 402, 403, 429, 503})
# native_finish_reason values that mean the provider failed despite a normal-looking finish.
NATIVE_ERRORS = frozenset({"error", "network_error", "internal_error", "server_error", "timeout"})

REDACTED = "[REDACTED]"

try:  # optional: a faster JSON codec where installed (same documents, fewer CPU cycles per request)
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    loads = orjson.loads
    JSONDecodeError: tuple[type[Exception], ...] = (orjson.JSONDecodeError, ValueError)
except ImportError:  # pragma: no cover - exercised where orjson is absent
    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode()

    loads = json.loads
    JSONDecodeError = (ValueError,)


@dataclass(frozen=True)
class RequestOptions:
    """Everything a request body carries besides the conversation; built once per source."""

    model: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None = None
    reasoning: Mapping[str, Any] | None = None  # sent for thinking rows
    reasoning_style: str = "openrouter"  # openrouter | chat_template_kwargs | none
    provider: Mapping[str, Any] | None = None
    send_tools: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    def sampling(self) -> dict[str, Any]:
        """The sampling parameters, always explicit (omitted ones take each provider's default)."""
        out = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}
        if self.seed is not None:
            out["seed"] = self.seed
        return out


def build_request(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, thinking: bool,
                  opts: RequestOptions, excluded: Iterable[str] = ()) -> dict[str, Any]:
    """The JSON body for one prompt; providers in ``excluded`` are added to ``provider.ignore``."""
    body: dict[str, Any] = {"model": opts.model, "messages": messages, **opts.sampling(), "stream": False}
    if opts.reasoning_style == "openrouter":
        body["reasoning"] = dict(opts.reasoning or {"enabled": True}) if thinking else {"enabled": False}
    elif opts.reasoning_style == "chat_template_kwargs":
        body["chat_template_kwargs"] = {"thinking": thinking, "enable_thinking": thinking}
    if opts.send_tools and tools:
        body["tools"] = tools
        body["tool_choice"] = "auto"
    provider = dict(opts.provider or {})
    excluded = [p for p in excluded if p]
    if excluded:
        ignore = list(provider.get("ignore") or [])
        provider["ignore"] = ignore + [p for p in excluded if p not in ignore]
    if provider:
        body["provider"] = provider
    for k, v in opts.extra.items():
        body.setdefault(k, v)
    return body


# --------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class Reply:
    """A served completion, as far as the wire tells."""

    completion: Completion
    generation_id: str
    provider: str
    model: str
    billed: int  # usage.completion_tokens; -1 when the server sent no usage
    cost: float
    native_finish_reason: str | None


FailureClass = Literal["transient", "sample", "account"]


@dataclass(frozen=True)
class Failure:
    """One failed attempt: why, whether to try again, and what it cost.

    ``maybe_billed``: the request reached the provider and its bill is unknown (a cut body, a timeout, a
    connection dropped after sending, an error body without usage); the budget keeps the whole reservation.
    """

    kind: str  # http | in_band | body | network | timeout
    message: str
    retryable: bool
    status: int | None = None
    retry_after: float | None = None
    provider: str = ""
    billed: int = 0
    cost: float = 0.0
    maybe_billed: bool = False

    @property
    def failure_class(self) -> FailureClass:
        """``account``: stop the source (401/402/403); ``sample``: this prompt fails the same way again
        (quarantine); ``transient``: may pass later (the row stays to do)."""
        if self.status in ACCOUNT_STATUS:
            return "account"
        return "transient" if self.retryable else "sample"

    @property
    def against_provider(self) -> bool:
        """Whether this failure says something about the provider that served it."""
        if not self.provider:
            return False
        return self.status is None or self.status not in NEUTRAL_STATUS

    def describe(self) -> str:
        where = f" from {self.provider}" if self.provider else ""
        code = f" {self.status}" if self.status is not None else ""
        return f"{self.kind}{code}{where}: {self.message}"


def interpret(status: int, raw: bytes | str, retry_after_header: str | None = None,
              now: float | None = None) -> Reply | Failure:
    """Classify one HTTP answer. Leading whitespace padding before the JSON is tolerated."""
    retry_after = parse_retry_after(retry_after_header, now)
    try:
        payload = loads(raw) if raw and raw.strip() else None
    except (*JSONDecodeError, UnicodeDecodeError) as e:
        payload = None
        if status == 200:  # typically a body cut mid-way: the provider finished (and billed) the generation
            return Failure("body", f"response is not JSON ({e.__class__.__name__}: {_clip(str(e))})", True, 200,
                           maybe_billed=True)
    if status != 200:
        return _http_failure(status, payload, raw, retry_after)
    if not isinstance(payload, dict):
        return Failure("body", "empty or non-object response body", True, 200, maybe_billed=True)
    provider = str(payload.get("provider") or "")
    billed, cost = _usage(payload)
    unknown_bill = billed < 0
    if isinstance(payload.get("error"), dict):
        err = payload["error"]
        code = _int(err.get("code"))
        return Failure("in_band", _clip(str(err.get("message") or err)), code not in FATAL_STATUS, code,
                       retry_after, _error_provider(err) or provider, max(billed, 0), cost, unknown_bill)
    choices = payload.get("choices")
    if not choices:
        return Failure("in_band", "response has no choices", True, 200, retry_after, provider, max(billed, 0), cost,
                       unknown_bill)
    choice = choices[0]
    finish = choice.get("finish_reason")
    native = choice.get("native_finish_reason")
    if finish == "error":
        err = choice.get("error") or {}
        msg = err.get("message") if isinstance(err, dict) else err
        return Failure("in_band", f"finish_reason error: {_clip(str(msg or 'no detail'))}", True, 200,
                       retry_after, provider, max(billed, 0), cost, unknown_bill)
    if isinstance(native, str) and native.lower() in NATIVE_ERRORS:
        return Failure("in_band", f"native_finish_reason {native!r} with finish_reason {finish!r}", True, 200,
                       retry_after, provider, max(billed, 0), cost, unknown_bill)
    message = choice.get("message")
    if not isinstance(message, dict):
        return Failure("in_band", "choice has no message", True, 200, retry_after, provider, max(billed, 0), cost,
                       unknown_bill)
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else None
    completion = completion_from_message(message, str(finish or "stop"), usage)
    return Reply(completion, str(payload.get("id") or ""), provider, str(payload.get("model") or ""),
                 billed, cost, native)


def _http_failure(status: int, payload: Any, raw: bytes | str, retry_after: float | None) -> Failure:
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or "")
        meta_raw = (err.get("metadata") or {}).get("raw") if isinstance(err.get("metadata"), dict) else None
        if meta_raw:
            message = f"{message} ({meta_raw})"
        provider = _error_provider(err)
    else:
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        message, provider = text.strip() or "no body", ""
    retryable = status in RETRYABLE_STATUS or (status >= 500 and status not in FATAL_STATUS)
    return Failure("http", _clip(message), retryable, status, retry_after, provider)


def _error_provider(err: Mapping[str, Any]) -> str:
    meta = err.get("metadata")
    return str(meta.get("provider_name") or "") if isinstance(meta, dict) else ""


def _usage(payload: Mapping[str, Any]) -> tuple[int, float]:
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return -1, 0.0
    billed = _int(usage.get("completion_tokens"))
    return (billed if billed is not None else -1), float(usage.get("cost") or 0.0)


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _clip(text: str, n: int = 500) -> str:
    return text if len(text) <= n else text[:n] + "..."


def completion_from_message(message: Mapping[str, Any], finish_reason: str,
                            usage: Mapping[str, Any] | None = None) -> Completion:
    """The shared reading of an API message (``reasoning`` or ``reasoning_content``, billed count),
    with structured tool calls normalised to OpenAI's shape (arguments as a JSON string)."""
    c = _shared_completion(dict(message), finish_reason, dict(usage) if usage else None)
    if c.tool_calls:
        c.tool_calls = [_norm_call(call, i) for i, call in enumerate(c.tool_calls)]
    return c


def _norm_call(call: Mapping[str, Any], i: int) -> dict[str, Any]:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if not isinstance(args, str):
        args = json.dumps(args if args is not None else {}, ensure_ascii=False)
    return {"id": call.get("id") or f"call_{i}", "type": "function",
            "function": {"name": fn.get("name") or "", "arguments": args}}


def billing_drift(n_rebuilt: int, billed: int) -> int | None:
    """Rebuilt ids minus billed completion tokens; None when nothing was billed."""
    return None if billed < 0 else n_rebuilt - billed


def drift_exceeds(drift: int | None, billed: int, abs_threshold: int, rel_threshold: float) -> bool:
    """Whether a sample's drift counts against its provider: large both in tokens and relative to the response.

    Stricter than the validation stage's per-sample flag (either threshold): a
    provider is routed around for serving something else, not for being off by
    a token on short answers.
    """
    if drift is None:
        return False
    return abs(drift) > abs_threshold and abs(drift) > rel_threshold * max(billed, 1)


# --------------------------------------------------------------------------- retries


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        secs = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when is None:
            return None
        secs = when.timestamp() - (time.time() if now is None else now)
    if math.isnan(secs) or math.isinf(secs):
        return None
    return max(0.0, secs)


def backoff_s(attempt: int, rng: random.Random, *, base: float, cap: float,
              retry_after: float | None = None, max_retry_after: float = 120.0) -> float:
    """Delay before retry number ``attempt`` (0-based): full-jitter exponential, or Retry-After plus jitter.

    Full jitter spreads a storm of clients that failed together; Retry-After is
    honoured as a floor (capped, so a hostile header cannot park a worker forever).
    """
    if retry_after is not None:
        return min(retry_after, max_retry_after) + rng.uniform(0.0, base)
    return rng.uniform(0.0, min(cap, base * (2.0 ** attempt)))


# --------------------------------------------------------------------------- secrets

_BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"',;]+")
_OR_KEY = re.compile(r"sk-or-[A-Za-z0-9_\-]+")


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with the given secrets, bearer tokens and OpenRouter-style keys blanked out."""
    for s in secrets:
        if s and len(s) >= 4:
            text = text.replace(s, REDACTED)
    text = _BEARER.sub(lambda m: m.group(1) + REDACTED, text)
    return _OR_KEY.sub(REDACTED, text)
