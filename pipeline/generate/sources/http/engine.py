"""The asyncio side of the HTTP source: one aiohttp session, many prompts in flight.

Every prompt ends as exactly one output row whose ``status`` is "ok" (a
sample), "quarantined" or "not_generated" (resumable: a re-run does it). The
failure classes decide which (``http_wire.Failure.failure_class``):

- ``sample`` (a 4xx on this prompt, a context too long, a moderation 403, an
  answer of a shape that would repeat): it would fail again, so the row is
  quarantined with the error.
- ``transient`` (network, timeouts, 408/429/5xx, cut bodies, in-band provider
  errors): retried with backoff; out of retries the row stays *not generated*
  with its attempts recorded (``gave_up`` in the response journal), and only
  after ``transient_runs`` runs that each gave up on it is it quarantined (by
  the driver, at read time). Many in a row open the circuit (http_circuit).
- ``account`` (401/402/403 but moderation): the source halts at once, on every actor (through
  the shared ledger); its remaining rows stay not generated.
- ``config``: the same 4xx answer (status and message) on ``config_error_prompts``
  distinct prompts in a row is the source's config (a typo'd model id, a bad
  ``extra_body``), not the prompts': the source halts and nothing is quarantined
  for it. A 4xx is judged only once the next answer says which it is: a success
  or another answer proves the prompt's own fault (quarantine); with no verdict
  within ``config_error_wait_s`` the row stays to do.
- ``budget``: the dataset's budget is spent, or in-flight reservations held the
  rest of it for ``budget_wait_max_s`` (a dead actor's reservations lapse with
  its lease, see pipeline.generate.ledger).
- ``journal``: the response journaled (paid) for this very request cannot be
  read back (a field of the wrong type, named with the file and line; a counted
  one too, where the line's sample id still reads): the row stays not generated,
  never asked again on its own (``_replay``).

Every answer shape is an outcome: nothing a request meets fails or orphans its
siblings in the batch (``run_rows``). A journal that cannot be written halts the
source: paid responses never pile up in memory only.

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
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from pipeline.base.config import SamplingConfig
from pipeline.base.records import empty_sample
from pipeline.checks.reconstruct import rebuild_ids
from pipeline.generate.ledger import Outcome
from pipeline.generate.sources.http.circuit import Circuit
from pipeline.generate.sources.http.config import OpenRouterSourceConfig, is_loopback_host
from pipeline.generate.sources.http.journal import JournalError, Record, ResponseJournal, request_digest
from pipeline.generate.sources.http.ledger_client import LedgerClient
from pipeline.generate.sources.http.replay import ReplayIndex, Unreadable, replay_source
from pipeline.generate.sources.http.wire import (
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
from pipeline.profiles.base import Completion, Profile

log = logging.getLogger(__name__)

OK, QUARANTINED, NOT_GENERATED = "ok", "quarantined", "not_generated"
CONFIG_ERROR = "config error"  # how a config halt's reason starts (its rows' failure class is "config")


def chat_completions_url(base_url: str) -> str:
    """``{base_url}/chat/completions``, appended to the path: a query (a gateway's ``?api-version=...``) stays a
    query, after it, and a fragment (never sent) is dropped."""
    parts = urlsplit(base_url)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/chat/completions", fragment=""))


def key_may_go_to(url: str) -> bool:
    """Whether an Authorization header may be sent to ``url``: https, or plain http to a loopback host only."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return False
    if parts.scheme == "https":
        return bool(host)
    return parts.scheme == "http" and is_loopback_host(host)


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


def prompt_tokens(row: dict[str, Any]) -> int:
    """An upper bound of the prompt tokens a provider bills for this row, for its request's reservation."""
    ids = row.get("prompt_ids")
    if ids is not None and len(ids):
        return len(ids) + 16  # the provider's template may add a few tokens
    text = row.get("messages")
    return (len(text) if isinstance(text, str) else len(json.dumps(text or ""))) // 2 + 16


PRICE_HEADROOM = 1.5  # a learnt price is reserved (and capped with max_price) at this much over the dearest seen


def price_rates(prices: Any, bounds: tuple[float, float] | list[float]) -> tuple[float, float] | None:
    """Dollars per prompt token and per completion token that a dollar reservation assumes (and, where the
    endpoint takes it, ``provider.max_price`` holds every provider to): configured ``prices`` (per million
    tokens), else ``PRICE_HEADROOM`` times ``bounds`` (the dearest dollars seen per prompt token and per
    completion token); None while no price is known."""
    if prices is not None:
        return prices.prompt_usd_per_mtok / 1e6, prices.completion_usd_per_mtok / 1e6
    p, c = bounds
    if p > 0 and c > 0:
        return p * PRICE_HEADROOM, c * PRICE_HEADROOM
    return None


def usd_ask(n_prompt: int, max_tokens: int, prices: Any, bounds: tuple[float, float] | list[float]) -> float:
    """The most one request can cost, as reserved ahead, at ``price_rates``; NaN when no price is known."""
    rates = price_rates(prices, bounds)
    return math.nan if rates is None else n_prompt * rates[0] + max_tokens * rates[1]


def max_price(rates: tuple[float, float], own: Mapping[str, Any] | None) -> dict[str, float]:
    """OpenRouter's ``provider.max_price`` (dollars per million tokens) at a reservation's rates, lowered to
    the config's own ``max_price`` where that is lower: no provider dearer than the reservation assumed may
    serve the request, so the bill cannot pass it."""
    out = {"prompt": rates[0] * 1e6, "completion": rates[1] * 1e6}
    for key, value in (own or {}).items():
        try:
            out[key] = min(out[key], float(value)) if key in out else value
        except (TypeError, ValueError):
            out[key] = value
    return out


@dataclass
class _Attempt:
    reply: Reply | None
    failure: Failure | None
    seconds: float
    output_ids: list[int] | None = None
    truncated: bool = False
    doubt: str = ""  # what the text and bill do not pin down (``Rebuilt.doubt``): the rebuild check (quarantine)


class HttpEngine:
    """Generates samples for prompt rows over HTTP; owns its aiohttp session (one per event loop)."""

    def __init__(self, cfg: OpenRouterSourceConfig, profile: Profile, ledger: LedgerClient, api_key: Secret, *,
                 sampling: SamplingConfig | None = None, source_name: str | None = None,
                 rng: random.Random | None = None, journal: ResponseJournal | None = None,
                 replay: ReplayIndex | dict[str, Record] | None = None) -> None:
        self.cfg = cfg
        self.profile = profile
        self.ledger = ledger
        self._key = api_key
        self.opts = request_options(cfg, sampling or SamplingConfig())
        self.source_name = source_name or cfg.name
        self.url = chat_completions_url(cfg.base_url)
        self.identity = cfg.identity()
        if api_key.get() and not key_may_go_to(self.url):
            raise ValueError(f"source {self.source_name!r}: refusing to send an API key to {cfg.base_url} "
                             "(plain http off loopback)")
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
        # sample id -> a response journaled (paid) by this run's other actors or an earlier run
        self.replay = replay_source(replay)
        self._journal_failed: str | None = None
        self._streak_sig: str | None = None  # the 4xx answer the prompts in _streak got
        self._streak: dict[str, asyncio.Future] = {}
        self._config_failure: Failure | None = None
        self._config_reason = ""
        self._usd_bounds = [0.0, 0.0]  # the dearest price seen per prompt token and per completion token
        self._answered = False  # the API answered something other than a transient failure (it is up)
        self._answers = 0  # answers with a completion so far
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
        """Close this session (and flush the journal, its projection kept). The session is let go before the
        await: a batch that starts while it closes opens its own, which a later ``self._session = None`` would
        have orphaned with its open connections (aiohttp's "Unclosed client session", seen on the scale bench)."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()
        self.flush(projection=True)

    def flush(self, projection: bool = False) -> None:
        """Write the journal's buffered records out (an idle actor's, so a kill loses none it was billed for);
        with ``projection``, also keep its projection for the next resume and ``status`` (``totals``)."""
        if self.journal is not None:
            try:
                self.journal.flush()
                if projection:
                    self.journal.store_projection()
            except JournalError as e:  # already a halt (the append that failed said so); closing must not fail
                log.error("source %r: %s", self.source_name, self.redact(str(e)))

    # -- rows ---------------------------------------------------------------
    async def run_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One output row per input row, in input order. A row whose handling raised (a bug: the API's faults
        are outcomes) is left to do with the error; it never fails or orphans the other rows of the batch."""
        await self._ensure_session()
        # responses other actors journaled since (a batch retried after its actor died); off the event loop
        await asyncio.to_thread(self.replay.refresh)
        results = await asyncio.gather(*(self.generate(r) for r in rows), return_exceptions=True)
        out = []
        for row, res in zip(rows, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res  # cancelled: the actor is going away
                log.error("internal error on %s (left to do)", row.get("sample_id"), exc_info=res)
                res = self._not_generated(row, 0, self.redact(f"internal error: {type(res).__name__}: {res}"))
            out.append(res)
        return out

    async def generate(self, row: dict[str, Any]) -> dict[str, Any]:
        """Take one prompt to a sample, a quarantine row or a not-generated row; never raises for the API's faults."""
        session = await self._ensure_session()
        assert self._slots is not None
        dataset = str(row["dataset"])
        thinking = bool(row.get("thinking"))
        try:  # a row no JSON reader takes back (NaN, 1e400) fails the same way on every run: its own fault
            messages = loads(row["messages"]) if isinstance(row["messages"], str) else row["messages"]
            tools_raw = row.get("tools") or ""
            tools = loads(tools_raw) if isinstance(tools_raw, str) and tools_raw else (tools_raw or None)
            body = build_request(messages, tools, thinking, self.opts)
            digest = request_digest(body)
            # what ``_attempt`` sends: a body orjson cannot write (nested past its 254 levels) fails here, unsent
            # and its own fault, not as an internal error that leaves it to do on every run
            dumps(body)
        except (ValueError, TypeError, RecursionError) as e:
            return self._unsendable(row, e)
        replayed = self._replay(row, digest, thinking)
        if replayed is not None:
            return replayed
        last: Failure | None = None
        attempts = 0
        answered_before = self._answers  # another prompt answered while this one fails: the API takes the config
        wait_s = self.cfg.budget_poll_s
        waited = 0.0
        while attempts < self.cfg.max_attempts:
            if self._journal_failed is not None and not self.ledger.halted:
                await self.ledger.halt(self._journal_failed)
            if self.ledger.halted or self._config_reason:
                return self._halted_row(row, attempts)
            if dataset in self._exhausted:
                return self._not_generated(row, attempts, self._budget_spent(dataset), "budget")
            gate = self.circuit.admit(time.monotonic())
            if gate == "give_up":
                return self._gave_up(row, attempts, self.circuit.describe(time.monotonic()), digest)
            if gate == "wait":  # the API is down: wait without spending attempts or budget
                await asyncio.sleep(self.circuit.wait_s(time.monotonic()))
                continue
            attempt: _Attempt | None = None
            rates = price_rates(self.cfg.prices, self._usd_bounds)  # anew each time: it may have been learnt
            usd = usd_ask(self._prompt_tokens(row), self.opts.max_tokens, self.cfg.prices, self._usd_bounds)
            async with self._slots:
                if self._journal_failed is not None:  # checked again here: rows queue for a slot meanwhile
                    await self.ledger.halt(self._journal_failed)
                decision = await self.ledger.reserve(dataset, self.opts.max_tokens, usd)
                if decision == "granted":
                    attempts += 1
                    cap = rates if rates is not None and self._guards_price(dataset) else None
                    attempt = await self._attempt(session, messages, tools, thinking, row, digest, attempts, usd,
                                                  cap)
                    if self._journal_failed is not None:
                        await self.ledger.halt(self._journal_failed)
            if attempt is None:
                self.circuit.unsent()  # a probe the circuit admitted that never went out: the next one may
            if decision == "halted":
                continue  # the loop top returns it not generated, with the ledger's reason
            if decision == "exhausted":
                self._exhausted.add(dataset)
                continue
            if attempt is None:  # "wait": in-flight requests hold the rest of the budget
                if waited >= self.cfg.budget_wait_max_s:
                    return self._not_generated(row, attempts, f"the rest of dataset {dataset!r}'s budget stayed held "
                                               f"by requests in flight for {waited:.0f}s", "budget")
                pause = wait_s * (0.5 + self.rng.random())
                await asyncio.sleep(pause)
                waited += pause
                wait_s = min(wait_s * 2, 2.0)
                continue
            if attempt.reply is not None:
                self.circuit.record(True, time.monotonic())
                self._answered = True
                self._answers += 1
                self._end_streak("prompt")
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
            if cls == "sample" and last.retry_first and attempts < self.cfg.max_attempts:
                pass  # retried below: only the same answer on every attempt is the prompt's or the config's
            elif cls == "sample":
                signature = last.signature
                if signature is None:
                    self._end_streak("prompt")  # another answer: 4xx prompts waiting were their own fault
                    return self._quarantined(row, attempts, last)
                if last.retry_first and self._answers > answered_before:  # the same each time, others answered
                    return self._quarantined(row, attempts, last)
                verdict = await self._judge_4xx(str(row["sample_id"]), signature, last)
                if verdict == "prompt":
                    return self._quarantined(row, attempts, last)
                if verdict == "config":
                    return self._halted_row(row, attempts)
                return self._gave_up(row, attempts, self.redact(
                    f"{last.describe()}; left to do: fewer than {self.cfg.config_error_prompts} prompts got this "
                    f"answer in a row within {self.cfg.config_error_wait_s:g}s, so it may be the config's"), digest)
            if attempts >= self.cfg.max_attempts:
                break
            self.stats["retries"] += 1
            log.debug("retrying %s after attempt %d: %s", row.get("sample_id"), attempts, self.redact(last.describe()))
            await asyncio.sleep(backoff_s(attempts - 1, self.rng, base=self.cfg.backoff_base_s,
                                          cap=self.cfg.backoff_max_s, retry_after=last.retry_after,
                                          max_retry_after=self.cfg.max_retry_after_s))
        reason = f"transient failures, {attempts} attempt(s): {last.describe()}" if last else "no attempt made"
        return self._gave_up(row, attempts, self.redact(reason), digest)

    # -- config errors ----------------------------------------------------------
    async def _judge_4xx(self, sample_id: str, signature: str, failure: Failure) -> str:
        """Whether a 4xx is this prompt's ("prompt"), the config's ("config") or undecided ("unsure").

        The same answer on ``config_error_prompts`` distinct prompts in a row is the config's; any other
        answer in between (a success, another error) shows the API takes this config, so the prompts waiting
        were at fault themselves. Once the config is known to be wrong, any other 4xx stays undecided."""
        if self._config_failure is not None:
            return "config" if signature == self._config_failure.signature else "unsure"
        if signature != self._streak_sig:
            self._end_streak("prompt")
            self._streak_sig = signature
        fut = asyncio.get_running_loop().create_future()
        self._streak[sample_id] = fut
        if len(self._streak) >= self.cfg.config_error_prompts:
            # decided here, before any await: an answer landing meanwhile must not turn them into "prompt"
            self._config_failure = failure
            self._config_reason = self.redact(
                f"{CONFIG_ERROR}: {failure.describe()} (the same answer on {len(self._streak)} prompts in a row; "
                "fix the source's model, provider or extra_body and re-run)")
            self._end_streak("config")
            log.error("source %r stops sending: %s", self.source_name, self._config_reason)
            await self.ledger.halt(self._config_reason)
            return "config"
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout=self.cfg.config_error_wait_s)
        except TimeoutError:
            if self._streak.get(sample_id) is fut:
                del self._streak[sample_id]
            return fut.result() if fut.done() else "unsure"

    def _end_streak(self, verdict: str) -> None:
        for fut in self._streak.values():
            if not fut.done():
                fut.set_result(verdict)
        self._streak = {}
        if self._config_failure is None:
            self._streak_sig = None

    def _halted_row(self, row: dict[str, Any], attempts: int) -> dict[str, Any]:
        reason = self._config_reason or self.ledger.halted or "halted"
        cls = "config" if reason.startswith(CONFIG_ERROR) else "account"
        return self._not_generated(row, attempts, f"source {self.source_name!r} halted: {reason}", cls)

    # -- dollars ------------------------------------------------------------------
    def _guards_price(self, dataset: str) -> bool:
        """Whether this dataset's requests carry ``provider.max_price``: a dollar cap, and an endpoint that takes
        OpenRouter's provider object (``cfg.max_price_guard``)."""
        return self.cfg.usd_budget(dataset) is not None and self.cfg.guards_price()

    @staticmethod
    def _prompt_tokens(row: dict[str, Any]) -> int:
        return prompt_tokens(row)

    def _learn_price(self, reply: Reply, cost: float | None) -> None:
        if cost is None or cost <= 0:
            return
        if reply.prompt_tokens > 0:
            self._usd_bounds[0] = max(self._usd_bounds[0], cost / reply.prompt_tokens)
        if reply.billed > 0:
            self._usd_bounds[1] = max(self._usd_bounds[1], cost / reply.billed)

    async def _attempt(self, session: aiohttp.ClientSession, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None, thinking: bool, row: dict[str, Any], digest: str,
                       attempts: int, usd: float = 0.0, cap: tuple[float, float] | None = None) -> _Attempt:
        """One request under a granted reservation; settles or releases it exactly once. ``cap``: the rates
        the reservation assumed, sent as ``provider.max_price``."""
        dataset = str(row["dataset"])
        reserved = self.opts.max_tokens
        body = build_request(messages, tools, thinking, self.opts, self._excluded())
        if cap is not None:
            provider = dict(body.get("provider") or {})
            provider["max_price"] = max_price(cap, provider.get("max_price"))
            body["provider"] = provider
        self.stats["requests"] += 1
        t0 = time.perf_counter()
        try:
            async with session.post(self.url, data=dumps(body)) as resp:
                raw = await resp.read()
                result = _interpret(resp.status, raw, resp.headers.get("Retry-After"), self._key.get())
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
                self.ledger.settle(dataset, reserved, reserved, None, "", "neutral", None, usd))
            raise
        seconds = time.perf_counter() - t0
        if isinstance(result, Failure):
            outcome: Outcome = "error" if result.against_provider else "neutral"
            if result.billed > 0 or result.maybe_billed or result.cost > 0:
                # The budget caps what the provider bills: an unknown bill counts as the whole reservation.
                charge = max(result.billed, reserved if result.maybe_billed else 0)
                cost = result.cost if not result.maybe_billed and result.cost else None
                await self.ledger.settle(dataset, reserved, charge, cost, result.provider, outcome, None, usd)
                self._journal(row, digest, "billed_failure", attempts, billed=result.billed, charged=charge,
                              cost=result.cost, provider=result.provider)
            else:
                await self.ledger.release(dataset, reserved, result.provider, outcome, usd)
            return _Attempt(None, result, seconds)
        return await self._finish(result, thinking, row, digest, attempts, reserved, seconds, usd)

    async def _finish(self, reply: Reply, thinking: bool, row: dict[str, Any], digest: str, attempts: int,
                      reserved: int, seconds: float, usd: float = 0.0) -> _Attempt:
        """Journal the paid reply, rebuild ids, judge the provider, and settle the reservation with the bill."""
        dataset = str(row["dataset"])
        billed = reply.billed
        # No usage at all: charge the whole reservation rather than risk under-counting spend.
        charge = billed if billed >= 0 else reserved
        self._journal(row, digest, "response", attempts, billed=billed, charged=charge, cost=reply.cost,
                      provider=reply.provider, reply=reply, seconds=seconds)
        attempt, outcome, drift = self._rebuild(reply, thinking, seconds)
        cost = reply.cost if reply.cost_known else None
        self._learn_price(reply, cost)
        await self.ledger.settle(dataset, reserved, charge, cost, reply.provider, outcome, drift, usd)
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
        return (_Attempt(reply, None, seconds, rebuilt.ids, rebuilt.truncated, rebuilt.doubt or ""),
                "invalid" if invalid else "ok", drift)

    def _replay(self, row: dict[str, Any], digest: str, thinking: bool) -> dict[str, Any] | None:
        """The sample of a response an earlier, killed attempt paid for, when the request would be the same. Its
        ``attempts`` is 0: no request was sent for it in this attempt (the report counts it apart, as replayed).

        A journaled response of this request that cannot be read back (``Unreadable``: a field of the wrong type,
        a replayed one or a counted one, as long as the line's sample id reads: ``replay.ReplayIndex``) is an
        outcome, never an exception that stops the resume. It was paid for (its bill is in the restored spend as
        far as it reads), so asking again would pay twice without a word. The row stays not generated, class
        ``journal``, its reason naming the file, the line and the field; repairing or deleting the line (a
        re-run then asks, and pays, again) is the user's call. A line in which not even the sample id reads holds
        no prompt: the index says so loudly (that prompt may be asked, and paid for, again)."""
        rec = self.replay.pop(str(row["sample_id"]), None)
        if isinstance(rec, Unreadable):
            if rec.request_digest not in (None, digest):
                return None  # the answer to another request (a changed prompt or setting): ask for this one
            reason = (f"its journaled response is unreadable ({rec.reason}); it was paid for, so it is not asked "
                      "again: repair or delete that line and re-run (deleted, the prompt is asked and paid for again)")
            return self._not_generated(row, 0, self.redact(reason), "journal")
        same_source = rec is not None and (rec.source == self.source_name
                                           or bool(rec.identity) and rec.identity == self.identity)
        if rec is None or rec.request_digest != digest or not same_source:
            return None
        completion = Completion(rec.reasoning, rec.content, rec.tool_calls, rec.finish_reason or "stop",
                                rec.billed_completion_tokens if rec.billed_completion_tokens >= 0 else None)
        reply = Reply(completion, rec.generation_id, rec.provider, rec.model, rec.billed_completion_tokens,
                      rec.cost, rec.native_finish_reason)
        attempt, _, _ = self._rebuild(reply, thinking, rec.t_generate_s)
        if attempt.reply is None:
            return None  # it did not rebuild then either: ask again
        self.stats["replayed"] += 1
        return self._sample(row, attempt, 0, thinking)

    def _journal(self, row: dict[str, Any], digest: str, kind: str, attempts: int, *, billed: int = 0,
                 charged: int | None = None, cost: float = 0.0, provider: str = "", reply: Reply | None = None,
                 seconds: float = 0.0, error: str = "") -> None:
        if self.journal is None:
            return
        rec = Record(sample_id=str(row["sample_id"]), dataset=str(row["dataset"]), source=self.source_name,
                     model=self.cfg.model, sampling=self.sampling_json, request_digest=digest, kind=kind,
                     provider=provider, billed_completion_tokens=billed, charged_tokens=charged, cost=cost,
                     t_generate_s=seconds, attempts=attempts, error=error, identity=self.identity)
        if reply is not None:
            c = reply.completion
            rec.reasoning, rec.content, rec.tool_calls = c.reasoning, c.content, c.tool_calls
            rec.finish_reason, rec.native_finish_reason = c.finish_reason, reply.native_finish_reason
            rec.generation_id, rec.model = reply.generation_id, reply.model or self.cfg.model
        try:
            self.journal.append(rec)
        except (JournalError, OSError, ValueError) as e:
            # A paid response we cannot journal: stop sending (the caller halts the source), never pile up.
            if self._journal_failed is None:
                self._journal_failed = self.redact(f"the response journal cannot be written: {e}")
                log.error("source %r stops sending: %s", self.source_name, self._journal_failed)

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
            "output_ids": att.output_ids, "truncated": att.truncated, "rebuild_doubt": att.doubt,
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

    def _unsendable(self, row: dict[str, Any], error: BaseException) -> dict[str, Any]:
        """A prompt whose messages or tools cannot be made into a request: quarantined (class ``sample``), no
        request sent, rather than left to do on every run."""
        reason = self.redact(f"prompt cannot be sent: its messages or tools are not JSON the API takes "
                             f"({type(error).__name__}: {' '.join(str(error).split())})")
        log.warning("quarantined %s: %s", row.get("sample_id"), reason)
        return self._base(row, QUARANTINED, reason, 0, "sample")

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


def _interpret(status: int, raw: bytes, retry_after: str | None, key: str) -> Reply | Failure:
    """``interpret``, with a bug in it an outcome too: the bill is unknown, the row stays to do."""
    try:
        return interpret(status, raw, retry_after, secrets=(key,))
    except Exception as e:  # noqa: BLE001 - interpret is total by contract; this only guards against a bug in it
        log.error("interpret raised on a %s answer (%d bytes)", status, len(raw or b""), exc_info=True)
        return Failure("body", f"unreadable answer ({type(e).__name__})", True, status, maybe_billed=True)


def _account_problem(status: int | None) -> str:
    return {401: "the API key was refused (401)", 402: "out of credits (402)",
            403: "the key may not use this model or provider (403)"}.get(status or 0, f"account error ({status})")
