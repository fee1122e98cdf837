"""One budget per dataset, in completion tokens and in dollars, shared by every HTTP source actor.

Money is spent by many actors at once, so the accounting lives in one place: a
Ray actor hosting :class:`Ledger`. The accounting itself is plain Python
(:class:`BudgetLedger`, :class:`ProviderHealth`) so it is tested without Ray.

Protocol: reserve ``max_tokens`` (and the most the request can cost in dollars)
before a request, then settle with the billed ``completion_tokens`` and the
provider's ``usage.cost``, or release the reservation when nothing was billed.
A reservation is granted only while ``spent + reserved + ask <= budget`` on
both axes, so a budget holds as long as a provider bills no more than it was
asked for; anything billed beyond a reservation is still counted (``overrun``).
A settle without ``usage.cost`` keeps the whole dollar reservation as spent.

Leases: every reservation belongs to a holder (one source actor's engine). Each
call from a holder renews its lease; a holder silent for ``lease_s`` (its actor
died, its node vanished) has its open reservations turned *in doubt*: counted
as spent (they may have been billed) and no longer held, so they cannot block
anyone. A late settle from that holder replaces its in-doubt amount by the bill.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.generate.sources.http.config import HealthConfig

log = logging.getLogger(__name__)

Decision = Literal["granted", "wait", "exhausted", "halted"]
Outcome = Literal["ok", "invalid", "error", "neutral"]
UNLIMITED = "unlimited"
LOCK_LOST = "run lock lost"  # how the reason starts when the run's lock was taken over
LEASE_S = 60.0  # a holder silent this long is taken as dead (its actor, or its node)


class BudgetExceeded(AssertionError):
    """A settle left a dataset's spend above its budget (raised only by a strict ledger)."""


@dataclass
class Account:
    """Spend of one dataset, in completion tokens and in dollars."""

    budget: int | None
    budget_usd: float | None = None
    spent: int = 0
    reserved: int = 0
    cost: float = 0.0  # dollars the provider reported (usage.cost)
    spent_usd: float = 0.0  # dollars counted against budget_usd (reported, or reserved when unreported)
    reserved_usd: float = 0.0
    in_doubt: int = 0  # tokens of dead holders' reservations, counted as spent
    in_doubt_usd: float = 0.0
    sent: int = 0  # reservations granted: requests sent (retries included)
    settled: int = 0  # requests the provider billed (or may have billed)
    released: int = 0  # requests that billed nothing (errors the provider does not charge)
    refused: int = 0  # reservations refused because the budget is spent
    overrun: int = 0  # tokens billed beyond their reservation
    overrun_usd: float = 0.0
    restored: int = 0  # spend carried over from an earlier run
    restored_usd: float = 0.0
    unpriced: int = 0  # settles without usage.cost (their dollar reservation stays spent)
    probes: dict[str, float] = field(default_factory=dict)  # holder -> dollars reserved while the price is unknown
    # The same, of holders whose lease lapsed: one amount per probe (a holder back from a lapse may probe and
    # lapse again), so each late settle finds its own in-doubt reservation.
    probes_in_doubt: dict[str, list[float]] = field(default_factory=dict)


Booked = Counter  # (tokens, dollars) of one reservation -> how many such are booked


@dataclass
class Lease:
    """One holder's reservations per dataset: the open ones, and those in doubt (open when the lease lapsed:
    counted as spent until their settle comes, if ever). Kept by amount, so a settle finds its own."""

    last_seen: float
    open: dict[str, Booked] = field(default_factory=dict)
    doubt: dict[str, Booked] = field(default_factory=dict)


class BudgetLedger:
    """Per-dataset token and dollar budgets; ``None`` (or "unlimited") means no cap on that axis."""

    def __init__(self, budgets: Mapping[str, int | str | None] | None = None, *,
                 default_budget: int | str | None = None, budgets_usd: Mapping[str, float | str | None] | None = None,
                 default_budget_usd: float | str | None = None, strict: bool = False,
                 lease_s: float = LEASE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.default_budget = _check_budget(default_budget)
        self.default_budget_usd = _check_usd(default_budget_usd)
        self.strict = strict
        self.lease_s = lease_s
        self.clock = clock
        self.accounts: dict[str, Account] = {}
        self.leases: dict[str, Lease] = {}
        self.violations: list[str] = []
        usd = dict(budgets_usd or {})
        for name in set(budgets or {}) | set(usd):
            tokens = (budgets or {}).get(name, default_budget)
            self.accounts[name] = Account(budget=_check_budget(tokens),
                                          budget_usd=_check_usd(usd.get(name, default_budget_usd)))

    def account(self, dataset: str) -> Account:
        acc = self.accounts.get(dataset)
        if acc is None:
            acc = self.accounts[dataset] = Account(budget=self.default_budget, budget_usd=self.default_budget_usd)
        return acc

    # -- leases ---------------------------------------------------------------
    def touch(self, holder: str) -> None:
        """A call from ``holder``: its lease is alive (again)."""
        if not holder:
            return
        lease = self.leases.get(holder)
        if lease is None:
            self.leases[holder] = Lease(self.clock())
        else:
            lease.last_seen = self.clock()

    def expire(self, now: float | None = None) -> list[str]:
        """Turn the open reservations of holders silent for ``lease_s`` into in-doubt spend; returns them."""
        now = self.clock() if now is None else now
        gone = []
        for holder, lease in self.leases.items():
            if not any(lease.open.values()) or now - lease.last_seen < self.lease_s:
                continue
            gone.append(holder)
            for dataset, booked in lease.open.items():
                if not booked:
                    continue
                acc = self.account(dataset)
                if holder in acc.probes:  # a dead holder's probe no longer keeps the next one waiting
                    acc.probes_in_doubt.setdefault(holder, []).append(acc.probes.pop(holder))
                tokens = sum(t * n for (t, _), n in booked.items())
                usd = sum(u * n for (_, u), n in booked.items())
                acc.reserved -= tokens
                acc.reserved_usd = max(0.0, acc.reserved_usd - usd)
                acc.spent += tokens
                acc.spent_usd += usd
                acc.in_doubt += tokens
                acc.in_doubt_usd += usd
                lease.doubt.setdefault(dataset, Counter()).update(booked)
                log.warning("holder %s silent for %.0fs: %d request(s) of dataset %r (%d tokens, $%.4f) now in doubt, "
                            "counted as spent", holder, now - lease.last_seen, sum(booked.values()), dataset, tokens,
                            usd)
            lease.open = {}
        return gone

    def _book(self, holder: str, dataset: str, tokens: int, usd: float) -> None:
        if holder:
            self.leases.setdefault(holder, Lease(self.clock())).open.setdefault(dataset, Counter())[(tokens, usd)] += 1

    def _unbook(self, acc: Account, holder: str, dataset: str, tokens: int, usd: float) -> None:
        """Take a settled or released reservation off the books: off its lease's in-doubt spend when its holder
        was taken as dead meanwhile (the bill then replaces the doubt), else off the open reservations."""
        lease = self.leases.get(holder) if holder else None
        key = (tokens, usd)
        doubt = lease.doubt.get(dataset) if lease else None
        opened = lease.open.get(dataset) if lease else None
        if doubt and doubt.get(key) and not (opened and opened.get(key)):
            doubt[key] -= 1
            if not doubt[key]:
                del doubt[key]
            acc.spent -= tokens
            acc.spent_usd -= usd
            acc.in_doubt -= tokens
            acc.in_doubt_usd -= usd
            return
        if opened and opened.get(key):
            opened[key] -= 1
            if not opened[key]:
                del opened[key]
        self._unreserve(acc, dataset, tokens, usd)

    # -- the protocol -----------------------------------------------------------
    def reserve(self, dataset: str, tokens: int, usd: float = 0.0, holder: str = "") -> Decision:
        """Grant ``tokens`` (and ``usd``) now, ask to wait for in-flight settles, or say the budget is spent.

        "wait" means the request fits once outstanding reservations come back;
        "exhausted" means it can never fit (spend only grows). With a dollar budget and
        no price known yet (``usd`` is NaN), one request goes out at a time, to learn it.
        """
        if tokens < 0 or usd < 0:
            raise ValueError("cannot reserve a negative amount")
        self.touch(holder)
        acc = self.account(dataset)
        decision = self._decide(acc, tokens, usd)
        if decision == "wait" and self.expire():
            decision = self._decide(acc, tokens, usd)
        if decision == "granted":
            if math.isnan(usd):  # the price is unknown: this one request holds all that is left of the budget
                usd = 0.0 if acc.budget_usd is None else max(0.0, acc.budget_usd - acc.spent_usd - acc.reserved_usd)
                acc.probes[holder] = acc.probes.get(holder, 0.0) + usd
            acc.reserved += tokens
            acc.reserved_usd += usd
            acc.sent += 1
            self._book(holder, dataset, tokens, usd)
        elif decision == "exhausted":
            acc.refused += 1
        return decision

    @staticmethod
    def _decide(acc: Account, tokens: int, usd: float) -> Decision:
        fits_now, fits_ever = True, True
        if acc.budget is not None:
            fits_now &= acc.spent + acc.reserved + tokens <= acc.budget
            fits_ever &= acc.spent + tokens <= acc.budget
        if acc.budget_usd is not None:
            if math.isnan(usd):  # price unknown: one probe at a time, holding all the budget not yet held
                fits_now &= not acc.probes and acc.spent_usd + acc.reserved_usd < acc.budget_usd
                fits_ever &= acc.spent_usd < acc.budget_usd
            else:
                fits_now &= acc.spent_usd + acc.reserved_usd + usd <= acc.budget_usd
                fits_ever &= acc.spent_usd + usd <= acc.budget_usd
        if fits_now:
            return "granted"
        return "wait" if fits_ever else "exhausted"

    def settle(self, dataset: str, reserved: int, billed: int, cost: float | None = 0.0, *,
               reserved_usd: float = 0.0, holder: str = "") -> None:
        """Replace a reservation by what was billed; ``cost`` None: the provider reported no cost, so the dollar
        reservation stays spent. ``reserved_usd`` NaN: the request was reserved with no price known (a probe).
        Checks the budget invariants."""
        acc = self.account(dataset)
        self.touch(holder)
        reserved_usd = self._probe(acc, holder, reserved_usd)
        self._unbook(acc, holder, dataset, reserved, reserved_usd)
        billed = max(0, int(billed))
        acc.spent += billed
        if cost is None or not math.isfinite(cost):
            acc.unpriced += 1
            acc.spent_usd += reserved_usd
        else:
            cost = max(0.0, float(cost))
            acc.cost += cost
            acc.spent_usd += cost
            if cost > reserved_usd and acc.budget_usd is not None:
                acc.overrun_usd += cost - reserved_usd
        acc.settled += 1
        if billed > reserved:
            acc.overrun += billed - reserved
        self._check(acc, dataset)

    def release(self, dataset: str, reserved: int, *, reserved_usd: float = 0.0, holder: str = "") -> None:
        """Return a reservation for a request that billed nothing."""
        acc = self.account(dataset)
        self.touch(holder)
        reserved_usd = self._probe(acc, holder, reserved_usd)
        self._unbook(acc, holder, dataset, reserved, reserved_usd)
        acc.released += 1

    def cancel(self, dataset: str, reserved: int, *, reserved_usd: float = 0.0, holder: str = "") -> None:
        """Take back a grant that was never sent (its batch could not be journaled): as if never reserved, so it
        is neither held nor, at the next journal write, committed as spend a resume counts as maybe billed."""
        acc = self.account(dataset)
        reserved_usd = self._probe(acc, holder, reserved_usd)
        self._unbook(acc, holder, dataset, reserved, reserved_usd)
        acc.sent -= 1

    def restore(self, spent_by_dataset: Mapping[str, int], cost_by_dataset: Mapping[str, float] | None = None) -> None:
        """Carry over spend already written by an earlier run (call before any reservation)."""
        for dataset in set(spent_by_dataset) | set(cost_by_dataset or {}):
            acc = self.account(dataset)
            if acc.reserved or acc.reserved_usd:
                raise RuntimeError(f"restore({dataset!r}) while requests are in flight")
            if dataset in spent_by_dataset:
                acc.spent = acc.restored = max(0, int(spent_by_dataset[dataset]))
            if cost_by_dataset and dataset in cost_by_dataset:
                acc.spent_usd = acc.restored_usd = max(0.0, float(cost_by_dataset[dataset]))
                acc.cost = acc.spent_usd

    def remaining(self, dataset: str) -> int | None:
        acc = self.account(dataset)
        return None if acc.budget is None else acc.budget - acc.spent

    def report(self) -> dict[str, dict[str, Any]]:
        return {name: {"budget": a.budget, "spent": a.spent, "reserved": a.reserved, "cost": a.cost,
                       "budget_usd": a.budget_usd, "spent_usd": round(a.spent_usd, 6),
                       "reserved_usd": round(a.reserved_usd, 6), "in_doubt": a.in_doubt,
                       "in_doubt_usd": round(a.in_doubt_usd, 6), "unpriced": a.unpriced,
                       "sent": a.sent, "settled": a.settled, "released": a.released, "refused": a.refused,
                       "overrun": a.overrun, "overrun_usd": round(a.overrun_usd, 6), "restored": a.restored}
                for name, a in sorted(self.accounts.items())}

    @staticmethod
    def _probe(acc: Account, holder: str, reserved_usd: float) -> float:
        """What a probe (reserved at an unknown price) holds; other reservations say their amount themselves."""
        if not math.isnan(reserved_usd):
            return reserved_usd
        if holder in acc.probes:
            return acc.probes.pop(holder)
        doubt = acc.probes_in_doubt.get(holder)
        if not doubt:
            return 0.0
        amount = doubt.pop(0)
        if not doubt:
            del acc.probes_in_doubt[holder]
        return amount

    def _check(self, acc: Account, dataset: str) -> None:
        msgs = []
        if acc.budget is not None and acc.spent > acc.budget:
            msgs.append(f"dataset {dataset!r}: spent {acc.spent} > budget {acc.budget}")
        if acc.budget_usd is not None and acc.spent_usd > acc.budget_usd + 1e-9:
            msgs.append(f"dataset {dataset!r}: spent ${acc.spent_usd:.6f} > budget ${acc.budget_usd:.6f}")
        for msg in msgs:
            self.violations.append(msg)
            log.error("budget exceeded: %s", msg)
            if self.strict:
                raise BudgetExceeded(msg)

    @staticmethod
    def _unreserve(acc: Account, dataset: str, reserved: int, reserved_usd: float = 0.0) -> None:
        if reserved < 0 or reserved > acc.reserved:
            raise ValueError(f"dataset {dataset!r}: returning {reserved} tokens but only {acc.reserved} are reserved")
        acc.reserved -= reserved
        acc.reserved_usd = max(0.0, acc.reserved_usd - reserved_usd)


def _check_budget(budget: int | str | None) -> int | None:
    if budget is None or budget == UNLIMITED:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"a token budget is an integer >= 0 or {UNLIMITED!r}, not {budget!r}")
    return budget


def _check_usd(budget: float | str | None) -> float | None:
    if budget is None or budget == UNLIMITED:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not budget >= 0 or math.isinf(budget):
        raise ValueError(f"a dollar budget is a number >= 0 or {UNLIMITED!r}, not {budget!r}")
    return float(budget)


@dataclass
class ProviderStats:
    requests: int = 0
    errors: int = 0
    invalid: int = 0  # served, but failed a check (billing drift, structure)
    completion_tokens: int = 0
    cost: float = 0.0
    drift_abs_sum: int = 0  # sum of |rebuilt ids - billed completion tokens|
    drift_n: int = 0
    recent: deque = field(default_factory=deque)
    excluded_reason: str | None = None


class ProviderHealth:
    """Per-provider outcomes; excludes a provider once its recent error or invalid rate crosses the policy.

    Exclusion is sticky for the run: a provider serving something else does not
    get better by being retried, and flapping would mix its samples back in.
    """

    def __init__(self, policy: HealthConfig | None = None) -> None:
        self.policy = policy or HealthConfig()
        self.providers: dict[str, ProviderStats] = {}
        self._excluded: tuple[str, ...] = ()

    def record(self, provider: str, outcome: Outcome, *, billed: int = 0, cost: float = 0.0,
               drift: int | None = None) -> str | None:
        """Count one outcome; returns the exclusion reason when this outcome excluded the provider."""
        if not provider:
            return None
        st = self.providers.setdefault(provider, ProviderStats())
        st.completion_tokens += max(0, int(billed))
        st.cost += float(cost or 0.0)
        if drift is not None:
            st.drift_abs_sum += abs(int(drift))
            st.drift_n += 1
        if outcome == "neutral":
            return None
        st.requests += 1
        st.errors += outcome == "error"
        st.invalid += outcome == "invalid"
        st.recent.append(outcome)
        while len(st.recent) > self.policy.window:
            st.recent.popleft()
        if st.excluded_reason is not None or len(st.recent) < self.policy.min_requests:
            return None
        n = len(st.recent)
        errors = sum(o == "error" for o in st.recent)
        invalid = sum(o == "invalid" for o in st.recent)
        served = n - errors
        reason = None
        if errors / n > self.policy.max_error_rate:
            reason = f"error rate {errors}/{n} > {self.policy.max_error_rate}"
        elif served and invalid / served > self.policy.max_invalid_rate:
            reason = f"validation-failure rate {invalid}/{served} > {self.policy.max_invalid_rate}"
        if reason and all(o.excluded_reason for name, o in self.providers.items() if name != provider):
            # Routing around every provider leaves nothing to serve: keep the last one, say so.
            log.warning("provider %r crosses the exclusion policy (%s) but is the last one left", provider, reason)
            return None
        if reason:
            st.excluded_reason = reason
            self._excluded = tuple(sorted((*self._excluded, provider)))
            log.warning("excluding provider %r: %s", provider, reason)
        return reason

    @property
    def excluded(self) -> tuple[str, ...]:
        return self._excluded

    def report(self) -> dict[str, dict[str, Any]]:
        return {p: {"requests": st.requests, "errors": st.errors, "invalid": st.invalid,
                    "completion_tokens": st.completion_tokens, "cost": st.cost,
                    "mean_abs_billing_drift": st.drift_abs_sum / st.drift_n if st.drift_n else None,
                    "excluded": st.excluded_reason}
                for p, st in sorted(self.providers.items())}


# Ops sent in batches to the shared ledger, as plain tuples (cheap to pickle); one batch comes from one holder:
#   ("reserve", dataset, tokens, usd)                                                   -> Decision
#   ("settle", dataset, reserved, billed, cost, provider, outcome, drift, reserved_usd)  -> None  (cost None: unknown)
#   ("release", dataset, reserved, provider, outcome, reserved_usd)                      -> None
#   ("halt", reason)                                                                     -> None
Op = tuple


class Ledger:
    """Budgets plus provider health behind one batched entry point; what the Ray actor hosts."""

    def __init__(self, budgets: Mapping[str, int | str | None] | None = None, *,
                 default_budget: int | str | None = None, budgets_usd: Mapping[str, float | str | None] | None = None,
                 default_budget_usd: float | str | None = None, health: HealthConfig | None = None,
                 strict: bool = False, spent: Mapping[str, int] | None = None,
                 spent_usd: Mapping[str, float] | None = None, journal: str | None = None,
                 lease_s: float = LEASE_S, lock: tuple[str, str] | None = None) -> None:
        self.lock = lock  # (path, token) of the run's lock: a ledger whose run lost it grants nothing more
        self.lock_lost: str | None = None
        self._lock_checked = 0.0
        self.budget = BudgetLedger(budgets, default_budget=default_budget, budgets_usd=budgets_usd,
                                   default_budget_usd=default_budget_usd, strict=strict, lease_s=lease_s)
        self.health = ProviderHealth(health)
        self.settles = 0
        self.halted: str | None = None  # why the source stopped sending (account failure); never journaled
        self.journal = journal
        self._journaled: tuple[dict[str, int], dict[str, float]] | None = None  # what the journal file holds now
        spent, usd = dict(spent or {}), dict(spent_usd or {})
        tokens_c, usd_c = read_journal_both(journal)
        for dataset, committed in tokens_c.items():
            spent[dataset] = max(spent.get(dataset, 0), committed)
        for dataset, committed_usd in usd_c.items():
            usd[dataset] = max(usd.get(dataset, 0.0), committed_usd)
        if spent or usd:
            self.budget.restore(spent, usd)
        self._write_journal()

    def _write_journal(self) -> None:
        """Persist spent + reserved per dataset (tokens and dollars) before any granted request can be sent.

        A run killed with requests in flight may have been billed for them without writing
        their samples; counting every outstanding reservation as spent on restore means a
        resumed run can never push the provider's bill past the budget.
        """
        from pipeline.base.layout import atomic_write_json

        if not self.journal or self.lock_lost:
            return  # a run that lost its folder writes nothing there: the new holder's ledger owns the journal
        accounts = self.budget.accounts.items()
        tokens = {name: a.spent + a.reserved for name, a in accounts}
        # Unrounded (JSON floats read back exactly): rounding could restore a hair less than was committed.
        usd = {name: a.spent_usd + a.reserved_usd for name, a in accounts if a.spent_usd or a.reserved_usd}
        if (tokens, usd) == self._journaled:
            return  # nothing changed (e.g. health-only ops): skip the fsync on this serialized path
        atomic_write_json(self.journal, {JOURNAL_FORMAT: 2, "tokens": tokens, "usd": usd}, indent=None)
        self._journaled = (tokens, usd)

    def apply(self, ops: Iterable[Op], holder: str = "") -> tuple[list[Any], tuple[str, ...], str | None]:
        """Run one holder's ops in order (an empty batch renews its lease); returns their results, the providers
        excluded so far and why the source halted."""
        ops = list(ops)
        for op in ops:
            if op[0] not in ("reserve", "settle", "release", "halt"):
                raise ValueError(f"unknown ledger op {op[0]!r}")
        results: list[Any] = []
        self.budget.touch(holder)
        self._check_lock()
        for op in ops:
            results.append(self._apply_one(op, holder))
        try:
            self._write_journal()
        except OSError as e:  # the grants of this batch must not go out unjournaled: a kill would forget them
            self.halt(f"the budget journal cannot be written: {e}")
            for op, r in zip(ops, results, strict=True):
                if op[0] == "reserve" and r == "granted":  # never sent: left booked, a later write would commit it
                    self.budget.cancel(op[1], op[2], reserved_usd=op[3] if len(op) > 3 else 0.0, holder=holder)
            results = ["halted" if r == "granted" else r for r in results]
        return results, self.health.excluded, self.halted

    def _apply_one(self, op: Op, holder: str) -> Any:
        """One op; an error in the accounting halts the source (spending on books that do not add up is
        worse than stopping) and never fails the other ops of the batch, which are other requests' settles."""
        kind = op[0]
        try:
            if kind == "reserve":
                return self.reserve(*op[1:], holder=holder)
            if kind == "settle":
                return self.settle(*op[1:], holder=holder)
            if kind == "release":
                return self.release(*op[1:], holder=holder)
            return self.halt(op[1])
        except BudgetExceeded:
            raise  # a strict ledger (tests): the violation is the point
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.exception("ledger op %s failed", kind)
            self.halt(f"ledger error on {kind}: {type(e).__name__}: {e}")
            return "halted" if kind == "reserve" else None

    def _check_lock(self, every_s: float = 1.0) -> None:
        """At most once a second, whether the run still holds its folder's lock: the driver may be frozen (its
        heartbeat thread with it) while this actor goes on granting requests to the source's actors."""
        if self.lock is None or self.lock_lost:
            return
        now = time.monotonic()
        if now - self._lock_checked < every_s:
            return
        self._lock_checked = now
        from pipeline.base.run_lock import LockLost, check_token

        try:
            check_token(*self.lock)
        except LockLost as e:
            self.lock_lost = f"{LOCK_LOST}: {e}"
            self.halt(self.lock_lost)
        except OSError as e:  # a filesystem hiccup: the next check decides
            log.warning("ledger: cannot read the run lock: %s", e)

    def reserve(self, dataset: str, tokens: int, usd: float = 0.0, *, holder: str = "") -> Decision:
        """A budget decision, or ``halted`` once the source hit an account failure (no more requests anywhere)."""
        return "halted" if self.halted else self.budget.reserve(dataset, tokens, usd, holder)

    def halt(self, reason: str) -> None:
        """Stop every actor of this source from sending (401/402/403, a config error, a lost lock)."""
        if not self.halted:
            self.halted = reason
            log.warning("source halted: %s", reason)

    def settle(self, dataset: str, reserved: int, billed: int, cost: float | None, provider: str, outcome: Outcome,
               drift: int | None, reserved_usd: float = 0.0, *, holder: str = "") -> None:
        self.settles += 1
        self.budget.settle(dataset, reserved, billed, cost, reserved_usd=reserved_usd, holder=holder)
        self.health.record(provider, outcome, billed=billed, cost=cost or 0.0, drift=drift)

    def release(self, dataset: str, reserved: int, provider: str, outcome: Outcome, reserved_usd: float = 0.0, *,
                holder: str = "") -> None:
        self.budget.release(dataset, reserved, reserved_usd=reserved_usd, holder=holder)
        self.health.record(provider, outcome)

    def expire(self) -> list[str]:
        """Holders whose lease lapsed now (their reservations in doubt); the driver may call it when it waits."""
        gone = self.budget.expire()
        if gone:
            self._write_journal()
        return gone

    def restore(self, spent_by_dataset: Mapping[str, int], cost_by_dataset: Mapping[str, float] | None = None) -> None:
        self.budget.restore(spent_by_dataset, cost_by_dataset)

    def excluded(self) -> tuple[str, ...]:
        return self.health.excluded

    def report(self) -> dict[str, Any]:
        """Tokens and cost per dataset and per provider, exclusions, and any budget violation."""
        return {"datasets": self.budget.report(), "providers": self.health.report(),
                "excluded": list(self.health.excluded), "violations": list(self.budget.violations),
                "settles": self.settles, "halted": self.halted}


JOURNAL_FORMAT = "#format"  # no dataset is named so (names are [A-Za-z0-9_.-]+): tells the layouts apart


def read_journal_both(path: str | None) -> tuple[dict[str, int], dict[str, float]]:
    """Committed tokens and dollars (spent + in flight) per dataset from a ledger journal; empty when absent.

    Reads both layouts: ``{"#format": 2, "tokens": {...}, "usd": {...}}`` and the first one, ``{dataset:
    tokens}``. A journal that is there but cannot be read (not JSON, not either layout, a count that is not a
    number >= 0) raises ``UnreadableFile`` naming it, never reads as empty: forgetting the spend could pay twice."""
    from pipeline.base.config import UnreadableFile

    if not path or not os.path.exists(path):
        return {}, {}
    what, data = None, None
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        what = f"cannot be read ({e.strerror})"
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        what = f"is not valid JSON ({e})"
    parts: dict[str, Any] = {}
    if what is None:
        v2 = isinstance(data, dict) and data.get(JOURNAL_FORMAT) == 2
        parts = {"tokens": data.get("tokens", {}), "usd": data.get("usd", {})} if v2 else {"tokens": data}
        for part, counts in parts.items():
            if what is None and not isinstance(counts, dict):
                what = f"holds a JSON {type(counts).__name__} where {part} per dataset belong"
            elif what is None:
                whole = part == "tokens"
                bad = sorted(str(k) for k, v in counts.items() if type(v) not in ((int,) if whole else (int, float))
                             or v < 0 or not math.isfinite(v))
                if bad:
                    what = f"has datasets {bad} without a {part} count (a {'whole ' if whole else ''}number >= 0)"
    if what is not None:
        raise UnreadableFile(f"{path}: this budget journal {what}. It holds what the source already spent: restore "
                             "it from a backup or fix it by hand (moving it aside forgets that spend, and the "
                             "budget would pay for it again)")
    return ({k: int(v) for k, v in parts["tokens"].items()},
            {k: float(v) for k, v in parts.get("usd", {}).items()})


def read_journal(path: str | None) -> dict[str, int]:
    """Committed tokens (spent + in flight) per dataset from a ledger journal; empty when absent (see
    :func:`read_journal_both`: an unreadable one raises ``UnreadableFile``)."""
    return read_journal_both(path)[0]


def create_ledger(budgets: Mapping[str, int | str | None] | None = None, *, name: str | None = None,
                  default_budget: int | str | None = None, budgets_usd: Mapping[str, float | str | None] | None = None,
                  default_budget_usd: float | str | None = None, health: HealthConfig | None = None,
                  strict: bool = False, spent: Mapping[str, int] | None = None,
                  spent_usd: Mapping[str, float] | None = None, journal: str | None = None,
                  lease_s: float = LEASE_S, lock: tuple[str, str] | None = None) -> Any:
    """Start the shared ledger as a Ray actor (no CPU reserved; calls run one at a time) on this (the driver's)
    node: left to Ray, the zero-CPU actor lands on any node, and losing that node fails every source actor's
    next ledger call, so the whole run. Here it shares the driver's fate and survives the loss of any other node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor_cls = ray.remote(num_cpus=0, max_concurrency=1, scheduling_strategy=here)(Ledger)
    if name:
        actor_cls = actor_cls.options(name=name, get_if_exists=True)
    return actor_cls.remote(budgets, default_budget=default_budget, budgets_usd=budgets_usd,
                            default_budget_usd=default_budget_usd, health=health, strict=strict, spent=spent,
                            spent_usd=spent_usd, journal=journal, lease_s=lease_s, lock=lock)


def ledger_for(cfg: Any, *, spent: Mapping[str, int] | None = None, spent_usd: Mapping[str, float] | None = None,
               name: str | None = None, strict: bool = False, journal: str | None = None,
               lock: tuple[str, str] | None = None) -> Any:
    """The shared ledger actor for a spending source's config (its budgets, dollar budgets, ``health``, lease)."""
    return create_ledger(cfg.budgets, name=name, default_budget=cfg.default_budget,
                         budgets_usd=cfg.budgets_usd, default_budget_usd=cfg.default_budget_usd, health=cfg.health,
                         strict=strict, spent=spent, spent_usd=spent_usd, journal=journal,
                         lease_s=cfg.lease_s, lock=lock)


def halt(ledger: Any, reason: str) -> None:
    """Halt a source from outside an event loop: an in-process ``Ledger`` or its Ray actor (fire and forget)."""
    if isinstance(ledger, Ledger):
        ledger.halt(reason)
    else:
        ledger.apply.remote([("halt", reason)])


def read_spend(layout: Any, sources: Sequence[Any]) -> dict[str, dict[str, tuple[int, int | None]]]:
    """Per spending source, tokens committed per dataset (its ledger journal, either layout, which the ledger
    rewrites on every change) against that dataset's budget: the console's spend while a run generates. A
    journal caught mid-rewrite reads as nothing committed yet, for this line only (the run's start refused an
    unreadable one)."""
    from pipeline.base.config import UnreadableFile

    out: dict[str, dict[str, tuple[int, int | None]]] = {}
    for src in sources:
        try:
            committed, _ = read_journal_both(str(layout.ledger(src.name)))
        except UnreadableFile:
            committed = {}
        names = sorted(set(src.budgets) | set(committed))
        out[src.name] = {d: (committed.get(d, 0), src.token_budget(d)) for d in names}
    return out
