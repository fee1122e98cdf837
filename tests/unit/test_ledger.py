"""The shared budget ledger and provider health, as plain classes (no Ray)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import HealthConfig
from pipeline.ledger import (
    BudgetExceeded,
    BudgetLedger,
    Ledger,
    ProviderHealth,
)
from tests.helpers.ledger import spent_from_samples


def test_reserve_wait_exhausted():
    b = BudgetLedger({"d": 100})
    assert b.reserve("d", 60) == "granted"
    assert b.reserve("d", 60) == "wait"  # fits once the first request settles below 40
    b.settle("d", 60, 30)
    assert b.reserve("d", 60) == "granted"
    b.settle("d", 60, 60)
    assert b.remaining("d") == 10
    assert b.reserve("d", 60) == "exhausted"
    assert b.report()["d"]["refused"] == 1 and b.report()["d"]["spent"] == 90


def test_release_returns_the_reservation():
    b = BudgetLedger({"d": 10})
    assert b.reserve("d", 10) == "granted"
    b.release("d", 10)
    assert b.reserve("d", 10) == "granted"
    with pytest.raises(ValueError):
        b.release("d", 11)


def test_unlisted_datasets_take_the_default():
    b = BudgetLedger({"small": 5}, default_budget=None)
    assert all(b.reserve("big", 10**9) == "granted" for _ in range(3))
    b2 = BudgetLedger(default_budget=7)
    assert b2.reserve("x", 8) == "exhausted"


def test_overbilling_is_counted_and_strict_ledger_raises():
    b = BudgetLedger({"d": 100}, strict=True)
    b.reserve("d", 50)
    b.settle("d", 50, 70)  # a provider billing past max_tokens
    assert b.report()["d"]["overrun"] == 20
    b.reserve("d", 30)
    with pytest.raises(BudgetExceeded):
        b.settle("d", 30, 31)
    assert b.violations


def test_restore_carries_spend_over():
    b = BudgetLedger({"d": 100})
    b.restore({"d": 95, "e": 3})
    assert b.remaining("d") == 5 and b.reserve("d", 6) == "exhausted"
    assert b.report()["d"]["restored"] == 95
    b.reserve("e", 1)
    with pytest.raises(RuntimeError):
        b.restore({"e": 0})


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(0, 500), max_tokens=st.integers(1, 64),
       bills=st.lists(st.tuples(st.integers(0, 64), st.booleans()), max_size=80))
def test_budget_never_exceeded(budget, max_tokens, bills):
    """Whatever order requests settle in, spend never passes the budget when providers bill <= max_tokens."""
    b = BudgetLedger({"d": budget}, strict=True)
    inflight = 0
    for billed, release in bills:
        if b.reserve("d", max_tokens) == "granted":
            inflight += 1
        if inflight and (billed % 3):  # settle some, keep some in flight
            inflight -= 1
            if release:
                b.release("d", max_tokens)
            else:
                b.settle("d", max_tokens, min(billed, max_tokens))
        acc = b.account("d")
        assert acc.spent + acc.reserved <= budget
    while inflight:
        inflight -= 1
        b.settle("d", max_tokens, max_tokens)
    assert b.account("d").spent <= budget and not b.violations


def test_health_excludes_on_error_rate():
    h = ProviderHealth(HealthConfig(window=10, min_requests=10, max_error_rate=0.5, max_invalid_rate=0.3))
    h.record("B", "ok")
    for i in range(9):
        assert h.record("A", "error" if i % 2 else "ok") is None
    assert h.excluded == ()
    for _ in range(5):
        h.record("A", "error")
    assert h.excluded == ("A",)
    assert "error rate" in h.report()["A"]["excluded"]


def test_health_excludes_on_validation_failures_and_ignores_neutral():
    h = ProviderHealth(HealthConfig(window=20, min_requests=5, max_invalid_rate=0.2))
    for _ in range(50):
        h.record("B", "neutral")  # 429s and routing errors say nothing about B
    h.record("C", "ok")
    h.record("A", "ok", billed=10, cost=0.5, drift=0)
    for _ in range(4):
        h.record("A", "invalid", billed=10, drift=40)
    assert h.excluded == ("A",)
    rep = h.report()
    assert rep["A"]["completion_tokens"] == 50 and rep["A"]["cost"] == 0.5
    assert rep["A"]["mean_abs_billing_drift"] == 32
    assert rep["B"]["requests"] == 0 and not rep["B"]["excluded"]


def test_health_never_routes_around_the_last_provider():
    h = ProviderHealth(HealthConfig(window=5, min_requests=5))
    for _ in range(10):
        h.record("A", "error")
    assert h.excluded == ()  # alone: excluding it would leave nothing to serve
    for _ in range(10):
        h.record("B", "ok")
        h.record("A", "error")
    assert h.excluded == ("A",)
    for _ in range(10):
        h.record("B", "error")
    assert h.excluded == ("A",)


def test_ledger_apply_batches_ops_and_reports():
    led = Ledger({"d": 100}, spent={"d": 10})
    res, excluded, _ = led.apply([("reserve", "d", 40), ("reserve", "d", 40), ("reserve", "d", 40),
                               ("settle", "d", 40, 20, 0.2, "A", "ok", 1),
                               ("release", "d", 40, "B", "error")])
    assert res == ["granted", "granted", "wait", None, None] and excluded == ()
    rep = led.report()
    assert rep["datasets"]["d"]["spent"] == 30 and rep["datasets"]["d"]["reserved"] == 0
    assert rep["providers"]["A"]["cost"] == 0.2 and rep["providers"]["B"]["errors"] == 1
    assert rep["settles"] == 1 and rep["violations"] == []
    with pytest.raises(ValueError):
        led.apply([("refund", "d", 1)])


def test_spent_from_samples():
    rows = [{"dataset": "a", "billed_completion_tokens": 5}, {"dataset": "a", "billed_completion_tokens": -1},
            {"dataset": "b", "billed_completion_tokens": 7}, {"dataset": "a", "billed_completion_tokens": 2}]
    assert spent_from_samples(rows) == {"a": 7, "b": 7}


def test_journal_counts_in_flight_reservations_as_spent_on_restore(tmp_path):
    from pipeline.ledger import Ledger, read_journal

    journal = str(tmp_path / "ledger.json")
    first = Ledger({"d": 100}, journal=journal)
    first.apply([("reserve", "d", 30), ("reserve", "d", 30)])
    first.apply([("settle", "d", 30, 10, 0.0, "p", "ok", 0)])
    assert read_journal(journal) == {"d": 10 + 30}  # one request still in flight when "killed"
    second = Ledger({"d": 100}, journal=journal, spent={"d": 10})
    assert second.budget.remaining("d") == 60
    assert second.apply([("reserve", "d", 61)])[0] == ["exhausted"]
    assert second.apply([("reserve", "d", 60)])[0] == ["granted"]
