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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.checks.reconstruct import completion_from_message as _shared_completion
from pipeline.checks.reconstruct import reasoning_details_text
from pipeline.profiles.base import Completion

# Statuses worth another try: the request was fine, the serving side was not (yet).
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504, 524, 529})
# Statuses that waiting will not fix: the request, the key, credits, moderation or an unknown model.
FATAL_STATUS = frozenset({400, 401, 402, 403, 404})
# Statuses about the account (key, credits, permissions): every further request fails the same way.
ACCOUNT_STATUS = frozenset({401, 402, 403})
# Gateway timeouts: the proxy stopped waiting, the origin may still have generated (and billed) the answer.
PROXY_TIMEOUT_STATUS = frozenset({408, 504, 524})
# Statuses that say nothing about one provider's health (rate limits, routing, our request).
NEUTRAL_STATUS = frozenset({400, 401, 402, 403, 404, 429, 503})
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
    billed: int  # usage.completion_tokens; -1 when the server sent no usable usage
    cost: float
    native_finish_reason: str | None
    cost_known: bool = True  # usage.cost was a number: the dollar budget settles with it, else keeps the reservation
    prompt_tokens: int = -1  # usage.prompt_tokens (-1: not sent); bounds the price of a prompt token


FailureClass = Literal["transient", "sample", "account"]


@dataclass(frozen=True)
class Failure:
    """One failed attempt: why, whether to try again, and what it cost.

    ``maybe_billed``: the request reached the provider and its bill is unknown (a cut body, a timeout, a
    connection dropped after sending, an error body without usage); the budget keeps the whole reservation.
    ``klass``: set where the status alone misleads (a moderation 403 refuses one prompt, not the account).
    ``shape``: a complete answer of the wrong shape (see ``retry_first``).
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
    klass: FailureClass | None = None
    shape: bool = False
    routing: bool = False  # OpenRouter's own "no provider meets the routing" 503 (``routing_refusal``)

    @property
    def failure_class(self) -> FailureClass:
        """``account``: stop the source (401/402/403); ``sample``: this prompt fails the same way again
        (quarantine); ``transient``: may pass later (the row stays to do)."""
        if self.klass is not None:
            return self.klass
        if self.status in ACCOUNT_STATUS:
            return "account"
        return "transient" if self.retryable else "sample"

    @property
    def signature(self) -> str | None:
        """Status and normalised message of a client error (4xx other than 408/429 and the account statuses).

        The same configuration error (unknown model, a rejected parameter) gives the same signature on every
        prompt, so a run of identical ones can be told from prompts that are each wrong in their own way.
        """
        s = self.status
        if (self.shape and self.failure_class == "sample") or self.routing:  # every prompt so: the config's
            return f"{s or 200} {_normalise(self.message)}"
        if s is None or not 400 <= s < 500 or s in RETRYABLE_STATUS or s in ACCOUNT_STATUS:
            return None
        # Also a prompt too long for the model: on every prompt it is the config's (a max_tokens past the
        # model's context, a model of too small a context), so it too waits for the streak's verdict.
        return f"{s} {_normalise(self.message)}"

    @property
    def retry_first(self) -> bool:
        """A sample failure that does not yet say the prompt is at fault: a client error with no detail
        ("Provider returned error", "Bad Request") or a malformed answer (one provider's bad answer, which a retry
        may route to another). It is retried; only the same on every attempt is the prompt's or the config's."""
        if self.signature is None:
            return False
        return self.shape or _GENERIC.fullmatch(self.message.strip()) is not None

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


_GENERIC = re.compile(r"(?i)(provider returned error|bad request|error|unknown error|no detail)\.?")


class _BadShape(ValueError):
    """A complete answer of the wrong shape (``Failure.shape``)."""


def interpret(status: int, raw: bytes | str, retry_after_header: str | None = None,
              now: float | None = None, secrets: Sequence[str | None] = ()) -> Reply | Failure:
    """Classify one HTTP answer; total: every status and body is a Reply or a Failure, never an exception.

    Leading whitespace padding before the JSON is tolerated. A cut, empty or non-JSON body may pass on
    retry (transient); complete JSON of the wrong shape is a sample failure marked ``shape`` (the reason
    names the field): retried first, as one provider's bad answer may be, and judged only when it repeats.
    Odd metadata (id, model, provider, usage numbers) is read as unknown, not refused. ``secrets`` (and
    bearer tokens, OpenRouter-style keys) are blanked out of every message before it is clipped, so no cut
    leaves part of one behind.
    """
    retry_after = parse_retry_after(retry_after_header, now)
    try:
        payload = loads(raw) if raw and raw.strip() else None
    except (*JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        payload = None
        if status == 200:  # typically a body cut mid-way: the provider finished (and billed) the generation
            return Failure("body", f"response is not JSON ({e.__class__.__name__}: {_say(str(e), secrets)})",
                           True, 200, maybe_billed=True)
    if status != 200:
        return _http_failure(status, payload, raw, retry_after, secrets)
    if payload is None:
        return Failure("body", "empty response body", True, 200, maybe_billed=True)
    if not isinstance(payload, dict):
        return Failure("body", f"response body is {_kind(payload)}, expected an object", False, 200,
                       maybe_billed=True, shape=True)
    provider = _name(payload.get("provider"))
    billed, cost = _usage(payload.get("usage"))

    def fail(message: str, retryable: bool, code: int | None = 200, who: str = provider,
             klass: FailureClass | None = None, shape: bool = False, unbilled: bool = False) -> Failure:
        return Failure("in_band", _say(message, secrets), retryable, code, retry_after, who, max(billed, 0), cost,
                       billed < 0 and not unbilled, klass, shape)

    err = payload.get("error")
    if isinstance(err, dict):
        # The error OpenRouter would have sent as this HTTP status had whitespace padding not opened a 200 already
        # (a provider's 429/502/503 after padding): billed as that status would be, nothing but a proxy timeout.
        code = _int(err.get("code"))
        who = _error_provider(err) or provider
        unbilled = code is not None and 400 <= code < 600 and code not in PROXY_TIMEOUT_STATUS
        flagged = _moderation(err) if code == 403 else None
        if flagged:
            return fail(flagged, False, code, who, "sample", unbilled=unbilled)
        return fail(_with_raw(_text(err.get("message") or err), err), _in_band_retryable(code), code, who,
                    unbilled=unbilled)
    choices = payload.get("choices")
    if choices is None or choices == []:
        return fail("response has no choices", True)
    if not isinstance(choices, list):
        return fail(f"choices is {_kind(choices)}, expected a list", False, shape=True)
    choice = choices[0]
    if not isinstance(choice, dict):
        return fail(f"choices[0] is {_kind(choice)}, expected an object", False, shape=True)
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        return fail(f"choices[0].finish_reason is {_kind(finish)}, expected a string", False, shape=True)
    native = choice.get("native_finish_reason")
    native = native if isinstance(native, str) else None
    if finish == "error":
        err = choice.get("error") or {}
        if isinstance(err, dict):
            flagged = _moderation(err) if _int(err.get("code")) == 403 else None
            if flagged:
                return fail(flagged, False, 403, klass="sample")
        msg = err.get("message") if isinstance(err, dict) else err
        return fail(f"finish_reason error: {_text(msg) or 'no detail'}", True)
    if native is not None and native.lower() in NATIVE_ERRORS:
        return fail(f"native_finish_reason {native!r} with finish_reason {finish!r}", True)
    if finish == "content_filter":
        # The provider's moderation cut (or rewrote) the answer: the text is not the target's to rebuild, and the
        # same prompt is filtered again. Like a moderation 403 it refuses this prompt (quarantine), nothing else.
        return fail(f"finish_reason content_filter (native {native!r}): the provider's moderation cut the answer",
                    False, 403, klass="sample")
    message = choice.get("message")
    if message is None:
        return fail("choice has no message", True)
    if not isinstance(message, dict):
        return fail(f"choices[0].message is {_kind(message)}, expected an object", False, shape=True)
    try:
        clean = _read_message(message, "choices[0].message")
    except _BadShape as e:
        return fail(str(e), False, shape=True)
    usage = {"completion_tokens": billed} if billed >= 0 else None
    completion = _shared_completion(clean, finish or "stop", usage)
    usage = payload.get("usage")
    cost_known = isinstance(usage, dict) and _money_or_none(usage.get("cost")) is not None
    prompt_tokens = _count(usage.get("prompt_tokens")) if isinstance(usage, dict) else None
    return Reply(completion, _name(payload.get("id")), provider, _name(payload.get("model")), billed, cost, native,
                 cost_known, -1 if prompt_tokens is None else prompt_tokens)


def _http_failure(status: int, payload: Any, raw: bytes | str, retry_after: float | None,
                  secrets: Sequence[str | None] = ()) -> Failure:
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        provider = _error_provider(err)
        flagged = _moderation(err) if status == 403 else None
        if flagged:
            return Failure("http", _say(flagged, secrets), False, status, retry_after, provider, klass="sample")
        message = _with_raw(_text(err.get("message") or ""), err)
    else:
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        message, provider = text.strip() or "no body", ""
    if status == 503 and not provider and routing_refusal(message):
        # OpenRouter itself (no provider named) finds no provider its routing allows (provider.only or ignore,
        # order without fallbacks, max_price, a data policy): waiting does not fix it. Judged like a 4xx: the
        # same answer on several prompts halts the source as config, one prompt's alone quarantines it.
        return Failure("http", _say(message, secrets), False, status, retry_after, provider, klass="sample",
                       routing=True)
    # Only a client error (4xx) can be the prompt's or the config's; any other status (a redirect, a 204, a
    # proxy's own code) says nothing about them.
    retryable = status in RETRYABLE_STATUS or (status >= 500 and status not in FATAL_STATUS) or \
        not 400 <= status < 600
    return Failure("http", _say(message, secrets), retryable, status, retry_after, provider,
                   maybe_billed=status in PROXY_TIMEOUT_STATUS)


# OpenRouter's words when routing leaves no provider: "No allowed providers are available for the selected model",
# "There is no available model provider that meets your routing requirements", "No endpoints found matching your
# data policy". Read with the missing provider name: a provider's own 503 names the provider.
_ROUTING_REFUSAL = re.compile(r"no (allowed )?providers? (is |are )?available|no available (model )?provider"
                              r"|no endpoints found|routing requirements", re.I)


def routing_refusal(message: str) -> bool:
    """Whether a 503's message says OpenRouter's routing left no provider (see ``_ROUTING_REFUSAL``)."""
    return bool(_ROUTING_REFUSAL.search(message))


def _with_raw(message: str, err: Mapping[str, Any]) -> str:
    """The message with the upstream provider's own words (``metadata.raw``) when there are some."""
    meta = err.get("metadata")
    meta_raw = meta.get("raw") if isinstance(meta, dict) else None
    return f"{message} ({_text(meta_raw)})" if meta_raw else message


def _in_band_retryable(code: int | None) -> bool:
    """An error inside a 200 body: a client-error code (4xx but 408/429) will not pass by waiting."""
    return code is None or code in RETRYABLE_STATUS or not 400 <= code < 500


def _moderation(err: Mapping[str, Any]) -> str | None:
    """Why moderation refused one input (``metadata.reasons``/``flagged_input``), or None if it did not.

    The flagged input is clipped: it is the user's prompt, not something to copy into every log line.
    """
    meta = err.get("metadata")
    if not isinstance(meta, dict) or ("reasons" not in meta and "flagged_input" not in meta):
        return None
    reasons = meta.get("reasons")
    why = ", ".join(_clip(_text(r), 80) for r in reasons[:20]) if isinstance(reasons, list) else _text(reasons)
    flagged = _clip(_text(meta.get("flagged_input")), 60)
    return (f"flagged by moderation ({_clip(why, 300) or 'no reasons given'}): "
            f"{_clip(_text(err.get('message')), 200)}; input {flagged!r}")


def _error_provider(err: Mapping[str, Any]) -> str:
    meta = err.get("metadata")
    return _name(meta.get("provider_name")) if isinstance(meta, dict) else ""


def _usage(usage: Any) -> tuple[int, float]:
    """(billed completion tokens or -1 when unknown, cost in USD); odd numbers read as unknown or free."""
    if not isinstance(usage, dict):
        return -1, 0.0
    billed = _count(usage.get("completion_tokens"))
    return (billed if billed is not None else -1), _money(usage.get("cost"))


# More completion tokens than this in one answer is not a bill but a broken counter.
_MAX_COUNT = 10**9


def _count(v: Any) -> int | None:
    """A token count: a non-negative JSON integer (an integral float passes); anything else is unknown."""
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_COUNT:
        return v
    return None


def _money(v: Any) -> float:
    """A cost: a finite non-negative JSON number, else 0 (what the report shows; the dollar budget asks
    ``_money_or_none`` whether the provider said)."""
    m = _money_or_none(v)
    return 0.0 if m is None else m


def _money_or_none(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) and f >= 0 else None


def _int(v: Any) -> int | None:
    """An error code: a JSON integer, an integral float or a numeric string; anything else is None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return int(v) if math.isfinite(v) else None
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None


def _text(v: Any) -> str:
    """Any JSON value as text for a message (nesting too deep for ``str`` is named, not shown)."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    try:
        return str(v)
    except RecursionError:
        return f"<deeply nested {type(v).__name__}>"


def _name(v: Any) -> str:
    """An identifier (id, model, provider): strings and numbers as text, other shapes as unknown ("")."""
    if isinstance(v, str):
        return _clip(v, 200)
    if isinstance(v, int | float) and not isinstance(v, bool):
        return str(v)
    return ""


def _kind(v: Any) -> str:
    """A JSON value's type, as a reason names it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    return "an object" if isinstance(v, dict) else f"a {type(v).__name__}"


_QUOTED = re.compile(r"\"[^\"]*\"|'[^']*'|`[^`]*`")
_WITH_DIGIT = re.compile(r"[\w.:/-]*\d[\w.:/-]*")


def _normalise(message: str) -> str:
    """A message with what varies per prompt (quoted values, numbers, ids) collapsed."""
    text = _WITH_DIGIT.sub("#", _QUOTED.sub("<q>", message.lower()))
    return " ".join(text.split())


def _clip(text: str, n: int = 500) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _say(text: str, secrets: Sequence[str | None] = ()) -> str:
    """A message for a row's error and the logs: secrets blanked first, then clipped (a cut through a key would
    leave its first characters where no exact match finds them)."""
    return _clip(redact(text, secrets))


# Content-part types whose text is the field's text (reasoning parts as in OpenRouter's reasoning_details).
TEXT_PARTS = frozenset({"text"})
REASONING_PARTS = frozenset({"text", "reasoning.text"})


def _read_message(message: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``content``, ``reasoning``/``reasoning_content`` and ``tool_calls`` of a message, checked and
    normalised: text fields as strings (content parts joined), tool calls in OpenAI's shape (arguments
    as a JSON string). Raises ``_BadShape`` naming the field that cannot be read."""
    reasoning = _field_text(message.get("reasoning"), f"{where}.reasoning", REASONING_PARTS)
    if not reasoning:  # "" is no reasoning: a server may send it empty and the text in reasoning_content
        reasoning = _field_text(message.get("reasoning_content"), f"{where}.reasoning_content",
                                REASONING_PARTS) or reasoning
    if not reasoning:  # some providers send reasoning null and the text only in reasoning_details
        reasoning = reasoning_details_text(message.get("reasoning_details")) or reasoning
    return {"content": _field_text(message.get("content"), f"{where}.content", TEXT_PARTS),
            "reasoning": reasoning, "tool_calls": _tool_calls(message.get("tool_calls"), f"{where}.tool_calls")}


def _field_text(v: Any, where: str, part_types: frozenset[str]) -> str | None:
    if v is None or isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise _BadShape(f"{where} is {_kind(v)}, expected a string or a list of text parts")
    return "".join(_part_text(p, f"{where}[{i}]", part_types) for i, p in enumerate(v))


def _part_text(part: Any, where: str, part_types: frozenset[str]) -> str:
    if not isinstance(part, dict):
        raise _BadShape(f"{where} is {_kind(part)}, expected a content part")
    kind = part.get("type")
    if not (isinstance(kind, str) and kind in part_types):
        raise _BadShape(f"{where} is a {_clip(_text(kind), 40)!r} part, expected {' or '.join(sorted(part_types))}")
    text = part.get("text")
    if not isinstance(text, str):
        raise _BadShape(f"{where}.text is {_kind(text)}, expected a string")
    return text


def _tool_calls(v: Any, where: str) -> list[dict[str, Any]] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise _BadShape(f"{where} is {_kind(v)}, expected a list")
    return [_tool_call(c, f"{where}[{i}]", i) for i, c in enumerate(v)] or None


def _tool_call(call: Any, where: str, i: int) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise _BadShape(f"{where} is {_kind(call)}, expected an object")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise _BadShape(f"{where}.function is {_kind(fn)}, expected an object")
    name = fn.get("name")
    if name is not None and not isinstance(name, str):
        raise _BadShape(f"{where}.function.name is {_kind(name)}, expected a string")
    args = fn.get("arguments")
    if not isinstance(args, str):
        try:
            args = json.dumps(args if args is not None else {}, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise _BadShape(f"{where}.function.arguments cannot be written as JSON") from e
    cid = call.get("id")
    return {"id": cid if isinstance(cid, str) and cid else f"call_{i}", "type": "function",
            "function": {"name": name or "", "arguments": args}}


def completion_from_message(message: Mapping[str, Any], finish_reason: str,
                            usage: Mapping[str, Any] | None = None) -> Completion:
    """The shared reading of an API message (``reasoning`` or ``reasoning_content``, billed count),
    with content parts joined and structured tool calls normalised to OpenAI's shape (arguments as a
    JSON string). Raises ValueError naming the field of a message that cannot be read."""
    billed = _count(usage.get("completion_tokens")) if isinstance(usage, Mapping) else None
    return _shared_completion(_read_message(message, "message"), finish_reason,
                              {"completion_tokens": billed} if billed is not None else None)


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
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP date; None for anything else."""
    if not value or not isinstance(value, str):
        return None
    value = value.strip()
    try:
        secs = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
            secs = when.timestamp() - (time.time() if now is None else now)
        except (TypeError, ValueError, IndexError, OverflowError, OSError, AttributeError):
            return None
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
