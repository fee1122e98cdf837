"""The shared budget ledger and provider health, as plain classes (no Ray)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.generate.ledger import (
    BudgetExceeded,
    BudgetLedger,
    Ledger,
    ProviderHealth,
)
from pipeline.generate.sources.http.config import HealthConfig
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
    from pipeline.generate.ledger import Ledger, read_journal

    journal = str(tmp_path / "ledger.json")
    first = Ledger({"d": 100}, journal=journal)
    first.apply([("reserve", "d", 30), ("reserve", "d", 30)])
    first.apply([("settle", "d", 30, 10, 0.0, "p", "ok", 0)])
    assert read_journal(journal) == {"d": 10 + 30}  # one request still in flight when "killed"
    second = Ledger({"d": 100}, journal=journal, spent={"d": 10})
    assert second.budget.remaining("d") == 60
    assert second.apply([("reserve", "d", 61)])[0] == ["exhausted"]
    assert second.apply([("reserve", "d", 60)])[0] == ["granted"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_dead_holders_reservations_turn_in_doubt_and_stop_blocking():
    """A holder that never comes back (SIGKILLed actor) must not park everyone else on "wait" forever."""
    clock = Clock()
    b = BudgetLedger({"d": 100}, lease_s=60, clock=clock)
    assert b.reserve("d", 50, holder="A") == "granted"
    assert b.reserve("d", 50, holder="A") == "granted"
    assert b.reserve("d", 50, holder="B") == "wait"  # A's requests may still settle low
    clock.t += 30
    assert b.reserve("d", 50, holder="B") == "wait"  # A's lease is still alive
    clock.t += 31
    # A silent for 61 s: its 100 tokens are in doubt, counted as spent (they may have been billed)
    assert b.reserve("d", 50, holder="B") == "exhausted"
    acc = b.account("d")
    assert (acc.spent, acc.reserved, acc.in_doubt) == (100, 0, 100)


def test_a_late_settle_replaces_the_doubt_by_the_bill():
    clock = Clock()
    b = BudgetLedger({"d": 100}, lease_s=60, clock=clock)
    b.reserve("d", 50, holder="A")
    b.reserve("d", 50, holder="A")
    clock.t += 61
    b.expire()
    assert b.account("d").in_doubt == 100
    b.settle("d", 50, 10, holder="A")  # A was frozen, not dead: its answer came back billing 10
    acc = b.account("d")
    assert (acc.spent, acc.in_doubt, acc.reserved) == (60, 50, 0)
    assert b.reserve("d", 40, holder="A") == "granted"  # a fresh lease for A's new requests
    b.release("d", 50, holder="A")  # the other in-doubt request billed nothing
    b.settle("d", 40, 40, holder="A")
    acc = b.account("d")
    assert (acc.spent, acc.in_doubt, acc.reserved) == (50, 0, 0) and not b.violations


def test_a_holder_that_beats_keeps_its_lease():
    clock = Clock()
    led = Ledger({"d": 100}, lease_s=60)
    led.budget.clock = clock
    led.apply([("reserve", "d", 100, 0.0)], "A")
    for _ in range(5):
        clock.t += 40
        led.apply([], "A")  # the client's heartbeat while its request is in flight
        assert led.apply([("reserve", "d", 10, 0.0)], "B")[0] == ["wait"]
    assert led.report()["datasets"]["d"]["in_doubt"] == 0


def test_dollar_budget_caps_prompt_and_completion_cost_together():
    b = BudgetLedger({"d": None}, budgets_usd={"d": 1.0}, strict=True)
    assert b.reserve("d", 100, 0.4) == "granted"
    assert b.reserve("d", 100, 0.4) == "granted"
    assert b.reserve("d", 100, 0.4) == "wait"
    b.settle("d", 100, 90, 0.15, reserved_usd=0.4)  # the provider's usage.cost
    assert b.reserve("d", 100, 0.4) == "granted"
    b.settle("d", 100, 90, None, reserved_usd=0.4)  # no usage.cost: the whole dollar reservation stays spent
    acc = b.account("d")
    assert acc.spent_usd == pytest.approx(0.55) and acc.unpriced == 1 and acc.reserved_usd == pytest.approx(0.4)
    assert b.reserve("d", 100, 0.4) == "wait"
    b.settle("d", 100, 90, 0.3, reserved_usd=0.4)
    assert b.reserve("d", 100, 0.4) == "exhausted"  # 0.85 spent: 0.4 more can never fit
    assert b.account("d").spent_usd == pytest.approx(0.85)


def test_unknown_price_sends_one_request_at_a_time():
    b = BudgetLedger(budgets_usd={"d": 0.05})
    nan = float("nan")
    assert b.reserve("d", 10, nan) == "granted"
    assert b.reserve("d", 10, nan) == "wait"  # the probe holds all that is left
    assert b.account("d").reserved_usd == pytest.approx(0.05)
    b.settle("d", 10, 10, 0.02, reserved_usd=nan)
    assert b.reserve("d", 10, nan) == "granted"
    b.settle("d", 10, 10, None, reserved_usd=nan)  # no usage.cost either: the rest counts as spent
    assert b.reserve("d", 10, nan) == "exhausted"
    assert b.account("d").spent_usd == pytest.approx(0.05) and not b.violations


def test_unlimited_is_explicit_and_bad_budgets_are_refused():
    b = BudgetLedger({"d": "unlimited"}, budgets_usd={"d": "unlimited"})
    assert all(b.reserve("d", 10**9, 10.0**6) == "granted" for _ in range(3))
    for bad in (-1, "lots", 1.5, True):
        with pytest.raises(ValueError):
            BudgetLedger({"d": bad})
    with pytest.raises(ValueError):
        BudgetLedger(budgets_usd={"d": float("inf")})


@settings(max_examples=60, deadline=None)
@given(budget=st.floats(0, 5), asks=st.lists(st.tuples(st.floats(0.01, 1), st.floats(0, 1), st.booleans(),
                                                         st.sampled_from(["A", "B", "C"])), max_size=60),
       lapse=st.integers(0, 59))
def test_dollar_budget_never_exceeded_even_when_holders_die(budget, asks, lapse):
    """Bills <= reservations, holders vanishing at random (their reservations lapse): spend stays under the cap."""
    clock = Clock()
    b = BudgetLedger(budgets_usd={"d": budget}, strict=True, lease_s=60, clock=clock)
    open_: list[tuple[str, float]] = []
    for i, (ask, frac, settle_now, holder) in enumerate(asks):
        if b.reserve("d", 1, ask, holder=holder) == "granted":
            open_.append((holder, ask))
        if settle_now and open_:
            h, reserved = open_.pop(0)
            b.settle("d", 1, 1, reserved * frac, reserved_usd=reserved, holder=h)
        if i == lapse:
            clock.t += 61  # every holder silent: all open reservations in doubt
    acc = b.account("d")
    assert acc.spent_usd + acc.reserved_usd <= budget + 1e-9


def test_journal_v2_restores_dollars_too(tmp_path):
    from pipeline.generate.ledger import read_journal_both

    journal = str(tmp_path / "ledger.json")
    first = Ledger(budgets_usd={"d": 1.0}, journal=journal)
    first.apply([("reserve", "d", 10, 0.3), ("reserve", "d", 10, 0.3)], "A")
    first.apply([("settle", "d", 10, 5, 0.1, "p", "ok", 0, 0.3)], "A")
    assert read_journal_both(journal) == ({"d": 15}, {"d": pytest.approx(0.4)})
    second = Ledger(budgets_usd={"d": 1.0}, journal=journal)
    assert second.apply([("reserve", "d", 1, 0.61)], "B")[0] == ["exhausted"]
    assert second.apply([("reserve", "d", 1, 0.6)], "B")[0] == ["granted"]


def test_a_dead_probes_holder_does_not_keep_the_next_probe_waiting():
    clock = Clock()
    b = BudgetLedger(budgets_usd={"d": 1.0}, lease_s=60, clock=clock)
    nan = float("nan")
    assert b.reserve("d", 10, nan, holder="A") == "granted"  # a probe: holds the whole dollar budget
    assert b.reserve("d", 10, nan, holder="B") == "wait"
    clock.t += 61
    # A died: its probe is in doubt (the whole budget counted as spent), so nothing more can ever fit
    assert b.reserve("d", 10, nan, holder="B") == "exhausted"
    b.settle("d", 10, 10, 0.1, reserved_usd=nan, holder="A")  # A was only frozen: its bill replaces the doubt
    acc = b.account("d")
    assert acc.spent_usd == pytest.approx(0.1) and acc.in_doubt_usd == pytest.approx(0.0) and not b.violations
    assert b.reserve("d", 10, nan, holder="B") == "granted"


def test_a_holder_back_from_a_lapse_settles_old_and_new_reservations_by_their_own_amounts():
    clock = Clock()
    b = BudgetLedger({"d": 1000}, budgets_usd={"d": 10.0}, lease_s=60, clock=clock, strict=True)
    b.reserve("d", 50, 2.0, holder="A")
    clock.t += 61
    b.expire()
    b.reserve("d", 50, 0.5, holder="A")  # back from a freeze: a new reservation of another amount
    b.settle("d", 50, 40, 0.3, reserved_usd=0.5, holder="A")  # the new one settles first
    b.settle("d", 50, 45, 1.5, reserved_usd=2.0, holder="A")  # then the one that was in doubt
    acc = b.account("d")
    assert (acc.reserved, acc.in_doubt, acc.spent) == (0, 0, 85)
    assert acc.reserved_usd == pytest.approx(0) and acc.in_doubt_usd == pytest.approx(0)
    assert acc.spent_usd == pytest.approx(1.8) and not b.violations


def test_a_probe_takes_what_priced_requests_leave():
    """Actor A has learnt the price and keeps priced requests in flight; actor B's first (unpriced) request still
    goes out, holding the rest of the budget, instead of waiting for A to fall idle."""
    b = BudgetLedger(budgets_usd={"d": 1.0})
    assert b.reserve("d", 10, 0.3, holder="A") == "granted"
    assert b.reserve("d", 10, float("nan"), holder="B") == "granted"
    assert b.account("d").reserved_usd == pytest.approx(1.0)
    assert b.reserve("d", 10, 0.3, holder="A") == "wait"


def test_a_ledger_whose_run_lost_its_lock_grants_nothing_and_leaves_the_journal_alone(tmp_path):
    from pipeline.base.run_lock import RunLock

    journal = str(tmp_path / "ledger-api.json")
    lock = RunLock.for_folder(tmp_path, heartbeat_s=30, settle_s=0).acquire()
    try:
        led = Ledger({"d": 100}, journal=journal, lock=(str(lock.path), lock.token))
        assert led.apply([("reserve", "d", 10, 0.0)], "A")[0] == ["granted"]
        led.halt("out of credits (402)")  # an earlier halt must not hide a later loss of the lock
        theirs = RunLock.for_folder(tmp_path / "x")  # stands in for the run that took the folder over
        lock.path.write_text(lock.path.read_text().replace(lock.token, theirs.token))
        before = (tmp_path / "ledger-api.json").read_bytes()
        led._lock_checked = 0.0
        led.apply([("settle", "d", 10, 10, 0.0, "p", "ok", 0, 0.0)], "A")
        assert led.lock_lost and "run lock lost" in led.lock_lost
        assert (tmp_path / "ledger-api.json").read_bytes() == before  # the new holder's ledger owns it now
    finally:
        lock.release()


def test_one_ops_accounting_error_halts_without_failing_its_batch():
    led = Ledger({"d": 100})
    res, _, halted = led.apply([("reserve", "d", 10, 0.0), ("release", "d", 99, "p", "ok", 0.0),
                                ("settle", "d", 10, 5, 0.0, "p", "ok", 0, 0.0)], "A")
    assert res == ["granted", None, None] and halted and "ledger error on release" in halted
    assert led.report()["datasets"]["d"]["spent"] == 5  # the good settle after the bad op still counted


def test_the_journal_restores_every_committed_dollar_not_a_rounded_down_one(tmp_path):
    journal = str(tmp_path / "ledger.json")
    first = Ledger(budgets_usd={"d": 1.0}, journal=journal)
    assert first.apply([("reserve", "d", 0, 0.9999999994)], "A")[0] == ["granted"]  # in flight at the kill
    second = Ledger(budgets_usd={"d": 1.0}, journal=journal)
    assert second.budget.accounts["d"].spent_usd >= 0.9999999994
    assert second.apply([("reserve", "d", 0, 1e-9)], "B")[0] == ["exhausted"]  # it would bill past the cap


def test_grants_of_a_batch_that_cannot_be_journaled_are_taken_back(tmp_path, monkeypatch):
    import math

    from pipeline.base import layout
    from pipeline.generate.ledger import read_journal_both

    journal = str(tmp_path / "ledger.json")
    led = Ledger({"d": 100}, budgets_usd={"d": 1.0}, journal=journal)
    real = layout.atomic_write_json

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(layout, "atomic_write_json", disk_full)
    res, _, halted = led.apply([("reserve", "d", 30, 0.2), ("reserve", "e", 5, math.nan)], "A")
    assert res == ["halted", "halted"] and halted and "journal" in halted
    monkeypatch.setattr(layout, "atomic_write_json", real)
    led.apply([("settle", "d", 0, 0, 0.0, "p", "ok", 0, 0.0)], "B")  # a later write journals what is held
    for name in ("d", "e"):
        acc = led.budget.accounts[name]
        assert (acc.reserved, acc.reserved_usd, acc.sent, acc.probes) == (0, 0.0, 0, {})
    assert read_journal_both(journal) == ({"d": 0, "e": 0}, {})  # never sent: no spend a resume counts


def test_a_holder_that_lapses_twice_mid_probe_settles_each_probe_by_its_own_amount():
    import math

    clock = Clock()
    b = BudgetLedger(budgets_usd={"d": 1.0}, lease_s=10, clock=clock, strict=True)
    assert b.reserve("d", 10, 0.5, holder="B") == "granted"
    assert b.reserve("d", 10, math.nan, holder="A") == "granted"  # a probe: holds the other $0.5
    clock.t += 20
    b.touch("B")
    assert b.expire() == ["A"]
    b.release("d", 10, reserved_usd=0.5, holder="B")
    assert b.reserve("d", 10, math.nan, holder="A") == "granted"  # A is back and probes again ...
    clock.t += 20
    assert b.expire() == ["A"]  # ... and lapses again
    b.settle("d", 10, 10, 0.4, reserved_usd=math.nan, holder="A")  # the late bills, one by one
    b.settle("d", 10, 10, 0.3, reserved_usd=math.nan, holder="A")
    acc = b.accounts["d"]
    assert (acc.spent_usd, acc.in_doubt, acc.in_doubt_usd, acc.reserved) == (pytest.approx(0.7), 0, 0.0, 0)
    assert not b.violations
