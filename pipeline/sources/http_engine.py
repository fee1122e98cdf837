"""The asyncio side of the HTTP source: one aiohttp session, many prompts in flight.

Every prompt ends as exactly one output row whose ``status`` is "ok" (a
sample), "quarantined" or "not_generated" (resumable: a re-run does it). The
failure classes decide which (``http_wire.Failure.failure_class``):

- ``sample`` (a 400 on this prompt, a context too long): it would fail again,
  so the row is quarantined with the error.
- ``transient`` (network, timeouts, 408/429/5xx, cut bodies, in-band provider
  errors): retried with backoff; out of retries the row stays *not generated*
  with its attempts recorded (``gave_up`` in the response journal), and only
  after ``transient_runs`` runs that each gave up on it is it quarantined (by
  the driver, at read time). Many in a row open the circuit (http_circuit).
- ``account`` (401/402/403): the source halts at once, on every actor (through
  the shared ledger); its remaining rows stay not generated.

Money: a request that may have been billed (sent, then cut, timed out or
dropped) keeps its whole reservation as spent; every billed response is
journaled before its row moves on, and a resumed run replays journaled
responses instead of paying for them again. The wire rules live in http_wire;
this module only sequences them.
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

from pipeline.config import OpenRouterSourceConfig, SamplingConfig
from pipeline.ledger import Outcome
from pipeline.profiles.base import Completion, Profile
from pipeline.reconstruct import rebuild_ids
from pipeline.records import empty_sample
from pipeline.sources.http_circuit import Circuit
from pipeline.sources.http_journal import Record, ResponseJournal, request_digest
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
                 rng: random.Random | None = None, journal: ResponseJournal | None = None,
                 replay: dict[str, Record] | None = None) -> None:
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
        self.journal = journal
        self.replay = dict(replay or {})  # sample id -> a response journaled (paid) by an earlier attempt
        self._answered = False  # the API answered something other than a transient failure (it is up)
        self.circuit = Circuit(cfg.circuit_failures, cfg.circuit_cooldown_s, cfg.circuit_max_cooldown_s,
                               cfg.circuit_give_up_s)
        self.stats = {"requests": 0, "retries": 0, "replayed": 0, OK: 0, QUARANTINED: 0, NOT_GENERATED: 0}

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
        if self.journal is not None:
            self.journal.flush()

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
        digest = request_digest(build_request(messages, tools, thinking, self.opts))
        replayed = self._replay(row, digest, thinking)
        if replayed is not None:
            return replayed
        last: Failure | None = None
        attempts = 0
        wait_s = self.cfg.budget_poll_s
        while attempts < self.cfg.max_attempts:
            if self.ledger.halted:
                return self._not_generated(row, attempts, f"source {self.source_name!r} halted: {self.ledger.halted}",
                                           "account")
            if dataset in self._exhausted:
                return self._not_generated(row, attempts, self._budget_spent(dataset), "budget")
            gate = self.circuit.admit(time.monotonic())
            if gate == "give_up":
                return self._gave_up(row, attempts, self.circuit.describe(time.monotonic()), digest)
            if gate == "wait":  # the API is down: wait without spending attempts or budget
                await asyncio.sleep(self.circuit.wait_s(time.monotonic()))
                continue
            attempt: _Attempt | None = None
            async with self._slots:
                decision = await self.ledger.reserve(dataset, self.opts.max_tokens)
                if decision == "granted":
                    attempts += 1
                    attempt = await self._attempt(session, messages, tools, thinking, row, digest, attempts)
            if decision == "halted":
                continue  # the loop top returns it not generated, with the ledger's reason
            if decision == "exhausted":
                self._exhausted.add(dataset)
                continue
            if attempt is None:  # "wait": in-flight requests hold the rest of the budget
                await asyncio.sleep(wait_s * (0.5 + self.rng.random()))
                wait_s = min(wait_s * 2, 2.0)
                continue
            if attempt.reply is not None:
                self.circuit.record(True, time.monotonic())
                self._answered = True
                return self._sample(row, attempt, attempts, thinking)
            last = attempt.failure
            assert last is not None
            cls = last.failure_class
            self.circuit.record(cls != "transient", time.monotonic(), self.redact(last.describe()))
            self._answered |= cls != "transient"
            if cls == "account":
                reason = self.redact(f"{_account_problem(last.status)} ({last.describe()})")
                await self.ledger.halt(reason)
                log.error("source %r stops sending: %s", self.source_name, reason)
                return self._not_generated(row, attempts, f"source {self.source_name!r} halted: {reason}", "account")
            if cls == "sample":
                return self._quarantined(row, attempts, last)
            if attempts >= self.cfg.max_attempts:
                break
            self.stats["retries"] += 1
            log.debug("retrying %s after attempt %d: %s", row.get("sample_id"), attempts, self.redact(last.describe()))
            await asyncio.sleep(backoff_s(attempts - 1, self.rng, base=self.cfg.backoff_base_s,
                                          cap=self.cfg.backoff_max_s, retry_after=last.retry_after,
                                          max_retry_after=self.cfg.max_retry_after_s))
        reason = f"transient failures, {attempts} attempt(s): {last.describe()}" if last else "no attempt made"
        return self._gave_up(row, attempts, self.redact(reason), digest)

    async def _attempt(self, session: aiohttp.ClientSession, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None, thinking: bool, row: dict[str, Any], digest: str,
                       attempts: int) -> _Attempt:
        """One request under a granted reservation; settles or releases it exactly once."""
        dataset = str(row["dataset"])
        reserved = self.opts.max_tokens
        body = build_request(messages, tools, thinking, self.opts, self._excluded())
        self.stats["requests"] += 1
        t0 = time.perf_counter()
        try:
            async with session.post(self.url, data=dumps(body)) as resp:
                raw = await resp.read()
                result = interpret(resp.status, raw, resp.headers.get("Retry-After"))
        except TimeoutError:
            result = Failure("timeout", f"no complete answer within {self.cfg.request_timeout_s:g}s", True,
                             maybe_billed=True)
        except aiohttp.ClientConnectorError as e:  # never reached the server: nothing can have been billed
            result = Failure("network", f"{type(e).__name__}: {e}", True)
        except aiohttp.ClientError as e:  # dropped after sending: the provider may have finished and billed it
            result = Failure("network", f"{type(e).__name__}: {e}", True, maybe_billed=True)
        except BaseException:
            # Cancelled (the actor is going away) or a bug: the request may have been billed, so the reservation
            # stays spent; settling it keeps the ledger's arithmetic whole.
            asyncio.get_running_loop().create_task(
                self.ledger.settle(dataset, reserved, reserved, 0.0, "", "neutral", None))
            raise
        seconds = time.perf_counter() - t0
        if isinstance(result, Failure):
            outcome: Outcome = "error" if result.against_provider else "neutral"
            if result.billed > 0 or result.maybe_billed:
                # The budget caps what the provider bills: an unknown bill counts as the whole reservation.
                charge = max(result.billed, reserved if result.maybe_billed else 0)
                await self.ledger.settle(dataset, reserved, charge, result.cost, result.provider, outcome, None)
                self._journal(row, digest, "billed_failure", attempts, billed=result.billed, charged=charge,
                              cost=result.cost, provider=result.provider)
            else:
                await self.ledger.release(dataset, reserved, result.provider, outcome)
            return _Attempt(None, result, seconds)
        return await self._finish(result, thinking, row, digest, attempts, reserved, seconds)

    async def _finish(self, reply: Reply, thinking: bool, row: dict[str, Any], digest: str, attempts: int,
                      reserved: int, seconds: float) -> _Attempt:
        """Journal the paid reply, rebuild ids, judge the provider, and settle the reservation with the bill."""
        dataset = str(row["dataset"])
        billed = reply.billed
        # No usage at all: charge the whole reservation rather than risk under-counting spend.
        charge = billed if billed >= 0 else reserved
        self._journal(row, digest, "response", attempts, billed=billed, charged=charge, cost=reply.cost,
                      provider=reply.provider, reply=reply, seconds=seconds)
        attempt, outcome, drift = self._rebuild(reply, thinking, seconds)
        await self.ledger.settle(dataset, reserved, charge, reply.cost, reply.provider, outcome, drift)
        return attempt

    def _rebuild(self, reply: Reply, thinking: bool, seconds: float) -> tuple[_Attempt, Outcome, int | None]:
        """Exact ids from a reply's text, and how the reply reflects on its provider."""
        try:
            rebuilt = rebuild_ids(self.profile, reply.completion, thinking)
        except Exception as e:  # noqa: BLE001 - a response we cannot rebuild is that provider's fault
            failure = Failure("body", f"cannot rebuild ids: {type(e).__name__}: {e}", True, 200, None, reply.provider)
            return _Attempt(None, failure, seconds), "invalid", None
        drift = billing_drift(len(rebuilt.ids), reply.billed)
        # Only what a faithful deployment of the target cannot produce counts against the provider;
        # what the model itself may write (odd tool sections, loops) is the validation stage's business.
        forbidden = self.profile.forbidden_output_ids
        invalid = drift_exceeds(drift, reply.billed, self.cfg.billing_abs_threshold, self.cfg.billing_rel_threshold) \
            or not forbidden.isdisjoint(rebuilt.ids)
        return _Attempt(reply, None, seconds, rebuilt.ids, rebuilt.truncated), "invalid" if invalid else "ok", drift

    def _replay(self, row: dict[str, Any], digest: str, thinking: bool) -> dict[str, Any] | None:
        """The sample of a response an earlier, killed attempt paid for, when the request would be the same."""
        rec = self.replay.pop(str(row["sample_id"]), None)
        if rec is None or rec.request_digest != digest or rec.source != self.source_name:
            return None
        completion = Completion(rec.reasoning, rec.content, rec.tool_calls, rec.finish_reason or "stop",
                                rec.billed_completion_tokens if rec.billed_completion_tokens >= 0 else None)
        reply = Reply(completion, rec.generation_id, rec.provider, rec.model, rec.billed_completion_tokens,
                      rec.cost, rec.native_finish_reason)
        attempt, _, _ = self._rebuild(reply, thinking, rec.t_generate_s)
        if attempt.reply is None:
            return None  # it did not rebuild then either: ask again
        self.stats["replayed"] += 1
        return self._sample(row, attempt, rec.attempts, thinking)

    def _journal(self, row: dict[str, Any], digest: str, kind: str, attempts: int, *, billed: int = 0,
                 charged: int | None = None, cost: float = 0.0, provider: str = "", reply: Reply | None = None,
                 seconds: float = 0.0, error: str = "") -> None:
        if self.journal is None:
            return
        rec = Record(sample_id=str(row["sample_id"]), dataset=str(row["dataset"]), source=self.source_name,
                     model=self.cfg.model, sampling=self.sampling_json, request_digest=digest, kind=kind,
                     provider=provider, billed_completion_tokens=billed, charged_tokens=charged, cost=cost,
                     t_generate_s=seconds, attempts=attempts, error=error)
        if reply is not None:
            c = reply.completion
            rec.reasoning, rec.content, rec.tool_calls = c.reasoning, c.content, c.tool_calls
            rec.finish_reason, rec.native_finish_reason = c.finish_reason, reply.native_finish_reason
            rec.generation_id, rec.model = reply.generation_id, reply.model or self.cfg.model
        self.journal.append(rec)

    def _excluded(self) -> list[str]:
        """Configured exclusions plus the ledger's automatic ones (recomputed only when those change)."""
        auto = self.ledger.excluded
        if auto is not self._auto_seen:
            fixed = self.cfg.exclude_providers
            self._auto_seen = auto
            self._exclude_list = list(fixed) + [p for p in auto if p not in fixed]
        return self._exclude_list

    # -- output rows ----------------------------------------------------------
    def _base(self, row: dict[str, Any], status: str, error: str, attempts: int,
              failure_class: str | None = None) -> dict[str, Any]:
        out = empty_sample(row)
        out.update(self._constant_fields)
        out["status"], out["error"], out["attempts"], out["failure_class"] = status, error, attempts, failure_class
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

    def _quarantined(self, row: dict[str, Any], attempts: int, last: Failure) -> dict[str, Any]:
        reason = self.redact(f"after {attempts} attempt(s): {last.describe()}")
        log.warning("quarantined %s: %s", row.get("sample_id"), reason)
        out = self._base(row, QUARANTINED, reason, attempts, last.failure_class)
        out["provider"] = last.provider
        return out

    def _not_generated(self, row: dict[str, Any], attempts: int, reason: str,
                       failure_class: str = "transient") -> dict[str, Any]:
        return self._base(row, NOT_GENERATED, reason, attempts, failure_class)

    def _gave_up(self, row: dict[str, Any], attempts: int, reason: str, digest: str) -> dict[str, Any]:
        """Transient failures outlasted this run's retries: left to do. The give-up is journaled (counted across
        runs: after ``transient_runs`` of them the driver quarantines the prompt) only when the API was
        answering other prompts meanwhile: an outage says nothing about this prompt."""
        if self._answered and not self.circuit.is_open:
            self._journal(row, digest, "gave_up", attempts, error=reason)
        return self._not_generated(row, attempts, reason)

    def _budget_spent(self, dataset: str) -> str:
        return f"completion-token budget of dataset {dataset!r} is spent"

    def redact(self, text: str) -> str:
        return redact(text, [self._key.get()])


def _account_problem(status: int | None) -> str:
    return {401: "the API key was refused (401)", 402: "out of credits (402)",
            403: "the key may not use this model or provider (403)"}.get(status or 0, f"account error ({status})")
