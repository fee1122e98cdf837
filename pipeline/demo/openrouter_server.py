"""A local server that speaks OpenRouter's chat-completions wire format, with fault injection.

Backends: the tiny target through transformers (real ids, reasoning split by
the profile, usage counted by the real tokenizer), or "no model" (canned text
after a delay, for load tests; ``--answer-tokens N``: long answers of about N
tokens, one of a fixed set picked by the prompt, for benches of the stages
after generation). Faults are drawn per request from configured
rates, or forced per prompt with a marker in a message such as
``[[fault:always-502]]`` (see ``MARKER_FAULTS``). Requests are validated as
OpenRouter does (its JSON 400), and with ``--padding`` a provider's error after
the padding comes inside the 200 body, as OpenRouter's does: it is the only API
the client's tests meet, so it must be no more lenient or regular than the real one.

    python -m pipeline serve-openrouter --port 8089 --model-dir runs/tiny --fault-429 0.1
    python -m pipeline serve-openrouter --port 0 --no-model --delay-ms 50 --answer-tokens 2000
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import math
import os
import random
import re
import secrets
import signal
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

PROVIDER_KEYS = frozenset({"order", "only", "ignore", "allow_fallbacks", "require_parameters", "data_collection",
                           "quantizations", "sort", "max_price", "zdr", "enforce_distillable_text",
                           "preferred_min_throughput", "preferred_max_latency"})
# 429/502/503: a provider's error; with padding it comes inside a 200 body (no Retry-After), as OpenRouter's
# does once the model started processing. content-parts: content as a list of text parts; choices-object:
# choices as an object, not a list; usage-string: completion_tokens as a string; proxy-524: a 524 after the
# generation was billed; native-finish: native_finish_reason is the provider's own word (end_turn, STOP, ...);
# reasoning-details: the reasoning only in reasoning_details (reasoning null); no-usage / no-cost: a success
# without usage / without usage.cost, as an OpenAI-compatible gateway sends it.
RANDOM_FAULTS = ("429", "502", "503", "timeout", "200-error", "empty-choices", "native-error",
                 "empty-content", "null-content", "cutoff", "content-parts", "choices-object", "usage-string",
                 "proxy-524", "native-finish", "reasoning-details", "no-usage", "no-cost")
# Per-prompt markers: a fixed HTTP status every time, "always-<fault>" for a random fault kind every
# time, echo-key (a 401 whose message repeats the presented key, as a careless gateway might),
# moderation (a 403 flagging this input, with metadata.reasons and flagged_input, billed nothing), and
# context (OpenRouter's context-length 400, as for a prompt too long for the model).
MARKER_FAULTS = frozenset({"400", "401", "402", "403", "echo-key", "moderation", "context"} |
                          {f"always-{k}" for k in RANDOM_FAULTS})
_MARKER = re.compile(r"\[\[fault:([a-z0-9-]+)\]\]")
STATUS_TEXT = {400: "Bad Request", 401: "User not found.", 402: "Insufficient credits", 403: "Flagged by moderation",
               408: "Request timed out", 429: "Rate limit exceeded", 502: "Provider returned error",
               503: "No endpoints found that can handle the request", 524: "Provider timed out",
               529: "Provider overloaded"}
# The provider's own finish words (native_finish_reason), one vocabulary per provider in turn: Anthropic-like,
# Google-like, and an engine that says what OpenRouter says.
NATIVE_FINISH = ({"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"},
                 {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP"},
                 {"stop": "eos", "length": "length", "tool_calls": "tool_calls"})

# What OpenRouter's request validation takes; anything else is its JSON 400, so a client bug fails here too.
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
REASONING_KEYS = frozenset({"effort", "max_tokens", "exclude", "enabled"})
EFFORTS = frozenset({"xhigh", "high", "medium", "low", "minimal", "none"})
SORTS = frozenset({"price", "throughput", "latency"})
DATA_COLLECTION = frozenset({"allow", "deny"})
QUANTIZATIONS = frozenset({"int4", "int8", "fp4", "fp6", "fp8", "fp16", "bf16", "fp32", "unknown"})
MAX_PRICE_KEYS = frozenset({"prompt", "completion", "request", "image"})
# Sampling parameters and their ranges (inclusive).
SAMPLING_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_a": (0.0, 1.0), "min_p": (0.0, 1.0),
                   "frequency_penalty": (-2.0, 2.0), "presence_penalty": (-2.0, 2.0),
                   "repetition_penalty": (0.0, 2.0)}


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    model_name: str = "tiny/deepseek-tiny"
    providers: tuple[str, ...] = ("Alpha", "Beta", "Gamma")
    api_key_env: str | None = None  # require this key (read from the environment) when set
    padding: int = 0  # whitespace bytes sent before the JSON body (keep-alive padding)
    seed: int = 0
    # Faults: probability per request.
    rates: dict[str, float] = field(default_factory=dict)  # RANDOM_FAULTS name -> rate
    retry_after_s: float | None = 1.0  # Retry-After of a 429 sent as an HTTP status (None: no header)
    timeout_s: float = 30.0  # how long a "timeout" fault stalls
    miscount_providers: tuple[str, ...] = ()  # bill a third of the real completion tokens
    corrupt_providers: tuple[str, ...] = ()  # leak a prompt-only marker and duplicate reasoning
    flaky_providers: dict[str, float] = field(default_factory=dict)  # provider -> rate of 502 it causes
    price_per_token: float = 1e-6  # per completion token (times the provider's price factor)
    prompt_price_per_token: float = 0.0  # per prompt token (same factor): usage.cost covers both
    price_factors: tuple[float, ...] = ()  # per provider, in order (empty: 1 + the provider's index)
    bill_log: str | None = None  # append one JSON line per billed generation (the provider's own bill)
    max_generations: int = 100_000  # generation stats kept for GET /generation
    # Account credit in completion tokens: a request whose max_tokens (absent: max_output_tokens) is more than
    # what is left gets 402 before anything is generated, as OpenRouter's pre-check of max_tokens x price does.
    credits_tokens: int | None = None
    max_output_tokens: int = 16_384  # the model's most completion tokens (what an absent max_tokens asks for)
    # Models with an endpoint; a request for any other gets 404 "No endpoints found" (empty: every model).
    known_models: tuple[str, ...] = ()
    # The model's context in tokens: a request whose max_tokens and (estimated) prompt do not fit gets
    # OpenRouter's context-length 400 (None: no limit). The "context" marker gets it whatever the sizes.
    context_tokens: int | None = None
    # While this file exists, every chat request waits (counted in "requests", not yet answered or billed): a
    # provider that stalls, which a test lifts when it is ready (e.g. once a pool has grown onto a new node).
    hold_file: str | None = None
    # The status of OpenRouter's answer when the routing preferences leave no provider: 404 "No allowed
    # providers are available for the selected model", or 503 "There is no available model provider that meets
    # your routing requirements" (its error docs list both).
    routing_status: int = 404


# --------------------------------------------------------------------------- pure parts


def draw_fault(rates: Mapping[str, float], rng: random.Random) -> str | None:
    """One random fault kind (or None) by cumulative rate."""
    u = rng.random()
    acc = 0.0
    for kind in RANDOM_FAULTS:
        acc += rates.get(kind, 0.0)
        if u < acc:
            return kind
    return None


def marker_fault(messages: Sequence[Mapping[str, Any]]) -> str | None:
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, str):
            found = _MARKER.search(content)
            if found and found.group(1) in MARKER_FAULTS:
                return found.group(1)
    return None


def request_problem(body: Any) -> str | None:
    """Why OpenRouter's validation would refuse this request body with a 400, or None if it passes.

    Strict on purpose: the stand-in is the only API the client's tests meet, so a request the real API refuses
    must be refused here too (the error is OpenRouter's JSON 400, never a 500 or a silent default)."""
    if not isinstance(body, dict):
        return "Request body must be a JSON object"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: expected a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}]: expected an object with a role"
        if m.get("role") not in ROLES:
            return f"messages[{i}].role: expected one of {sorted(ROLES)}, got {m.get('role')!r}"
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            return f"messages[{i}].content: expected a string, a list of content parts or null"
    if body.get("stream") not in (None, False):
        return "stream: this endpoint answers non-streaming requests only (stream must be false)"
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens <= 0):
        return "max_tokens must be a positive integer"
    for name, (lo, hi) in SAMPLING_RANGES.items():
        v = body.get(name)
        if v is not None and not (_is_number(v) and lo <= v <= hi):
            return f"{name} must be a number from {lo:g} to {hi:g}, got {v!r}"
    if body.get("top_k") is not None and not (_is_int(body["top_k"]) and body["top_k"] >= 0):
        return f"top_k must be an integer >= 0, got {body['top_k']!r}"
    if body.get("seed") is not None and not _is_int(body["seed"]):
        return f"seed must be an integer, got {body['seed']!r}"
    if "reasoning" in body:
        problem = _reasoning_problem(body["reasoning"])
        if problem:
            return problem
    if "provider" in body:
        return _provider_problem(body["provider"])
    return None


def _reasoning_problem(r: Any) -> str | None:
    if not isinstance(r, dict):
        return "reasoning: expected an object"
    unknown = sorted(set(r) - REASONING_KEYS)
    if unknown:
        return f"reasoning: unrecognized keys {unknown}"
    if "effort" in r and "max_tokens" in r:
        return "reasoning: set effort or max_tokens, not both"
    if "effort" in r and r["effort"] not in EFFORTS:
        return f"reasoning.effort: expected one of {sorted(EFFORTS)}, got {r['effort']!r}"
    if "max_tokens" in r and not (_is_int(r["max_tokens"]) and r["max_tokens"] >= 0):
        return f"reasoning.max_tokens must be an integer >= 0, got {r['max_tokens']!r}"
    for key in ("exclude", "enabled"):
        if key in r and not isinstance(r[key], bool):
            return f"reasoning.{key} must be a boolean, got {r[key]!r}"
    return None


def _provider_problem(prefs: Any) -> str | None:
    if not isinstance(prefs, dict):
        return "provider: expected an object"
    unknown = sorted(set(prefs) - PROVIDER_KEYS)
    if unknown:
        return f"provider: unrecognized keys {unknown}"
    for key in ("order", "only", "ignore", "quantizations"):
        v = prefs.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            return f"provider.{key}: expected a list of strings, got {v!r}"
    bad = sorted(set(prefs.get("quantizations") or []) - QUANTIZATIONS)
    if bad:
        return f"provider.quantizations: unknown values {bad} (expected some of {sorted(QUANTIZATIONS)})"
    for key in ("allow_fallbacks", "require_parameters", "zdr", "enforce_distillable_text"):
        if prefs.get(key) is not None and not isinstance(prefs[key], bool):
            return f"provider.{key} must be a boolean, got {prefs[key]!r}"
    if prefs.get("sort") is not None and prefs["sort"] not in SORTS:
        return f"provider.sort: expected one of {sorted(SORTS)}, got {prefs['sort']!r}"
    if prefs.get("data_collection") is not None and prefs["data_collection"] not in DATA_COLLECTION:
        return f"provider.data_collection: expected one of {sorted(DATA_COLLECTION)}, got {prefs['data_collection']!r}"
    cap = prefs.get("max_price")
    if cap is not None:
        if not isinstance(cap, dict):
            return "provider.max_price: expected an object"
        unknown = sorted(set(cap) - MAX_PRICE_KEYS)
        if unknown:
            return f"provider.max_price: unrecognized keys {unknown}"
        for key, v in cap.items():
            if _price(v) is None:
                return f"provider.max_price.{key}: expected a number >= 0 (dollars per million tokens), got {v!r}"
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _price(v: Any) -> float | None:
    """A max_price value as OpenRouter takes it (a finite number >= 0, or such a number as a string), else None."""
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        return None
    try:
        f = float(v)
    except (ValueError, OverflowError):
        return None
    return f if math.isfinite(f) and f >= 0 else None


def route(providers: Sequence[str], prefs: Mapping[str, Any] | None, rng: random.Random,
          prices: Mapping[str, tuple[float, float]] | None = None) -> str | None:
    """The provider that serves a request under OpenRouter's routing object, or None if none qualifies.
    ``prices``: each provider's dollars per million prompt and completion tokens, for ``max_price``."""
    prefs = prefs or {}
    ignore = set(prefs.get("ignore") or [])
    candidates = [p for p in providers if p not in ignore and within_max_price(prefs, (prices or {}).get(p))]
    if prefs.get("only"):
        only = set(prefs["only"])
        candidates = [p for p in candidates if p in only]
    if prefs.get("order"):
        order = [p for p in prefs["order"] if p in candidates]
        if order:
            return order[0]
        if prefs.get("allow_fallbacks", True) is False:
            return None
    if not candidates:
        return None
    if prefs.get("sort"):
        return sorted(candidates)[0]
    return rng.choice(candidates)


def within_max_price(prefs: Mapping[str, Any], price: tuple[float, float] | None) -> bool:
    """Whether a provider of this price (dollars per million prompt and completion tokens) is under the request's
    ``max_price`` (OpenRouter's: per million tokens, numbers or numeric strings; a key left out caps nothing)."""
    cap = prefs.get("max_price")
    if not isinstance(cap, Mapping) or price is None:
        return True
    for key, have in zip(("prompt", "completion"), price, strict=True):
        limit = _price(cap[key]) if key in cap else math.inf  # request_problem refused any other value
        if limit is not None and have > limit * (1 + 1e-9):  # a price given in decimal dollars is not exact in binary
            return False
    return True


def thinking_requested(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(thinking on, reasoning excluded from the answer) from `reasoning` or chat_template_kwargs."""
    r = body.get("reasoning")
    kwargs = body.get("chat_template_kwargs") or {}
    if isinstance(r, dict):
        on = r.get("enabled", True) is not False and r.get("effort") != "none"
        return on, bool(r.get("exclude"))
    if "thinking" in kwargs or "enable_thinking" in kwargs:
        return bool(kwargs.get("thinking", kwargs.get("enable_thinking"))), False
    return False, False


def error_body(code: int, message: str, provider: str | None = None, raw: str | None = None,
               extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = dict(extra or {})
    if provider:
        meta["provider_name"] = provider
    if raw:
        meta["raw"] = raw
    err: dict[str, Any] = {"code": code, "message": message}
    if meta:
        err["metadata"] = meta
    return {"error": err, "user_id": "user_local"}


def flagged_excerpt(text: str, n: int = 100) -> str:
    """The flagged input as OpenRouter reports it: at most ``n`` characters, cut in the middle."""
    if len(text) <= n:
        return text
    half = (n - 3) // 2
    return text[:half] + "..." + text[-half:]


def text_parts(text: str | None) -> list[dict[str, str]]:
    """Content as a list of text parts (as some providers send it), joining back to the same text."""
    text = text or ""
    cut = [0, len(text) // 3, 2 * len(text) // 3, len(text)]
    return [{"type": "text", "text": text[a:b]} for a, b in zip(cut, cut[1:], strict=False) if b > a] or \
        [{"type": "text", "text": ""}]


@dataclass
class Generated:
    """One completion in the API's shape plus its real token counts."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int


def chat_result(gen_id: str, model: str, provider: str, g: Generated, billed: int, cost: float,
                created: int, native_finish_reason: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": g.content, "refusal": None, "reasoning": g.reasoning}
    if g.reasoning:
        message["reasoning_details"] = [{"type": "reasoning.text", "text": g.reasoning, "format": "unknown",
                                         "index": 0}]
    if g.tool_calls:
        message["tool_calls"] = g.tool_calls
    return {
        "id": gen_id, "provider": provider, "model": model, "object": "chat.completion", "created": created,
        "system_fingerprint": None,
        "choices": [{"logprobs": None, "finish_reason": g.finish_reason,
                     "native_finish_reason": native_finish_reason or g.finish_reason, "index": 0,
                     "message": message}],
        "usage": {"prompt_tokens": g.prompt_tokens, "completion_tokens": billed,
                  "total_tokens": g.prompt_tokens + billed, "cost": cost, "is_byok": False,
                  "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                  "cost_details": {"upstream_inference_cost": None, "upstream_inference_prompt_cost": 0,
                                   "upstream_inference_completions_cost": cost},
                  "completion_tokens_details": {"reasoning_tokens": g.reasoning_tokens, "image_tokens": 0}},
    }


def generation_stats(gen_id: str, model: str, provider: str, g: Generated, billed: int, cost: float,
                     latency_ms: float, finish_reason: str, native: str | None) -> dict[str, Any]:
    """The `data` object of GET /api/v1/generation."""
    return {
        "id": gen_id, "upstream_id": gen_id.replace("gen-", "up-"), "total_cost": cost, "cache_discount": None,
        "upstream_inference_cost": None, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": model, "app_id": None, "streamed": False, "cancelled": False, "provider_name": provider,
        "latency": latency_ms, "moderation_latency": None, "generation_time": latency_ms,
        "finish_reason": finish_reason, "native_finish_reason": native or finish_reason,
        "tokens_prompt": g.prompt_tokens, "tokens_completion": billed,
        "native_tokens_prompt": g.prompt_tokens, "native_tokens_completion": billed,
        "native_tokens_completion_images": None, "native_tokens_reasoning": g.reasoning_tokens,
        "native_tokens_cached": 0, "num_media_prompt": None, "num_input_audio_prompt": None,
        "num_media_completion": None, "num_search_results": None, "origin": "", "usage": cost, "is_byok": False,
        "api_type": "completions", "external_user": None, "http_referer": None, "preset_id": None,
        "router": None, "service_tier": None, "user_agent": None, "web_search_engine": None,
        "workspace_id": None, "data_region": "global", "num_fetches": None, "session_id": None,
        "provider_responses": [{"status": 200, "provider_name": provider, "latency": latency_ms, "is_byok": False}],
    }


# --------------------------------------------------------------------------- backends


# Long answers (--answer-tokens): sentences of these words, so that no block repeats back to back (the
# repetition check passes) and decode -> encode gives the same ids (the roundtrip check passes).
ANSWER_WORDS = tuple("""
the a of to and in that is for it with as on be at by this from or an are was but not have all can one
more when will there which their so if about what up out them into than then some could time only other new
any these two may first way each such many after also made over did down most long through where much before
must well back us good little very great still own see old here between both life being under never day same
another know while last might next found house world part small place every state large number point water
given light river city tree field stone bridge road market garden window morning evening winter summer north
south measure answer question reason result method sample signal model token value table list order record
""".split())
ANSWER_VARIANTS = 64  # distinct answers per shape; a prompt's digest picks one


def sized_text(profile: Any, n_tokens: int, seed: int) -> str:
    """Sentences of ``ANSWER_WORDS``, fixed by ``seed``: the most words whose text encodes to at most
    ``n_tokens`` tokens (a search on the word count, guided by the measured tokens per word)."""
    rng = random.Random(seed)
    pieces: list[str] = []

    def count(m: int) -> int:
        while len(pieces) < m:
            words = [rng.choice(ANSWER_WORDS) for _ in range(rng.randint(6, 16))]
            words[0] = words[0].capitalize()
            if len(words) > 9 and rng.random() < 0.5:
                words[len(words) // 2] += ","
            words[-1] += "."
            pieces.extend(words)
        return len(profile.encode(" ".join(pieces[:m])))

    lo, hi, m = 0, None, max(1, n_tokens // 2)  # count(lo) <= n_tokens < count(hi)
    for _ in range(40):
        got = count(m)
        if got <= n_tokens:
            lo = m
        else:
            hi = m
        if hi is not None and hi - lo <= 1:
            break
        guess = round(m * n_tokens / max(got, 1))
        m = max(lo + 1, guess if hi is None else min(guess, hi - 1))
    return " ".join(pieces[:max(lo, 1)])


def answer_variant(body: Mapping[str, Any]) -> int:
    """Which of the ``ANSWER_VARIANTS`` answers a request gets: a digest of its messages and seed."""
    key = json.dumps([body.get("messages"), body.get("seed")], sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big") % ANSWER_VARIANTS


def long_answer_ids(profile: Any, n_tokens: int, variant: int, thinking: bool) -> list[int]:
    """The ids the "model" writes for a long answer of about ``n_tokens`` tokens in all: with thinking,
    reasoning and content of about half each around ``</think>`` (with the profile's padding there), then the
    end of turn. Usage is counted on these ids, so what is billed is what a rebuild of the text gives back."""
    seed = variant * 2 + 1
    if not thinking:
        return profile.encode(sized_text(profile, max(1, n_tokens - 1), seed)) + [profile.eot_id]
    before, after = profile.think_end_padding
    n_reasoning = max(1, (n_tokens - 2) // 2)
    n_content = max(1, n_tokens - 2 - n_reasoning)
    reasoning = sized_text(profile, n_reasoning, seed) + before
    content = after + sized_text(profile, n_content, seed + 1)
    return profile.encode(reasoning) + [profile.think_end_id] + profile.encode(content) + [profile.eot_id]


class CannedBackend:
    """No model: fixed text after a delay; token counts from the tokenizer when one is given.

    ``answer_tokens``: instead of the one short answer, long ones of about that many tokens (needs the
    profile): ``ANSWER_VARIANTS`` of them per thinking mode, built once each on first use, picked by
    ``answer_variant``; a ``max_tokens`` below the answer cuts its ids there (finish ``length``)."""

    def __init__(self, delay_ms: float = 50.0, profile: Any = None, answer_tokens: int | None = None) -> None:
        if answer_tokens is not None and (profile is None or answer_tokens <= 0):
            raise ValueError("answer_tokens needs a profile (its tokenizer sizes the answers) and must be > 0")
        self.delay_s = delay_ms / 1000.0
        self.profile, self.answer_tokens = profile, answer_tokens
        self._long: dict[tuple[int, bool], tuple[list[int], Generated]] = {}
        self.reasoning = "The user asks a question. I will think briefly and answer."
        self.content = "Here is a short canned answer from the load-test server."
        if profile is not None:
            self.n_reasoning = len(profile.encode(self.reasoning))
            self.n_content = len(profile.encode(self.content)) + 1  # + end of turn
        else:
            self.n_reasoning = len(self.reasoning.split())
            self.n_content = len(self.content.split()) + 1

    async def generate(self, body: Mapping[str, Any], thinking: bool) -> Generated:
        await asyncio.sleep(self.delay_s)
        n_prompt = self.prompt_tokens(body, thinking)
        limit = int(body.get("max_tokens") or 1 << 30)
        if self.answer_tokens is not None:
            return self.long_answer(answer_variant(body), thinking, limit, n_prompt)
        n = self.n_reasoning + 1 + self.n_content if thinking else self.n_content
        if n > limit and self.profile is not None:
            # Cut where the model would have stopped, then split as a server's parser would: the text sent is
            # what was billed (a rebuild of it gives back ``limit`` ids), not the whole answer billed short.
            ids = (self.profile.encode(self.reasoning) + [self.profile.think_end_id] if thinking else []) + \
                self.profile.encode(self.content) + [self.profile.eot_id]
            return split_generated(self.profile, ids[:limit], thinking, tools_sent=False, prompt_tokens=n_prompt)
        if thinking:
            return Generated(self.reasoning, self.content, None, "stop" if n <= limit else "length", n_prompt,
                             min(n, limit), min(self.n_reasoning, limit))
        return Generated(None, self.content, None, "stop" if n <= limit else "length", n_prompt, min(n, limit), 0)

    def prompt_tokens(self, body: Mapping[str, Any], thinking: bool) -> int:
        """Prompt tokens as the model's server counts them: the rendered prompt's ids (a word count without a
        profile, where no count is exact anyway)."""
        if self.profile is None:
            return sum(len(str(m.get("content") or "").split()) for m in body["messages"])
        return len(self.profile.render_prompt(list(body["messages"]), body.get("tools") or None, thinking).ids)

    def long_answer(self, variant: int, thinking: bool, limit: int, n_prompt: int) -> Generated:
        """One long answer, split and counted from its ids as the transformers backend's are (a fresh copy:
        the server edits what it sends)."""
        key = (variant, thinking)
        if key not in self._long:
            ids = long_answer_ids(self.profile, int(self.answer_tokens or 0), variant, thinking)
            self._long[key] = ids, split_generated(self.profile, ids, thinking, tools_sent=False, prompt_tokens=0)
        ids, whole = self._long[key]
        if len(ids) > limit:
            return split_generated(self.profile, ids[:limit], thinking, tools_sent=False, prompt_tokens=n_prompt)
        return replace(whole, prompt_tokens=n_prompt)


class TransformersBackend:
    """The tiny target through transformers ``generate`` on CPU, one request at a time on one thread."""

    def __init__(self, model_dir: str, profile_name: str = "deepseek", threads: int = 1) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        from pipeline.profiles import load_profile

        torch.set_num_threads(threads)
        self.torch = torch
        self.profile = load_profile(profile_name, model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # transformers fills what a generate call leaves unset from the folder's generation_config.json
        # (repetition_penalty, min_new_tokens, ...); a provider applies only the sampling it is sent.
        self.model.generation_config = GenerationConfig(eos_token_id=self.profile.eot_id,
                                                        pad_token_id=self.profile.eot_id)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")

    def _generate_ids(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float,
                      seed: int | None) -> list[int]:
        torch = self.torch
        if seed is not None:
            torch.manual_seed(int(seed))
        ids = torch.tensor([prompt_ids])
        kwargs: dict[str, Any] = {"do_sample": temperature > 0, "max_new_tokens": max_tokens,
                                  "eos_token_id": self.profile.eot_id, "pad_token_id": self.profile.eot_id}
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out[0, len(prompt_ids):].tolist()

    async def generate(self, body: Mapping[str, Any], thinking: bool) -> Generated:
        tools = body.get("tools") or None
        rendered = self.profile.render_prompt(list(body["messages"]), tools, thinking)
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(
            self.pool, self._generate_ids, rendered.ids, int(body.get("max_tokens") or 256),
            float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0)), body.get("seed"))
        return split_generated(self.profile, out, rendered.thinking, tools_sent=bool(tools),
                               prompt_tokens=len(rendered.ids))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def split_generated(profile: Any, ids: list[int], thinking: bool, *, tools_sent: bool,
                    prompt_tokens: int) -> Generated:
    """What a server's reasoning parser (and, only when tools were sent, its tool parser) returns."""
    c = profile.split_ids(ids, thinking)
    if c.tool_calls and not tools_sent:
        # No tool parser runs for a request without tools: the section stays in content as text.
        text = profile.decode(ids)
        eot = profile.decode([profile.eot_id])
        text = text[: -len(eot)] if text.endswith(eot) else text
        if thinking and profile.think_end_text in text:
            text = text.split(profile.think_end_text, 1)[1]
        c.content, c.tool_calls = text, None
        c.finish_reason = "stop" if c.finish_reason == "tool_calls" else c.finish_reason
    n_reasoning = 0
    if thinking:
        n_reasoning = ids.index(profile.think_end_id) if profile.think_end_id in ids else len(ids)
    return Generated(c.reasoning, c.content, c.tool_calls, c.finish_reason, prompt_tokens, len(ids), n_reasoning)


# --------------------------------------------------------------------------- server


class OpenRouterLikeServer:
    """The aiohttp application and its state (faults RNG, generation stats, counters)."""

    def __init__(self, cfg: ServerConfig, backend: Any) -> None:
        self.cfg = cfg
        self.backend = backend
        self.rng = random.Random(cfg.seed)
        self.generations: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.counts: dict[str, int] = {}
        self._key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
        if cfg.api_key_env and not self._key:
            raise RuntimeError(f"environment variable {cfg.api_key_env} is not set")
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_post("/api/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_get("/api/v1/generation", self.generation)
        self.app.router.add_get("/api/v1/stats", self.stats)

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def _log_bill(self, gen_id: str, body: Mapping[str, Any], billed: int, cost: float) -> None:
        """One line per billed generation: which conversation (a digest of its messages), its id and bill, so a
        test can tell from the provider's side whether any prompt was paid for twice."""
        if not self.cfg.bill_log:
            return
        digest = hashlib.sha256(json.dumps(body.get("messages"), sort_keys=True).encode()).hexdigest()
        with open(self.cfg.bill_log, "a") as f:
            f.write(json.dumps({"id": gen_id, "messages_sha256": digest, "billed": billed, "cost": cost,
                                "at": time.time()}) + "\n")

    def _authorized(self, request: web.Request) -> bool:
        if not self._key:
            return True
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), ("Bearer " + self._key).encode())

    def price_factor(self, provider: str) -> float:
        i = self.cfg.providers.index(provider)
        return self.cfg.price_factors[i] if i < len(self.cfg.price_factors) else 1.0 + i

    def provider_prices(self) -> dict[str, tuple[float, float]]:
        """Each provider's list price, dollars per million prompt and completion tokens (what it bills)."""
        return {p: (self.cfg.prompt_price_per_token * self.price_factor(p) * 1e6,
                    self.cfg.price_per_token * self.price_factor(p) * 1e6) for p in self.cfg.providers}

    def _error(self, code: int, message: str, provider: str | None = None, raw: str | None = None,
               retry_after: float | None = None, extra: Mapping[str, Any] | None = None) -> web.Response:
        self._count(f"status_{code}")
        headers = {"Retry-After": f"{retry_after:g}"} if retry_after is not None else None
        return web.json_response(error_body(code, message, provider, raw, extra), status=code, headers=headers)

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"counts": self.counts, "generations": len(self.generations)})

    async def generation(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._error(401, STATUS_TEXT[401])
        data = self.generations.get(request.query.get("id", ""))
        if data is None:
            return self._error(404, "Generation not found")
        return web.json_response({"data": data})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """One chat completion. Checks OpenRouter makes before any provider is called (key, request, credits,
        context, routing, moderation) answer with their HTTP status; with padding, headers and whitespace go out
        next, and from then on a provider's error can only be told inside the 200 body."""
        self._count("requests")
        while self.cfg.hold_file and os.path.exists(self.cfg.hold_file):
            await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        if not self._authorized(request):
            return self._error(401, STATUS_TEXT[401])
        try:
            body = await request.json()
        except ValueError:
            return self._error(400, "Invalid JSON in request body")
        problem = request_problem(body)
        if problem:
            return self._error(400, problem)
        prefs = body.get("provider")
        max_tokens = body.get("max_tokens")
        if self.cfg.known_models and body.get("model") not in self.cfg.known_models:
            return self._error(404, f"No endpoints found for {body.get('model')}.")
        if self.cfg.credits_tokens is not None:
            left = self.cfg.credits_tokens - self.counts.get("billed_completion_tokens", 0)
            asked = max_tokens if max_tokens is not None else self.cfg.max_output_tokens
            if asked > left:  # OpenRouter's pre-check: the most this request can cost, against what is left
                return self._error(402, f"This request requires more credits, or fewer max_tokens. You requested "
                                   f"up to {asked} tokens, but can only afford {max(left, 0)}. To increase, visit "
                                   "https://openrouter.ai/settings/credits and add more credits")
        fault = marker_fault(body["messages"])
        if fault and fault.startswith("always-"):
            fault = fault[len("always-"):]
        elif fault is None:
            fault = draw_fault(self.cfg.rates, self.rng)
        if fault == "echo-key":
            return self._error(401, f"Invalid credentials: {request.headers.get('Authorization', '')}")
        asked = max_tokens if isinstance(max_tokens, int) else 0
        text = sum(len(m["content"]) // 4 + 1 for m in body["messages"] if isinstance(m.get("content"), str))
        ctx = self.cfg.context_tokens
        if fault == "context" or (ctx is not None and text + asked > ctx):
            ctx = ctx or text
            return self._error(400, f"This endpoint's maximum context length is {ctx} tokens. However, you requested "
                               f"about {text + asked} tokens ({text} of text input, {asked} in the output). Please "
                               "reduce the length of either one, or use the \"middle-out\" transform to compress "
                               "your prompt automatically.")
        if fault in ("400", "401", "402", "403"):
            code = int(fault)
            return self._error(code, STATUS_TEXT[code])
        provider = route(self.cfg.providers, prefs, self.rng, self.provider_prices())
        if provider is None:
            # Routing preferences (only, ignore, order without fallbacks, max_price) that leave no provider: a
            # request error that waiting will not fix (OpenRouter answers 404, or 503 with no provider named).
            meta: dict[str, Any] = {"available_providers": list(self.cfg.providers)}
            requested = (prefs or {}).get("only") or (prefs or {}).get("order")
            if requested:
                meta["requested_providers"] = list(requested)
            if self.cfg.routing_status == 503:
                return self._error(503, "There is no available model provider that meets your routing "
                                   "requirements.", extra=meta)
            return self._error(404, "No allowed providers are available for the selected model.", extra=meta)
        if fault == "moderation":  # refused before it reaches a provider: nothing billed, never in a 200 body
            flagged = next((m.get("content") for m in body["messages"] if isinstance(m.get("content"), str)), "")
            return self._error(403, f"{self.cfg.model_name} requires moderation on {provider}. "
                               "Your input was flagged for \"violence\"", provider,
                               extra={"reasons": ["violence"], "flagged_input": flagged_excerpt(flagged),
                                      "model_slug": self.cfg.model_name})

        resp: web.StreamResponse | None = None
        if self.cfg.padding:
            # Headers and padding go out at once; from here on, failures can only be told in the body.
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            try:
                await resp.write(b"\n" + b" " * max(0, self.cfg.padding - 1))
            except ConnectionResetError:
                self._count("client_gone")
                return resp
        if fault == "429":  # without padding: OpenRouter's own limit, with Retry-After; with it: the provider's
            return await self._provider_error(resp, 429, provider, "rate limited upstream",
                                              retry_after=self.cfg.retry_after_s)
        if fault == "503":
            return await self._provider_error(resp, 503, provider, "service unavailable")
        flaky = self.cfg.flaky_providers.get(provider, 0.0)
        if fault == "502" or (flaky and self.rng.random() < flaky):
            return await self._provider_error(resp, 502, provider, "upstream connection reset")
        if fault == "timeout":
            await asyncio.sleep(self.cfg.timeout_s)
            if resp is None:
                return self._error(408, STATUS_TEXT[408])
        thinking, exclude = thinking_requested(body)
        gen = await self.backend.generate(body, thinking)
        payload = self._payload(body, provider, gen, fault, exclude, time.perf_counter() - t0)
        raw = json.dumps(payload, ensure_ascii=False).encode()
        if fault == "cutoff":
            return await self._cut_off(request, resp, raw)
        if fault == "proxy-524":
            return await self._proxy_timeout(resp, provider)
        self._count("served" if fault is None else f"fault_{fault}")
        if resp is None:
            return web.Response(body=raw, content_type="application/json")
        try:
            await resp.write(raw)
            await resp.write_eof()
        except ConnectionResetError:
            self._count("client_gone")  # the client timed out and closed the connection
        return resp

    async def _provider_error(self, resp: web.StreamResponse | None, code: int, provider: str, raw: str,
                              retry_after: float | None = None) -> web.StreamResponse:
        """A provider's error, nothing billed: its HTTP status before any padding, else ``{"error": ...}`` in the
        200 body that padding already opened (no Retry-After then: the headers are gone). A 429 as a status is
        OpenRouter's own rate limit (no provider named); the others name the provider and its words."""
        if resp is None:
            if code == 429:
                return self._error(429, STATUS_TEXT[429], retry_after=retry_after)
            return self._error(code, STATUS_TEXT[code], provider=provider, raw=raw)
        self._count(f"status_{code}")
        try:
            await resp.write(json.dumps(error_body(code, STATUS_TEXT[code], provider, raw)).encode())
            await resp.write_eof()
        except ConnectionResetError:
            self._count("client_gone")
        return resp

    def _payload(self, body: Mapping[str, Any], provider: str, gen: Generated, fault: str | None, exclude: bool,
                 elapsed: float) -> dict[str, Any]:
        gen_id = f"gen-{int(time.time())}-{secrets.token_hex(8)}"
        billed = gen.completion_tokens
        if provider in self.cfg.miscount_providers:
            billed = gen.completion_tokens // 3
        if provider in self.cfg.corrupt_providers:
            gen = _corrupt(gen)
        if exclude:
            gen.reasoning = None
        native = None
        if fault == "empty-content":
            gen.content = ""
        elif fault == "null-content":
            gen.content = None
        elif fault == "native-error":
            native = "error"
        elif fault == "native-finish":
            vocabulary = NATIVE_FINISH[self.cfg.providers.index(provider) % len(NATIVE_FINISH)]
            native = vocabulary.get(gen.finish_reason, gen.finish_reason)
        cost = (billed * self.cfg.price_per_token + gen.prompt_tokens * self.cfg.prompt_price_per_token) \
            * self.price_factor(provider)
        # What the "provider" billed, including responses the client never reads (killed mid-flight).
        self.counts["billed_completion_tokens"] = self.counts.get("billed_completion_tokens", 0) + billed
        self.counts["billed_cost_nano_usd"] = self.counts.get("billed_cost_nano_usd", 0) + round(cost * 1e9)
        self._log_bill(gen_id, body, billed, cost)
        payload = chat_result(gen_id, str(body.get("model") or self.cfg.model_name), provider, gen, billed, cost,
                              int(time.time()), native)
        if fault == "200-error":
            choice = payload["choices"][0]
            choice["finish_reason"] = "error"
            choice["native_finish_reason"] = "error"
            choice["error"] = {"code": 502, "message": "Upstream provider error",
                               "metadata": {"provider_name": provider}}
            choice["message"]["content"] = ""
        elif fault == "empty-choices":
            payload["choices"] = []
        elif fault == "content-parts":
            payload["choices"][0]["message"]["content"] = text_parts(gen.content)
        elif fault == "usage-string":
            payload["usage"]["completion_tokens"] = str(billed)
        elif fault == "reasoning-details":
            payload["choices"][0]["message"]["reasoning"] = None  # the text stays in reasoning_details
        elif fault == "no-usage":
            del payload["usage"]  # billed all the same: the provider's bill, which the answer does not tell
        elif fault == "no-cost":
            for key in ("cost", "is_byok", "cost_details"):
                del payload["usage"][key]
        finish = payload["choices"][0]["finish_reason"] if payload["choices"] else "error"
        if fault == "choices-object":
            payload["choices"] = payload["choices"][0]
        self._remember(gen_id, generation_stats(gen_id, payload["model"], provider, gen, billed, cost, elapsed * 1000,
                                                finish, native))
        return payload

    async def _proxy_timeout(self, resp: web.StreamResponse | None, provider: str) -> web.StreamResponse:
        """The gateway gave up on an origin that went on to generate (and bill) the answer: a 524, or,
        once padding has sent a 200, the same error inside the body."""
        self._count("fault_proxy-524")
        if resp is None:
            return self._error(524, STATUS_TEXT[524], provider=provider)
        self._count("status_524")
        try:
            await resp.write(json.dumps(error_body(524, STATUS_TEXT[524], provider)).encode())
            await resp.write_eof()
        except ConnectionResetError:
            self._count("client_gone")
        return resp

    def _remember(self, gen_id: str, stats: dict[str, Any]) -> None:
        self.generations[gen_id] = stats
        while len(self.generations) > self.cfg.max_generations:
            self.generations.popitem(last=False)

    async def _cut_off(self, request: web.Request, resp: web.StreamResponse | None, raw: bytes) -> web.StreamResponse:
        """Send half the body, then drop the connection."""
        self._count("fault_cutoff")
        if resp is None:
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            resp.content_length = len(raw)
            await resp.prepare(request)
        try:
            await resp.write(raw[: len(raw) // 2])
        except ConnectionResetError:
            return resp
        if request.transport is not None:
            request.transport.close()
        return resp


def _corrupt(g: Generated) -> Generated:
    """A provider serving something else: a prompt-only marker in the text, reasoning doubled."""
    reasoning = (g.reasoning or "") * 2 if g.reasoning else g.reasoning
    content = "<｜User｜>" + (g.content or "")
    return Generated(reasoning, content, g.tool_calls, g.finish_reason, g.prompt_tokens, g.completion_tokens,
                     g.reasoning_tokens)


# --------------------------------------------------------------------------- running


def make_backend(model_dir: str | None, profile_name: str, delay_ms: float, no_model: bool,
                 answer_tokens: int | None = None) -> Any:
    if no_model or not model_dir:
        from pipeline.profiles import load_profile

        # Usage is still counted by the real tokenizer, so billing cross-checks hold in load tests.
        return CannedBackend(delay_ms, load_profile(profile_name, model_dir), answer_tokens)
    if answer_tokens is not None:
        raise ValueError("answer_tokens: long canned answers need the no-model backend")
    return TransformersBackend(model_dir, profile_name)


async def start(server: OpenRouterLikeServer) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(server.app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, server.cfg.host, server.cfg.port, backlog=4096, reuse_address=True)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


def parse_args(argv: Sequence[str] | None) -> tuple[ServerConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="serve-openrouter", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8089, help="0 picks a free port (printed on the READY line)")
    p.add_argument("--model-dir", help="tiny target folder for the transformers backend")
    p.add_argument("--profile", default="deepseek")
    p.add_argument("--no-model", action="store_true", help="answer canned text after --delay-ms")
    p.add_argument("--delay-ms", type=float, default=50.0)
    p.add_argument("--answer-tokens", type=_positive_int, default=None, metavar="N",
                   help="no-model backend: long answers of about N tokens (reasoning + content with thinking), "
                        "one of a fixed set picked by the prompt, usage counted exactly")
    p.add_argument("--model-name", default="tiny/deepseek-tiny")
    p.add_argument("--providers", default="Alpha,Beta,Gamma")
    p.add_argument("--api-key-env", help="require the key held in this environment variable")
    p.add_argument("--padding", type=int, default=0, help="whitespace bytes before each JSON body")
    p.add_argument("--seed", type=int, default=0)
    for kind in RANDOM_FAULTS:
        p.add_argument(f"--fault-{kind}", type=float, default=0.0, help=f"rate of {kind} faults")
    p.add_argument("--retry-after", type=float, default=1.0, help="Retry-After seconds of a 429 sent as a status")
    p.add_argument("--no-retry-after", action="store_true", help="429s sent as a status carry no Retry-After")
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--miscount-provider", action="append", default=[])
    p.add_argument("--corrupt-provider", action="append", default=[])
    p.add_argument("--flaky-provider", action="append", default=[], help="NAME=RATE of 502s")
    p.add_argument("--credits", type=int, default=None,
                   help="account credit in completion tokens: a request whose max_tokens (absent: "
                        "--max-output-tokens) is more than what is left gets 402")
    p.add_argument("--max-output-tokens", type=_positive_int, default=16_384,
                   help="the model's most completion tokens: what a request without max_tokens asks for")
    p.add_argument("--prompt-price", type=float, default=0.0, help="USD per prompt token (usage.cost includes it)")
    p.add_argument("--bill-log", help="append one JSON line per billed generation to this file")
    p.add_argument("--known-models", default="",
                   help="comma-separated models with an endpoint; any other gets 404 (default: every model)")
    p.add_argument("--routing-status", type=int, choices=(404, 503), default=404,
                   help="the status when routing preferences leave no provider (OpenRouter sends either)")
    p.add_argument("--hold-file", help="while this file exists, chat requests wait unanswered (a stalled provider)")
    a = p.parse_args(argv)
    if a.answer_tokens is not None and a.model_dir and not a.no_model:
        p.error("--answer-tokens needs the no-model backend (--no-model, or no --model-dir)")
    rates = {k: getattr(a, "fault_" + k.replace("-", "_")) for k in RANDOM_FAULTS}
    flaky = {}
    for item in a.flaky_provider:
        name, _, rate = item.partition("=")
        flaky[name] = float(rate or 1.0)
    cfg = ServerConfig(host=a.host, port=a.port, model_name=a.model_name,
                       providers=tuple(x for x in a.providers.split(",") if x), api_key_env=a.api_key_env,
                       padding=a.padding, seed=a.seed, rates={k: v for k, v in rates.items() if v},
                       retry_after_s=None if a.no_retry_after else a.retry_after, timeout_s=a.timeout_s,
                       miscount_providers=tuple(a.miscount_provider), corrupt_providers=tuple(a.corrupt_provider),
                       flaky_providers=flaky, credits_tokens=a.credits, max_output_tokens=a.max_output_tokens,
                       known_models=tuple(x for x in a.known_models.split(",") if x),
                       prompt_price_per_token=a.prompt_price, bill_log=a.bill_log,
                       hold_file=a.hold_file, routing_status=a.routing_status)
    return cfg, a


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; prints ``READY http://HOST:PORT/api/v1`` once listening."""
    cfg, a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _raise_fd_limit()
    backend = make_backend(a.model_dir, a.profile, a.delay_ms, a.no_model, a.answer_tokens)
    server = OpenRouterLikeServer(cfg, backend)

    async def serve() -> None:
        runner, port = await start(server)
        print(f"READY http://{cfg.host}:{port}/api/v1", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping; counts %s", json.dumps(server.counts, sort_keys=True))
        await runner.cleanup()

    asyncio.run(serve())
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {value}")
    return value


def _raise_fd_limit() -> None:
    """Thousands of concurrent connections need thousands of descriptors."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


if __name__ == "__main__":
    raise SystemExit(main())
