"""One completion-token budget per dataset, shared by every HTTP source actor.

Money is spent by many actors at once, so the accounting lives in one place: a
Ray actor hosting :class:`Ledger`. The accounting itself is plain Python
(:class:`BudgetLedger`, :class:`ProviderHealth`) so it is tested without Ray.

Protocol: reserve ``max_tokens`` before a request (the most it can bill), then
settle with the billed ``completion_tokens`` or release the reservation when
nothing was billed. A reservation is granted only while ``spent + reserved +
tokens <= budget``, so the budget holds as long as a provider bills no more
than it was asked for (``max_tokens``); anything billed beyond a reservation is
still counted (``overrun``) and reported.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.config import HealthConfig

log = logging.getLogger(__name__)

Decision = Literal["granted", "wait", "exhausted", "halted"]
Outcome = Literal["ok", "invalid", "error", "neutral"]


class BudgetExceeded(AssertionError):
    """A settle left a dataset's spend above its budget (raised only by a strict ledger)."""


@dataclass
class Account:
    """Spend of one dataset."""

    budget: int | None
    spent: int = 0
    reserved: int = 0
    cost: float = 0.0
    sent: int = 0  # reservations granted: requests sent (retries included)
    settled: int = 0  # requests the provider billed (or may have billed)
    released: int = 0  # requests that billed nothing (errors the provider does not charge)
    refused: int = 0  # reservations refused because the budget is spent
    overrun: int = 0  # tokens billed beyond their reservation
    restored: int = 0  # spend carried over from an earlier run


class BudgetLedger:
    """Per-dataset completion-token budgets; ``None`` means unlimited."""

    def __init__(self, budgets: Mapping[str, int | None] | None = None, *,
                 default_budget: int | None = None, strict: bool = False) -> None:
        self.default_budget = default_budget
        self.strict = strict
        self.accounts: dict[str, Account] = {}
        self.violations: list[str] = []
        for name, budget in (budgets or {}).items():
            self.accounts[name] = Account(budget=_check_budget(budget))

    def account(self, dataset: str) -> Account:
        acc = self.accounts.get(dataset)
        if acc is None:
            acc = self.accounts[dataset] = Account(budget=self.default_budget)
        return acc

    def reserve(self, dataset: str, tokens: int) -> Decision:
        """Grant ``tokens`` now, ask to wait for in-flight settles, or say the budget is spent.

        "wait" means the request fits once outstanding reservations come back;
        "exhausted" means it can never fit (spend only grows).
        """
        if tokens < 0:
            raise ValueError("cannot reserve a negative number of tokens")
        acc = self.account(dataset)
        if acc.budget is None or acc.spent + acc.reserved + tokens <= acc.budget:
            acc.reserved += tokens
            acc.sent += 1
            return "granted"
        if acc.spent + tokens <= acc.budget:
            return "wait"
        acc.refused += 1
        return "exhausted"

    def settle(self, dataset: str, reserved: int, billed: int, cost: float = 0.0) -> None:
        """Replace a reservation by what was billed; checks the budget invariant."""
        acc = self.account(dataset)
        self._unreserve(acc, dataset, reserved)
        billed = max(0, int(billed))
        acc.spent += billed
        acc.cost += float(cost or 0.0)
        acc.settled += 1
        if billed > reserved:
            acc.overrun += billed - reserved
        if acc.budget is not None and acc.spent > acc.budget:
            msg = f"dataset {dataset!r}: spent {acc.spent} > budget {acc.budget}"
            self.violations.append(msg)
            log.error("budget exceeded: %s", msg)
            if self.strict:
                raise BudgetExceeded(msg)

    def release(self, dataset: str, reserved: int) -> None:
        """Return a reservation for a request that billed nothing."""
        acc = self.account(dataset)
        self._unreserve(acc, dataset, reserved)
        acc.released += 1

    def restore(self, spent_by_dataset: Mapping[str, int], cost_by_dataset: Mapping[str, float] | None = None) -> None:
        """Carry over spend already written by an earlier run (call before any reservation)."""
        for dataset, spent in spent_by_dataset.items():
            acc = self.account(dataset)
            if acc.reserved:
                raise RuntimeError(f"restore({dataset!r}) while requests are in flight")
            acc.spent = acc.restored = max(0, int(spent))
            acc.cost = float((cost_by_dataset or {}).get(dataset, acc.cost))

    def remaining(self, dataset: str) -> int | None:
        acc = self.account(dataset)
        return None if acc.budget is None else acc.budget - acc.spent

    def report(self) -> dict[str, dict[str, Any]]:
        return {name: {"budget": a.budget, "spent": a.spent, "reserved": a.reserved, "cost": a.cost,
                       "sent": a.sent, "settled": a.settled, "released": a.released, "refused": a.refused,
                       "overrun": a.overrun, "restored": a.restored}
                for name, a in sorted(self.accounts.items())}

    @staticmethod
    def _unreserve(acc: Account, dataset: str, reserved: int) -> None:
        if reserved < 0 or reserved > acc.reserved:
            raise ValueError(f"dataset {dataset!r}: returning {reserved} tokens but only {acc.reserved} are reserved")
        acc.reserved -= reserved


def _check_budget(budget: int | None) -> int | None:
    if budget is not None and budget < 0:
        raise ValueError("budgets must be >= 0")
    return budget


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


# Ops sent in batches to the shared ledger, as plain tuples (cheap to pickle):
#   ("reserve", dataset, tokens)                                    -> Decision
#   ("settle", dataset, reserved, billed, cost, provider, outcome, drift) -> None
#   ("release", dataset, reserved, provider, outcome)               -> None
#   ("halt", reason)                                                -> None
Op = tuple


class Ledger:
    """Budgets plus provider health behind one batched entry point; what the Ray actor hosts."""

    def __init__(self, budgets: Mapping[str, int | None] | None = None, *, default_budget: int | None = None,
                 health: HealthConfig | None = None, strict: bool = False,
                 spent: Mapping[str, int] | None = None, journal: str | None = None) -> None:
        self.budget = BudgetLedger(budgets, default_budget=default_budget, strict=strict)
        self.health = ProviderHealth(health)
        self.settles = 0
        self.halted: str | None = None  # why the source stopped sending (account failure); never journaled
        self.journal = journal
        self._journaled: dict[str, int] | None = None  # what the journal file holds now
        spent = dict(spent or {})
        for dataset, committed in read_journal(journal).items():
            spent[dataset] = max(spent.get(dataset, 0), committed)
        if spent:
            self.budget.restore(spent)
        self._write_journal()

    def _write_journal(self) -> None:
        """Persist spent + reserved per dataset before any granted request can be sent.

        A run killed with requests in flight may have been billed for them without writing
        their samples; counting every outstanding reservation as spent on restore means a
        resumed run can never push the provider's bill past the budget.
        """
        from pipeline.layout import atomic_write_json

        if not self.journal:
            return
        committed = {name: a.spent + a.reserved for name, a in self.budget.accounts.items()}
        if committed == self._journaled:
            return  # nothing changed (e.g. health-only ops): skip the fsync on this serialized path
        atomic_write_json(self.journal, committed, indent=None)
        self._journaled = committed

    def apply(self, ops: Iterable[Op]) -> tuple[list[Any], tuple[str, ...], str | None]:
        """Run ops in order; returns their results, the providers excluded so far and why the source halted."""
        results: list[Any] = []
        for op in ops:
            kind = op[0]
            if kind == "reserve":
                results.append(self.reserve(op[1], op[2]))
            elif kind == "settle":
                results.append(self.settle(*op[1:]))
            elif kind == "release":
                results.append(self.release(*op[1:]))
            elif kind == "halt":
                results.append(self.halt(op[1]))
            else:
                raise ValueError(f"unknown ledger op {kind!r}")
        self._write_journal()
        return results, self.health.excluded, self.halted

    def reserve(self, dataset: str, tokens: int) -> Decision:
        """A budget decision, or ``halted`` once the source hit an account failure (no more requests anywhere)."""
        return "halted" if self.halted else self.budget.reserve(dataset, tokens)

    def halt(self, reason: str) -> None:
        """Stop every actor of this source from sending (401/402/403: more requests only fail or spend)."""
        if not self.halted:
            self.halted = reason
            log.warning("source halted: %s", reason)

    def settle(self, dataset: str, reserved: int, billed: int, cost: float, provider: str, outcome: Outcome,
               drift: int | None) -> None:
        self.settles += 1
        self.budget.settle(dataset, reserved, billed, cost)
        self.health.record(provider, outcome, billed=billed, cost=cost, drift=drift)

    def release(self, dataset: str, reserved: int, provider: str, outcome: Outcome) -> None:
        self.budget.release(dataset, reserved)
        self.health.record(provider, outcome)

    def restore(self, spent_by_dataset: Mapping[str, int], cost_by_dataset: Mapping[str, float] | None = None) -> None:
        self.budget.restore(spent_by_dataset, cost_by_dataset)

    def excluded(self) -> tuple[str, ...]:
        return self.health.excluded

    def report(self) -> dict[str, Any]:
        """Tokens and cost per dataset and per provider, exclusions, and any budget violation."""
        return {"datasets": self.budget.report(), "providers": self.health.report(),
                "excluded": list(self.health.excluded), "violations": list(self.budget.violations),
                "settles": self.settles, "halted": self.halted}


def read_journal(path: str | None) -> dict[str, int]:
    """Committed tokens (spent + in flight) per dataset from a ledger journal; empty when absent."""
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        return {k: int(v) for k, v in json.load(f).items()}


def create_ledger(budgets: Mapping[str, int | None] | None = None, *, name: str | None = None,
                  default_budget: int | None = None, health: HealthConfig | None = None,
                  strict: bool = False, spent: Mapping[str, int] | None = None, journal: str | None = None) -> Any:
    """Start the shared ledger as a Ray actor (no CPU reserved; calls run one at a time) on this (the driver's)
    node: left to Ray, the zero-CPU actor lands on any node, and losing that node fails every source actor's
    next ledger call, so the whole run. Here it shares the driver's fate and survives the loss of any other node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor_cls = ray.remote(num_cpus=0, max_concurrency=1, scheduling_strategy=here)(Ledger)
    if name:
        actor_cls = actor_cls.options(name=name, get_if_exists=True)
    return actor_cls.remote(budgets, default_budget=default_budget, health=health, strict=strict, spent=spent,
                            journal=journal)


def ledger_for(cfg: Any, *, spent: Mapping[str, int] | None = None, name: str | None = None,
               strict: bool = False, journal: str | None = None) -> Any:
    """The shared ledger actor for a spending source's config (its ``budgets``, ``default_budget`` and ``health``)."""
    return create_ledger(cfg.budgets, name=name, default_budget=cfg.default_budget, health=cfg.health,
                         strict=strict, spent=spent, journal=journal)


def halt(ledger: Any, reason: str) -> None:
    """Halt a source from outside an event loop: an in-process ``Ledger`` or its Ray actor (fire and forget)."""
    if isinstance(ledger, Ledger):
        ledger.halt(reason)
    else:
        ledger.apply.remote([("halt", reason)])

