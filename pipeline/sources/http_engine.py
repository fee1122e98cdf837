"""The asyncio side of the HTTP source: one aiohttp session, many prompts in flight.

Every prompt ends as exactly one output row whose ``status`` is "ok" (a
sample), "quarantined" (retries exhausted or a non-retryable error; ``error``
holds the last one) or "not_generated" (its dataset's budget is spent; the row
is resumable). The wire rules live in http_wire; this module only sequences
them: reserve budget, post, interpret, rebuild ids, settle, retry.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from pipeline.config import SamplingConfig
from pipeline.ledger import Outcome
from pipeline.profiles.base import Profile
from pipeline.reconstruct import rebuild_ids
from pipeline.records import empty_sample
from pipeline.sources.http_config import OpenRouterSourceConfig
from pipeline.sources.http_ledger_client import LedgerClient
from pipeline.sources.http_wire import (
    Failure,
    Reply,
    RequestOptions,
    backoff_s,
    billing_drift,
    build_request,
    drift_exceeds,
    dumps,
    interpret,
    loads,
    redact,
)

log = logging.getLogger(__name__)

OK, QUARANTINED, NOT_GENERATED = "ok", "quarantined", "not_generated"


class Secret:
    """A string that never shows itself in repr, str, logs or pickled error messages."""

    __slots__ = ("_value",)

    def __init__(self, value: str | None) -> None:
        self._value = value or ""

    def get(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret([REDACTED])"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("Secret is not serializable: read the key from the environment where it is used")


def request_options(cfg: OpenRouterSourceConfig, sampling: SamplingConfig) -> RequestOptions:
    s = cfg.sampling or sampling
    return RequestOptions(
        model=cfg.model, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
        reasoning=cfg.reasoning, reasoning_style=cfg.reasoning_style,
        provider=cfg.provider.wire() if cfg.provider else None, send_tools=cfg.send_tools,
        extra=cfg.extra_body,
    )


@dataclass
class _Attempt:
    reply: Reply | None
    failure: Failure | None
    seconds: float
    output_ids: list[int] | None = None
    truncated: bool = False


class HttpEngine:
    """Generates samples for prompt rows over HTTP; owns its aiohttp session (one per event loop)."""

    def __init__(self, cfg: OpenRouterSourceConfig, profile: Profile, ledger: LedgerClient, api_key: Secret, *,
                 sampling: SamplingConfig | None = None, source_name: str | None = None,
                 rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.profile = profile
        self.ledger = ledger
        self._key = api_key
        self.opts = request_options(cfg, sampling or SamplingConfig())
        self.source_name = source_name or cfg.name
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        self.rng = rng or random.Random()
        self.sampling_json = json.dumps(self.opts.sampling(), sort_keys=True)
        self._constant_fields = {"source": self.source_name, "source_kind": "openrouter", "model": cfg.model,
                                 "ids_from": "rebuilt", "sampling": self.sampling_json, "generation_id": ""}
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        self._exhausted: set[str] = set()
        self._auto_seen: tuple[str, ...] | None = None
        self._exclude_list: list[str] = list(cfg.exclude_providers)
        self.stats = {"requests": 0, "retries": 0, OK: 0, QUARANTINED: 0, NOT_GENERATED: 0}

    # -- session ------------------------------------------------------------
    async def _ensure_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.cfg.max_in_flight, limit_per_host=0,
                                             keepalive_timeout=self.cfg.keepalive_s, ttl_dns_cache=300)
            headers = {"Content-Type": "application/json", **self.cfg.headers}
            if self._key.get():
                headers["Authorization"] = "Bearer " + self._key.get()
            timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s, sock_connect=self.cfg.connect_timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout,
                                                  raise_for_status=False)
            self._loop = loop
            self._slots = asyncio.Semaphore(self.cfg.max_in_flight)
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    # -- rows ---------------------------------------------------------------
    async def run_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One output row per input row, in input order."""
        await self._ensure_session()
        return list(await asyncio.gather(*(self.generate(r) for r in rows)))

    async def generate(self, row: dict[str, Any]) -> dict[str, Any]:
        """Take one prompt to a sample, a quarantine row or a not-generated row; never raises for the API's faults."""
        session = await self._ensure_session()
        assert self._slots is not None
        dataset = str(row["dataset"])
        messages = loads(row["messages"]) if isinstance(row["messages"], str) else row["messages"]
        tools_raw = row.get("tools") or ""
        tools = loads(tools_raw) if isinstance(tools_raw, str) and tools_raw else (tools_raw or None)
        thinking = bool(row.get("thinking"))
        last: Failure | None = None
        attempts = 0
        wait_s = self.cfg.budget_poll_s
        while attempts < self.cfg.max_attempts:
            if dataset in self._exhausted:
                return self._not_generated(row, attempts, last)
            attempt: _Attempt | None = None
            async with self._slots:
                decision = await self.ledger.reserve(dataset, self.opts.max_tokens)
                if decision == "granted":
                    attempts += 1
                    attempt = await self._attempt(session, messages, tools, thinking, dataset)
            if decision == "exhausted":
                self._exhausted.add(dataset)
                return self._not_generated(row, attempts, last)
            if attempt is None:  # "wait": in-flight requests hold the rest of the budget
                await asyncio.sleep(wait_s * (0.5 + self.rng.random()))
                wait_s = min(wait_s * 2, 2.0)
                continue
            if attempt.reply is not None:
                return self._sample(row, attempt, attempts, thinking)
            last = attempt.failure
            assert last is not None
            if not last.retryable or attempts >= self.cfg.max_attempts:
                break
            self.stats["retries"] += 1
            await asyncio.sleep(backoff_s(attempts - 1, self.rng, base=self.cfg.backoff_base_s,
                                          cap=self.cfg.backoff_max_s, retry_after=last.retry_after,
                                          max_retry_after=self.cfg.max_retry_after_s))
        return self._quarantined(row, attempts, last)

    async def _attempt(self, session: aiohttp.ClientSession, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None, thinking: bool, dataset: str) -> _Attempt:
        """One request under a granted reservation; settles or releases it exactly once."""
        reserved = self.opts.max_tokens
        body = build_request(messages, tools, thinking, self.opts, self._excluded())
        self.stats["requests"] += 1
        t0 = time.perf_counter()
        try:
            async with session.post(self.url, data=dumps(body)) as resp:
                raw = await resp.read()
                result = interpret(resp.status, raw, resp.headers.get("Retry-After"))
        except TimeoutError:
            result = Failure("timeout", f"no complete answer within {self.cfg.request_timeout_s:g}s", True)
        except aiohttp.ClientError as e:
            result = Failure("network", f"{type(e).__name__}: {e}", True)
        except BaseException:
            # Cancelled or a bug: the reservation must not leak either way.
            asyncio.get_running_loop().create_task(self.ledger.release(dataset, reserved, "", "neutral"))
            raise
        seconds = time.perf_counter() - t0
        if isinstance(result, Failure):
            outcome: Outcome = "error" if result.against_provider else "neutral"
            if result.billed > 0:
                await self.ledger.settle(dataset, reserved, result.billed, result.cost, result.provider, outcome, None)
            else:
                await self.ledger.release(dataset, reserved, result.provider, outcome)
            return _Attempt(None, result, seconds)
        return await self._finish(result, thinking, dataset, reserved, seconds)

    async def _finish(self, reply: Reply, thinking: bool, dataset: str, reserved: int, seconds: float) -> _Attempt:
        """Rebuild ids, judge the provider, and settle the reservation with what was billed."""
        billed = reply.billed
        # No usage at all: charge the whole reservation rather than risk under-counting spend.
        charge = billed if billed >= 0 else reserved
        completion = reply.completion
        try:
            rebuilt = rebuild_ids(self.profile, completion, thinking)
        except Exception as e:  # noqa: BLE001 - a response we cannot rebuild is that provider's fault
            await self.ledger.settle(dataset, reserved, charge, reply.cost, reply.provider, "invalid", None)
            return _Attempt(None, Failure("body", f"cannot rebuild ids: {type(e).__name__}: {e}", True,
                                          200, None, reply.provider), seconds)
        drift = billing_drift(len(rebuilt.ids), billed)
        # Only what a faithful deployment of the target cannot produce counts against the provider;
        # what the model itself may write (odd tool sections, loops) is the validation stage's business.
        forbidden = self.profile.forbidden_output_ids
        invalid = drift_exceeds(drift, billed, self.cfg.billing_abs_threshold, self.cfg.billing_rel_threshold) \
            or not forbidden.isdisjoint(rebuilt.ids)
        await self.ledger.settle(dataset, reserved, charge, reply.cost, reply.provider,
                                 "invalid" if invalid else "ok", drift)
        return _Attempt(reply, None, seconds, rebuilt.ids, rebuilt.truncated)

    def _excluded(self) -> list[str]:
        """Configured exclusions plus the ledger's automatic ones (recomputed only when those change)."""
        auto = self.ledger.excluded
        if auto is not self._auto_seen:
            fixed = self.cfg.exclude_providers
            self._auto_seen = auto
            self._exclude_list = list(fixed) + [p for p in auto if p not in fixed]
        return self._exclude_list

    # -- output rows ----------------------------------------------------------
    def _base(self, row: dict[str, Any], status: str, error: str, attempts: int) -> dict[str, Any]:
        out = empty_sample(row)
        out.update(self._constant_fields)
        out["status"], out["error"], out["attempts"] = status, error, attempts
        self.stats[status] += 1
        return out

    def _sample(self, row: dict[str, Any], att: _Attempt, attempts: int, thinking: bool) -> dict[str, Any]:
        reply = att.reply
        assert reply is not None
        c = reply.completion
        out = self._base(row, OK, "", attempts)
        out.update({
            "provider": reply.provider, "model": reply.model or self.cfg.model,
            "output_ids": att.output_ids, "truncated": att.truncated,
            "reasoning": c.reasoning, "content": c.content,
            "tool_calls": json.dumps(c.tool_calls, ensure_ascii=False) if c.tool_calls else "",
            "finish_reason": c.finish_reason, "billed_completion_tokens": reply.billed, "cost": reply.cost,
            "t_generate_s": att.seconds, "generation_id": reply.generation_id,
        })
        return out

    def _quarantined(self, row: dict[str, Any], attempts: int, last: Failure | None) -> dict[str, Any]:
        reason = self.redact(f"after {attempts} attempt(s): {last.describe()}" if last else "no attempt made")
        log.warning("quarantined %s: %s", row.get("sample_id"), reason)
        out = self._base(row, QUARANTINED, reason, attempts)
        if last is not None:
            out["provider"] = last.provider
        return out

    def _not_generated(self, row: dict[str, Any], attempts: int, last: Failure | None) -> dict[str, Any]:
        return self._base(row, NOT_GENERATED, f"completion-token budget of dataset {row['dataset']!r} is spent",
                          attempts)

    def redact(self, text: str) -> str:
        return redact(text, [self._key.get()])
