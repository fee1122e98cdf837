"""The plan spends toward the steeper curve, keeps to whole samples and to the prompts left, refuses a budget
that buys no sample, and predicts its gain with a spread beside an even split's."""

from __future__ import annotations

import pytest

from pipeline.value.curves import Curve
from pipeline.value.plan import Buyable, PlanRefused, allocate, even_split, make_plan, plan_lines

STEEP = Curve(a0=2.0, gain=2.0, half=1.0)  # still far from its ceiling at $1
FLAT = Curve(a0=3.0, gain=0.3, half=0.2)  # nearly saturated at $1


def _buys(room_steep: int | None = None, draws: bool = False) -> list[Buyable]:
    def jitter(c: Curve) -> list[Curve]:
        return [Curve(c.a0, c.gain * (1 + d), c.half) for d in (-0.1, -0.05, 0.0, 0.05, 0.1)] if draws else []

    return [Buyable("steep", 0.01, 1.0, room_steep, STEEP, jitter(STEEP)),
            Buyable("flat", 0.01, 1.0, None, FLAT, jitter(FLAT))]


def test_the_budget_goes_mostly_to_the_steeper_curve_and_beats_an_even_split():
    plan = make_plan(_buys(draws=True), 2.0, train_share=0.9, now=3.0)
    add = {r["dataset"]: r["add_usd"] for r in plan["datasets"]}
    assert add["steep"] > 3 * add["flat"]
    assert plan["planned_usd"] == pytest.approx(2.0, abs=0.02) and plan["unspent_usd"] < 0.02
    assert plan["predicted"]["gain"] > plan["even_split"]["predicted"]["gain"] > 0
    assert plan["predicted"]["sd"] > 0 and plan["predicted"]["draws"] == 5
    for r in plan["datasets"]:  # whole samples
        assert r["add_usd"] == pytest.approx(r["add_samples"] * 0.01)
    lines = plan_lines(plan)
    assert lines[0].startswith("[plan] $2 more: predicted mix acceptance 3.000 -> ")
    assert any("steep: +$" in ln for ln in lines)


def test_a_gain_resting_on_extrapolated_curves_is_said_to_be_a_guess():
    far = make_plan(_buys(), 2.0, train_share=0.9, now=3.0)  # steep gets ~$1.8 of training on $1 measured
    assert far["extrapolated_gain"] == pytest.approx(
        sum(r["gain"] for r in far["datasets"] if r["extrapolated"]), abs=1e-3)
    assert far["extrapolated_gain"] > 0.5 * far["predicted"]["gain"]
    line = next(ln for ln in plan_lines(far) if "of the predicted gain is extrapolated" in ln)
    assert line.startswith(f"[plan]   {far['extrapolated_gain'] / far['predicted']['gain']:.0%} ")
    near = make_plan(_buys(), 0.5, train_share=0.9, now=3.0)  # within twice the measured spend
    assert near["extrapolated_gain"] == 0
    assert not any("extrapolated (" in ln for ln in plan_lines(near))


def test_greedy_allocation_matches_equal_marginal_gains():
    """For concave curves the optimum equalises the slopes where both get money."""
    alloc = allocate(_buys(), 10.0, train_share=1.0, steps=2000)
    s_steep, s_flat = 1.0 + alloc["steep"], 1.0 + alloc["flat"]
    assert alloc["flat"] > 0 and alloc["steep"] > alloc["flat"]
    assert STEEP.slope(s_steep) == pytest.approx(FLAT.slope(s_flat), rel=0.05)


def test_the_fractions_of_a_sample_are_spent_in_whole_samples():
    twins = [Buyable(d, 0.01, 1.0, None, STEEP) for d in ("x", "y")]
    alloc = allocate(twins, 0.019, train_share=1.0)
    assert sum(alloc.values()) == pytest.approx(0.01)


def test_a_dataset_takes_no_more_than_its_prompts_left():
    plan = make_plan(_buys(room_steep=20), 2.0, train_share=1.0, now=3.0)
    steep = next(r for r in plan["datasets"] if r["dataset"] == "steep")
    assert steep["add_samples"] == 20 and steep["full"]
    assert "no prompts left after it" in "\n".join(plan_lines(plan))
    assert even_split(_buys(room_steep=20), 2.0)["steep"] == pytest.approx(0.2)


def test_money_no_curve_gains_from_is_left_unspent():
    flat = [Buyable("done", 0.01, 1.0, None, Curve(3.0, 0.0, 1.0))]
    plan = make_plan(flat, 1.0, train_share=1.0, now=3.0)
    assert plan["planned_usd"] == 0 and plan["unspent_usd"] == 1.0
    assert "left unspent" in "\n".join(plan_lines(plan))


@pytest.mark.parametrize(("budget", "why"), [
    (0.005, "a budget of $0.005 buys no sample: the cheapest dataset, steep, costs $0.01 a sample"),
    (0.0, "positive number of dollars"),
    (float("nan"), "positive number of dollars"),
])
def test_a_budget_that_buys_no_sample_is_refused(budget, why):
    with pytest.raises(PlanRefused) as e:
        make_plan(_buys(), budget, train_share=1.0, now=3.0)
    assert why in str(e.value)


def test_unpriced_datasets_are_named_and_left_out():
    buys = [*_buys(), Buyable("free", 0.0, 0.0, None, STEEP)]
    plan = make_plan(buys, 1.0, train_share=1.0, now=3.0)
    assert plan["unpriced"] == ["free"] and "free" not in {r["dataset"] for r in plan["datasets"]}
    with pytest.raises(PlanRefused, match="no dataset has a price"):
        make_plan(buys[2:], 1.0, train_share=1.0, now=3.0)


def test_the_fragment_raises_a_token_cap_with_the_dollar_cap(tmp_path):
    """A source that caps a dataset in tokens too gets that cap raised by its share of the plan (at its own
    tokens per dollar so far); without it the follow-up run would stop at the old token cap, its dollars unspent.
    A dataset the source leaves without a token cap gets none, and a token cap is never lowered. Each cap holds
    one request's reservation more, so the planned rows, not the cap, end the run."""
    import json

    from pipeline.base.layout import RunLayout
    from pipeline.run.config import RunConfig
    from pipeline.run.plan import CAP_HEADROOM, fragment

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = RunConfig.model_validate({
        "output_dir": str(tmp_path / "out"), "model": {"profile": "deepseek"},
        "datasets": [{"name": n, "path": str(prompts)} for n in ("a", "b", "c")],
        "sources": [{"kind": "openrouter", "name": "api", "model": "m", "base_url": "http://127.0.0.1:9/v1",
                     "api_key_required": False, "budgets": {"a": 5000, "c": 10**9}, "budgets_usd": {"b": 1.0},
                     "default_budget_usd": 1.0}], "training": None})
    layout = RunLayout(cfg.output_dir)
    layout.root.mkdir(parents=True)
    # the ledger counted a little more than the samples show (a request billed, its answer lost)
    layout.ledger("api").write_text(json.dumps({"#format": 2, "tokens": {"a": 4200, "b": 900, "c": 10},
                                                "usd": {"a": 0.0042, "b": 0.0009, "c": 0.00001}}))
    plan = {"datasets": [{"dataset": "a", "add_usd": 0.002, "add_samples": 10},
                         {"dataset": "b", "add_usd": 0.001, "add_samples": 5},
                         {"dataset": "c", "add_usd": 0.0001, "add_samples": 1}]}
    rooms = {n: {"rows": 100, "read": 40, "passed": 40, "samples_left": 60} for n in "abc"}
    costs = {("api", "a"): 0.004, ("api", "b"): 0.0009, ("api", "c"): 0.00001}
    tokens = {("api", "a"): 4000, ("api", "b"): 900, ("api", "c"): 10}
    asks = {("api", "a"): 0.0003, ("api", "b"): 0.0002, ("api", "c"): float("nan")}  # c: no price seen yet
    frag = fragment(cfg, layout, plan, rooms, costs, tokens, asks)
    src = frag["sources"]["api"]
    # what the ledger counted + the plan's share with 20% headroom + one request's reservation (else the last
    # rows stay to do)
    assert CAP_HEADROOM == 1.2
    assert src["budgets_usd"] == {"a": 0.0069, "b": 0.0023, "c": 0.00013}
    # a: 4,200 counted + $0.002 × 1.2 at 1,000,000 tokens per dollar + max_tokens (128, the default);
    # c's cap is already far above
    assert src["budgets"] == {"a": 4200 + 2400 + 128, "c": 10**9}
    assert frag["datasets"] == {"a": {"max_rows": 50}, "b": {"max_rows": 45}, "c": {"max_rows": 41}}


@pytest.mark.parametrize(("value_steps", "training_steps", "said"), [
    (150, 500, True), (500, 500, False), (150, None, False), (None, 500, False), ("150", 500, False),
    (True, 1, False),
])
def test_value_drafters_of_another_length_than_the_training_are_named(value_steps, training_steps, said):
    from pipeline.run.plan import steps_caution

    caution = steps_caution(value_steps, training_steps)
    assert (caution is not None) == said
    if said:
        assert f"trained {value_steps} steps" in caution and f"--steps {training_steps}" in caution
