"""The value curves' fit recovers known curves, says why it cannot fit, and its bootstrap spread follows the
points' errors; the arms' fractions nest; the mix figures combine the per-dataset held-out groups."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from pipeline.value.arms import (
    Arm,
    arm_settings,
    arm_spend,
    arm_trains,
    data_digest,
    last_metrics,
    value_arms,
    value_score,
)
from pipeline.value.curves import Curve, curve_draws, fit_curve, mean_sd
from pipeline.value.points import dataset_curves, dataset_points, heldout_mix, mix_figure, normalise_mix


@pytest.mark.parametrize(("a0", "gain", "half"), [(1.8, 1.5, 0.4), (2.5, 0.6, 3.0), (1.2, 3.0, 0.05)])
def test_fit_recovers_a_known_curve_from_exact_points(a0, gain, half):
    truth = Curve(a0, gain, half)
    x = [0.0, 0.25, 0.5, 1.0, 2.0]
    fit = fit_curve(x, [truth(v) for v in x])
    assert isinstance(fit, Curve)
    assert fit.a0 == pytest.approx(a0, rel=1e-4)
    assert fit.gain == pytest.approx(gain, rel=1e-3)
    assert fit.half == pytest.approx(half, rel=1e-3)
    assert fit.saturated


def test_fit_recovers_parameters_within_their_errors_from_noisy_points():
    truth = Curve(2.0, 1.2, 0.5)
    rng = np.random.default_rng(7)
    x = np.repeat([0.0, 0.25, 0.5, 1.0, 2.0, 4.0], 4)
    se = np.full(len(x), 0.01)
    fit = fit_curve(x, [truth(v) + rng.normal() * 0.01 for v in x], se)
    assert isinstance(fit, Curve)
    assert fit.a0 == pytest.approx(2.0, abs=0.02)
    assert fit(4.0) == pytest.approx(truth(4.0), abs=0.02)
    assert 0.5 < fit.rmse < 2.0  # residuals as large as the errors said


def test_a_straight_line_is_fitted_but_marked_unsaturated():
    fit = fit_curve([0.0, 1.0, 2.0, 3.0], [1.0, 1.1, 1.2, 1.3])
    assert isinstance(fit, Curve) and not fit.saturated
    assert fit.slope(1.5) == pytest.approx(0.1, rel=0.01)


@pytest.mark.parametrize(("x", "y", "why"), [
    ([0.0, 1.0], [1.0, 2.0], "distinct spends"),
    ([1.0, 1.0, 1.0], [1.0, 2.0, 3.0], "distinct spends"),
    ([0.0, 0.0, 0.0], [1.0, 2.0, 3.0], "distinct spends"),
    ([0.0, -1.0, 2.0], [1.0, 2.0, 3.0], "negative"),
    ([0.0, 1.0, 2.0], [1.0, float("nan"), 3.0], "finite"),
    ([0.0, 1.0, 2.0], [1.0, 2.0], "one of each"),
    ([0.0, 1e-323, 2e-323], [1.0, 2.0, 3.0], "cannot be fitted"),
    ([0.0, 1e306, 2e306], [1.0, 2.0, 3.0], "cannot be fitted"),
])
def test_fit_says_why_it_cannot_fit(x, y, why):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a reason, not numpy's overflow warning on the user's console
        out = fit_curve(x, y)
    assert isinstance(out, str) and why in out


def test_slope_is_the_derivative_and_the_curve_is_bounded():
    c = Curve(1.5, 2.0, 0.3)
    for s in (0.0, 0.1, 1.0, 10.0):
        h = 1e-6
        assert c.slope(s) == pytest.approx((c(s + h) - c(s)) / h, rel=1e-4)
    assert c(1e12) == pytest.approx(3.5) and c(-1.0) == c(0.0) == 1.5
    assert Curve.from_dict(c.to_dict()) == c


def test_bootstrap_spread_grows_with_the_points_errors():
    truth = Curve(2.0, 1.0, 0.5)
    x = [0.0, 0.25, 0.5, 1.0]
    y = [truth(v) for v in x]

    def spread(err: float) -> float:
        draws = curve_draws(x, y, [err] * len(x), n=40, seed=3)
        assert len(draws) >= 35
        return mean_sd([d(2.0) for d in draws])[1]

    small, large = spread(0.005), spread(0.05)
    assert 0 < small < large
    assert mean_sd([1.0]) == (1.0, 0.0) and math.isnan(mean_sd([])[0])


def test_arm_fractions_nest_and_the_full_arm_keeps_everything():
    ids = [f"s{i}" for i in range(2000)]
    quarter, half = Arm("a", 0.25, 0), Arm("a", 0.5, 0)
    kept_q = {s for s in ids if quarter.keeps(s, "a")}
    kept_h = {s for s in ids if half.keeps(s, "a")}
    assert kept_q < kept_h
    assert 0.2 < len(kept_q) / len(ids) < 0.3 and 0.45 < len(kept_h) / len(ids) < 0.55
    assert all(quarter.keeps(s, "b") for s in ids)  # other datasets stay whole
    assert not any(Arm("a", 0.0, 0).keeps(s, "a") for s in ids)
    assert all(0 <= value_score(s) < 1 for s in ids[:50])
    arms = value_arms(["a", "b"], (0.0, 0.5, 0.25, 1.0), seeds=(0, 1))
    assert [a.name for a in arms[:4]] == ["full.seed0", "a@0.seed0", "a@0.25.seed0", "a@0.5.seed0"]
    assert len(arms) == 2 * (1 + 2 * 3)


def test_arm_spend_counts_only_the_kept_samples():
    samples = [{"sample_id": f"s{i}", "dataset": "a" if i % 2 else "b", "usd": 0.01, "tokens": 10}
               for i in range(400)]
    full = arm_spend(Arm(None, 1.0, 0), samples)
    assert full["a"] == {"samples": 200, "usd": pytest.approx(2.0), "tokens": 2000}
    cut = arm_spend(Arm("a", 0.5, 0), samples)
    assert cut["b"] == full["b"] and 70 < cut["a"]["samples"] < 130
    assert cut["a"]["usd"] == pytest.approx(cut["a"]["samples"] * 0.01)
    assert arm_spend(Arm("a", 0.0, 0), samples)["a"]["samples"] == 0


def test_an_arm_trains_on_its_fraction_never_on_held_out_or_unknown_samples():
    from training.heldout import is_held_out

    datasets = {f"s{i}": "a" if i % 2 else "b" for i in range(1000)}
    held = {s for s in datasets if is_held_out(s, 0.1)}
    without_a = {s for s in datasets if arm_trains(Arm("a", 0.0, 0), s, datasets, 0.1)}
    assert without_a == {s for s, d in datasets.items() if d == "b"} - held
    full = {s for s in datasets if arm_trains(Arm(None, 1.0, 0), s, datasets, 0.1)}
    assert full == set(datasets) - held and 50 < len(held) < 150
    half_a = {s for s in datasets if arm_trains(Arm("a", 0.5, 0), s, datasets, 0.1)}
    assert without_a < half_a < full
    assert not arm_trains(Arm(None, 1.0, 0), "not-a-passed-sample", datasets, 0.1)


def test_an_arm_is_kept_across_runtime_settings_but_not_across_data_or_budget():
    arm, cfg = Arm("a", 0.5, 2), {"steps": 40, "resources_per_worker": {"CPU": 1.0}, "trackers": ["tensorboard"]}
    data = data_digest(["s1", "s2"], ["h1"], {"aux_layer_ids": [1, 2, 3]})
    same = arm_settings(arm, cfg, data)
    assert same["train"]["seed"] == 2 and "trackers" not in same["train"]
    assert arm_settings(arm, {**cfg, "resources_per_worker": {"CPU": 4.0}, "trackers": []}, data) == same
    assert arm_settings(arm, {**cfg, "steps": 41}, data) != same
    assert data_digest(["s2", "s1"], ["h1"], {"aux_layer_ids": [1, 2, 3]}) == data  # order does not matter
    for other in (data_digest(["s1", "s2", "s3"], ["h1"], {"aux_layer_ids": [1, 2, 3]}),
                  data_digest(["s1", "s2"], ["h1", "h2"], {"aux_layer_ids": [1, 2, 3]}),
                  data_digest(["s1", "s2"], ["h1"], {"aux_layer_ids": [1, 2]})):
        assert arm_settings(arm, cfg, other) != same
    assert [a.name for a in value_arms(["a", "a"], (0.0, 0.0), (0, 0))] == ["full.seed0", "a@0.seed0"]


def test_last_metrics_reads_the_last_whole_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert last_metrics(path) == {}
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')  # cut by a kill
    assert last_metrics(path) == {"step": 2, "loss": 1.5}


def _group(name: str, acc: float, se: float | None, drafts: int) -> dict:
    return {"name": name, "acceptance_length": acc, "se": se, "drafts": drafts}


def _result(dataset: str | None, fraction: float, groups: list[dict], usd: dict[str, float]) -> dict:
    arm = Arm(dataset, fraction, 0).to_dict()
    return {"arm": arm, "heldout": {"by_dataset": groups},
            "spend": {d: {"usd": u, "tokens": int(u * 1000), "samples": int(u * 10)} for d, u in usd.items()}}


def test_mix_figures_and_points_combine_the_groups():
    results = [
        _result(None, 1.0, [_group("a", 3.0, 0.1, 300), _group("b", 2.0, 0.2, 100)], {"a": 1.0, "b": 4.0}),
        _result("a", 0.0, [_group("a", 2.0, 0.1, 300), _group("b", 2.0, 0.2, 100)], {"a": 0.0, "b": 4.0}),
        _result("a", 0.5, [_group("a", 2.7, 0.1, 300), _group("b", 2.0, 0.2, 100)], {"a": 0.5, "b": 4.0}),
        _result("b", 0.5, [_group("a", 3.0, 0.1, 300), _group("b", 1.5, 0.2, 100)], {"a": 1.0, "b": 2.0}),
    ]
    mix = heldout_mix(results)
    assert mix == {"a": 0.75, "b": 0.25}
    acc, se = mix_figure(results[0]["heldout"], mix)
    assert acc == pytest.approx(2.75) and se == pytest.approx(math.hypot(0.075, 0.05))
    assert mix_figure(results[0]["heldout"], {"c": 1.0}) is None
    pts = dataset_points(results, "a", mix)
    assert [(p["fraction"], p["usd"]) for p in pts] == [(0.0, 0.0), (0.5, 0.5), (1.0, 1.0)]  # b's arm left out
    assert [p["own"] for p in pts] == [2.0, 2.7, 3.0]
    curves = dataset_curves(pts)
    assert isinstance(curves["usd"], dict) and curves["usd"]["gain"] > 0
    assert "distinct spends" in dataset_curves(dataset_points(results, "b", mix))["usd"]  # two points only
    assert normalise_mix({"a": 2, "b": 2}, ["a", "b"]) == {"a": 0.5, "b": 0.5}
    assert "no held-out figures for c" in normalise_mix({"c": 1}, ["a", "b"])
    assert "sum to 0" in normalise_mix({"a": 0}, ["a"])
