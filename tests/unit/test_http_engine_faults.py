"""The HTTP engine's second layer of faults, in process against the local stand-in server (no Ray): config
errors halt instead of quarantining, moderation quarantines one prompt, odd answers are outcomes, one row's bug
never takes its siblings, keys stay home, a journal that cannot be written stops spending, budget held by a dead
actor's requests never parks a prompt forever, and a new actor replays what another actor of the folder paid."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from pipeline.base.layout import RunLayout
from pipeline.demo.openrouter_server import CannedBackend, ServerConfig
from pipeline.generate.ledger import Ledger
from pipeline.generate.sources.http.config import OpenRouterSourceConfig
from pipeline.generate.sources.http.engine import key_may_go_to
from pipeline.generate.sources.http.journal import JournalError
from pipeline.generate.sources.http.openrouter import OpenRouterGenerator
from pipeline.profiles import load_profile
from tests.helpers.server import serve_in_thread

KEY_ENV = "HTTP_ENGINE_FAULTS_KEY"
KEY = "sk-or-v1-enginefaults-0a1b2c3d4e5f6a7b"
MODEL = "tiny/deepseek-tiny"


@pytest.fixture(scope="module")
def profile():
    return load_profile("deepseek")


def rows_(n: int, dataset: str = "d", markers: dict[int, str] | None = None) -> list[dict]:
    out = []
    for i in range(n):
        text = f"Question {i} of {dataset}?" + (f" [[fault:{markers[i]}]]" if markers and i in markers else "")
        out.append({"sample_id": f"{dataset}:{i}", "dataset": dataset, "row_index": i,
                    "messages": json.dumps([{"role": "user", "content": text}]), "tools": "", "thinking": False,
                    "prompt_ids": [0, 5, 6], "prompt_assistant_mask": [0, 0, 0]})
    return out


def cfg_(url: str, **over) -> OpenRouterSourceConfig:
    base = dict(model=MODEL, base_url=url, api_key_required=False, max_attempts=3, backoff_base_s=0.01,
                backoff_max_s=0.05, request_timeout_s=5.0, tune_gc=False, max_in_flight=4,
                sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 32, "seed": 0},
                config_error_wait_s=5.0)
    base.update(over)
    return OpenRouterSourceConfig.model_validate(base)


def run(gen: OpenRouterGenerator, rows: list[dict]) -> dict[str, dict]:
    async def go():
        try:
            return await gen(rows)
        finally:
            await gen.close()

    return {r["sample_id"]: r for r in asyncio.run(go()).to_pylist()}


def test_a_config_error_halts_the_source_and_quarantines_nothing_then_the_fixed_config_passes(profile):
    rows = rows_(12)
    server_cfg = ServerConfig(seed=1, known_models=(MODEL,))
    with serve_in_thread(server_cfg, CannedBackend(1, profile)) as (url, server):
        bad = cfg_(url, model="tiny/deepseek-tnyi")  # a typo'd model id: 404 "No endpoints found" on every prompt
        ledger = Ledger()
        out = run(OpenRouterGenerator(bad, "deepseek", None, ledger), rows)
        asked = server.counts.get("status_404", 0)
        assert Counter(r["status"] for r in out.values()) == {"not_generated": 12}
        assert {r["failure_class"] for r in out.values()} == {"config"}
        assert all("config error" in r["error"] and "No endpoints found" in r["error"] for r in out.values())
        assert ledger.report()["halted"].startswith("config error")
        assert asked <= bad.config_error_prompts + bad.max_in_flight  # stopped at once, not 12 requests
        good = run(OpenRouterGenerator(cfg_(url), "deepseek", None, Ledger()), rows)
    assert Counter(r["status"] for r in good.values()) == {"ok": 12}


def test_one_bad_prompt_among_good_ones_is_still_quarantined(profile):
    """A 400 followed by successes is the prompt's own fault: the streak never reaches the config threshold."""
    rows = rows_(8, markers={3: "400"})
    with serve_in_thread(ServerConfig(seed=2), CannedBackend(1, profile)) as (url, _):
        ledger = Ledger()
        out = run(OpenRouterGenerator(cfg_(url), "deepseek", None, ledger), rows)
    assert out["d:3"]["status"] == "quarantined" and out["d:3"]["failure_class"] == "sample"
    assert Counter(r["status"] for r in out.values()) == {"ok": 7, "quarantined": 1}
    assert ledger.report()["halted"] is None


@pytest.mark.parametrize(("what", "server_over", "markers"), [
    ("max_tokens past the context", {"context_tokens": 24}, None),  # every prompt: 32 output tokens asked
    ("no detail", {}, "400"),  # "Bad Request" on every prompt (a setting some upstream rejects, say)
    ("a malformed answer", {}, "always-choices-object"),  # an endpoint that is not what base_url should be
])
def test_the_same_refusal_on_every_prompt_halts_as_config_and_quarantines_nothing(profile, what, server_over,
                                                                                 markers):
    """A refusal that could be a prompt's own (too long, no detail, a malformed answer) but comes back for every
    prompt is the config's: the source halts, every row left to do, none quarantined for good."""
    rows = rows_(10, markers=dict.fromkeys(range(10), markers) if markers else None)
    with serve_in_thread(ServerConfig(seed=11, **server_over), CannedBackend(1, profile)) as (url, _):
        ledger = Ledger()
        out = run(OpenRouterGenerator(cfg_(url), "deepseek", None, ledger), rows)
    assert Counter(r["status"] for r in out.values()) == {"not_generated": 10}, what
    assert {r["failure_class"] for r in out.values()} == {"config"}
    assert ledger.report()["halted"].startswith("config error")


@pytest.mark.parametrize("marker", ["context", "400", "always-choices-object"])
def test_one_prompt_refused_so_among_answered_ones_is_its_own_fault(profile, marker):
    """The same refusal on one prompt while the others are answered: that prompt's own (quarantined), after
    retries where the refusal says nothing yet (no detail, a malformed answer)."""
    rows = rows_(8, markers={5: marker})
    with serve_in_thread(ServerConfig(seed=12), CannedBackend(1, profile)) as (url, server):
        ledger = Ledger()
        out = run(OpenRouterGenerator(cfg_(url, max_in_flight=2), "deepseek", None, ledger), rows)
        counts = dict(server.counts)
    assert out["d:5"]["status"] == "quarantined" and out["d:5"]["failure_class"] == "sample", out["d:5"]
    assert Counter(r["status"] for r in out.values()) == {"ok": 7, "quarantined": 1}
    assert out["d:5"]["attempts"] == (1 if marker == "context" else 3)
    assert ledger.report()["halted"] is None, counts


def test_a_moderation_403_quarantines_that_prompt_and_the_source_goes_on(profile):
    rows = rows_(6, markers={2: "moderation"})
    with serve_in_thread(ServerConfig(seed=3), CannedBackend(1, profile)) as (url, _):
        ledger = Ledger()
        out = run(OpenRouterGenerator(cfg_(url), "deepseek", None, ledger), rows)
    assert out["d:2"]["status"] == "quarantined" and "violence" in out["d:2"]["error"]
    assert Counter(r["status"] for r in out.values()) == {"ok": 5, "quarantined": 1}
    assert ledger.report()["halted"] is None


def test_odd_answer_shapes_are_outcomes(profile):
    rows = rows_(6, markers={0: "always-choices-object", 1: "always-content-parts", 2: "always-usage-string"})
    with serve_in_thread(ServerConfig(seed=4), CannedBackend(1, profile)) as (url, server):
        ledger = Ledger({"d": 10_000})
        out = run(OpenRouterGenerator(cfg_(url), "deepseek", None, ledger), rows)
        billed = server.counts["billed_completion_tokens"]
    assert out["d:0"]["status"] == "quarantined" and "choices" in out["d:0"]["error"]
    assert out["d:1"]["status"] == "ok" and out["d:1"]["content"] and out["d:1"]["output_ids"]
    assert out["d:2"]["status"] == "ok" and out["d:2"]["billed_completion_tokens"] == -1
    spent = ledger.report()["datasets"]["d"]["spent"]
    assert billed <= spent  # the unknown bill was charged as its whole reservation


def test_one_rows_bug_never_takes_its_siblings(profile, monkeypatch):
    rows = rows_(6)
    with serve_in_thread(ServerConfig(seed=5), CannedBackend(1, profile)) as (url, _):
        gen = OpenRouterGenerator(cfg_(url), "deepseek", None, Ledger())
        real = gen.engine._sample

        def broken(row, *a, **k):
            if row["sample_id"] == "d:4":
                raise RuntimeError("a bug in the engine")
            return real(row, *a, **k)

        monkeypatch.setattr(gen.engine, "_sample", broken)
        out = run(gen, rows)
    assert out["d:4"]["status"] == "not_generated" and "internal error" in out["d:4"]["error"]
    assert Counter(r["status"] for r in out.values()) == {"ok": 5, "not_generated": 1}


def test_the_default_key_never_leaves_for_another_host(profile, monkeypatch):
    """OPENROUTER_API_KEY in the shell and a source pointed at another server: no Authorization header goes
    there (the server, which wants a key, answers 401: the key was not sent)."""
    monkeypatch.setenv("OPENROUTER_API_KEY", KEY)
    monkeypatch.setenv(KEY_ENV, KEY)
    rows = rows_(3)
    with serve_in_thread(ServerConfig(seed=6, api_key_env=KEY_ENV), CannedBackend(1, profile)) as (url, server):
        default = run(OpenRouterGenerator(cfg_(url), "deepseek", None, Ledger()), rows)
        named = run(OpenRouterGenerator(cfg_(url, api_key_env=KEY_ENV), "deepseek", None, Ledger()), rows)
        assert server.counts.get("status_401", 0) >= 1
    assert {r["failure_class"] for r in default.values()} == {"account"}
    assert {r["status"] for r in named.values()} == {"ok"}  # the variable the source names itself does go
    assert key_may_go_to("https://openrouter.ai/api/v1/chat/completions")
    assert key_may_go_to("http://127.0.0.1:9/x") and key_may_go_to("http://localhost:9/x")
    assert key_may_go_to("http://[::1]:9/x")
    assert not key_may_go_to("http://10.0.0.5:8000/v1/chat/completions")
    assert not key_may_go_to("http://gateway.internal/v1") and not key_may_go_to("ftp://x/y")


def test_a_journal_that_cannot_be_written_stops_the_source(profile, tmp_path, monkeypatch):
    rows = rows_(10)
    with serve_in_thread(ServerConfig(seed=7), CannedBackend(1, profile)) as (url, server):
        ledger = Ledger()
        gen = OpenRouterGenerator(cfg_(url, max_in_flight=1), "deepseek", None, ledger, layout=RunLayout(tmp_path))

        def full(record):
            raise JournalError("journal x: [Errno 28] No space left on device")

        monkeypatch.setattr(gen.engine.journal, "append", full)
        out = run(gen, rows)
        sent = server.counts["requests"]
    assert ledger.report()["halted"] and "journal" in ledger.report()["halted"]
    assert sent <= 2  # the first paid answer that could not be journaled stopped the sending
    assert out["d:0"]["status"] == "ok"  # what was paid is still a sample
    left = [r for r in out.values() if r["status"] == "not_generated"]
    assert len(left) >= 8 and all("journal" in r["error"] for r in left)


def test_budget_held_by_a_dead_holder_never_parks_a_prompt_forever(profile):
    rows = rows_(4)
    with serve_in_thread(ServerConfig(seed=8), CannedBackend(1, profile)) as (url, server):
        cfg = cfg_(url, budget_wait_max_s=0.5, budget_poll_s=0.05)
        ledger = Ledger({"d": 100}, lease_s=3600)
        ledger.apply([("reserve", "d", 90, 0.0)], "dead-actor")  # reserved, then its actor was SIGKILLed
        held = run(OpenRouterGenerator(cfg, "deepseek", None, ledger), rows)
        assert server.counts.get("requests", 0) == 0
        assert {r["failure_class"] for r in held.values()} == {"budget"}
        assert all("held by requests in flight" in r["error"] for r in held.values())

        lapsing = Ledger({"d": 100}, lease_s=0.2)
        lapsing.apply([("reserve", "d", 90, 0.0)], "dead-actor")
        out = run(OpenRouterGenerator(cfg_(url, budget_poll_s=0.05), "deepseek", None, lapsing), rows)
    # the dead holder's lease lapsed: its 90 tokens count as spent (in doubt), the rest cannot fit a request
    assert {r["failure_class"] for r in out.values()} == {"budget"}
    assert all("is spent" in r["error"] for r in out.values())
    assert lapsing.report()["datasets"]["d"]["in_doubt"] == 90


def test_a_new_actor_replays_what_another_actor_of_the_folder_was_billed_for(profile, tmp_path):
    """Actor A is paid for 8 answers and dies before its batch is written; actor B, started afterwards on the
    same folder (or alive all along: it re-reads the journals before each batch), asks for none of them."""
    rows = rows_(12)
    with serve_in_thread(ServerConfig(seed=9), CannedBackend(1, profile)) as (url, server):
        cfg = cfg_(url)
        b_alive = OpenRouterGenerator(cfg, "deepseek", None, Ledger(), layout=RunLayout(tmp_path))
        first = run(OpenRouterGenerator(cfg, "deepseek", None, Ledger(), layout=RunLayout(tmp_path)), rows[:8])
        assert server.counts["requests"] == 8
        again = run(OpenRouterGenerator(cfg, "deepseek", None, Ledger(), layout=RunLayout(tmp_path)), rows)
        assert server.counts["requests"] == 12  # only the 4 never asked
        alive = run(b_alive, rows[:8])
        assert server.counts["requests"] == 12
    for sid, r in first.items():
        assert again[sid]["generation_id"] == r["generation_id"] == alive[sid]["generation_id"]
        assert again[sid]["output_ids"] == r["output_ids"]

def paid_then_corrupted(url: str, folder, rows: list[dict], sample_id: str, key: str,
                        value) -> tuple[dict[str, dict], object, int]:
    """A first attempt pays for ``rows`` into ``folder``'s journal; then ``sample_id``'s line gets ``key: value``.
    Returns the first attempt's rows, the journal's path and the byte the changed line starts at."""
    first = run(OpenRouterGenerator(cfg_(url), "deepseek", None, Ledger(), layout=RunLayout(folder)), rows)
    (path,) = RunLayout(folder).responses.glob("*.jsonl")
    lines = path.read_bytes().splitlines(keepends=True)
    at = next(i for i, ln in enumerate(lines) if json.loads(ln)["sample_id"] == sample_id)
    lines[at] = json.dumps({**json.loads(lines[at]), key: value}).encode() + b"\n"
    path.write_bytes(b"".join(lines))
    return first, path, sum(len(ln) for ln in lines[:at])



# content: the rebuild failed, so the prompt was asked (and paid for) again without a word; finish_reason and
# t_generate_s: the sample row failed its whole batch at the Arrow conversion, on every resume.
@pytest.mark.parametrize(("key", "value"), [("content", 5), ("content", ["a"]), ("finish_reason", 7),
                                            ("t_generate_s", "x")])
def test_a_journaled_response_of_the_wrong_type_is_left_to_do_naming_its_line_never_paid_again(
        profile, tmp_path, key, value):
    """A resume meets a paid response whose journal line holds a field of the wrong type: that row is left to
    do (class ``journal``), its reason naming the file, the line and the field, with no request sent, on every
    actor that meets it; the other rows replay as usual (no request sent for them in this attempt: attempts 0)."""
    rows = rows_(4)
    with serve_in_thread(ServerConfig(seed=9), CannedBackend(1, profile)) as (url, server):
        first, path, byte = paid_then_corrupted(url, tmp_path, rows, "d:2", key, value)
        for _ in range(2):  # a later resume meets it again: still held, still no request
            again = run(OpenRouterGenerator(cfg_(url), "deepseek", None, Ledger(), layout=RunLayout(tmp_path)),
                        rows)
            assert server.counts["requests"] == 4
            held = again["d:2"]
            assert (held["status"], held["failure_class"], held["attempts"]) == ("not_generated", "journal", 0)
            assert f"{path}, the line at byte {byte}: {key} must be" in held["error"]
            assert "paid for" in held["error"] and "repair or delete that line" in held["error"]
            for sid in ("d:0", "d:1", "d:3"):
                assert again[sid]["status"] == "ok" and again[sid]["attempts"] == 0
                assert again[sid]["output_ids"] == first[sid]["output_ids"]


# Counted fields (the ones the totals and the replay index read): such a line was skipped whole, so its prompt,
# paid for, was not known as answered and a resume asked (and paid for) it again.
COUNTED_WRONG = [("cost", "0.5"), ("billed_completion_tokens", "12"), ("charged_tokens", 1.5),
                 ("generation_id", 7), ("kind", 5), ("source", 5), ("dataset", 5), ("at", "x")]


@pytest.mark.parametrize(("key", "value"), COUNTED_WRONG, ids=[f"{k}={v!r}" for k, v in COUNTED_WRONG])
def test_a_journaled_response_whose_counted_field_is_of_the_wrong_type_is_held_never_paid_again(
        profile, tmp_path, caplog, key, value):
    """A resume meets a paid response whose journal line holds a counted field of the wrong type, its sample id
    still reading: as for a replayed field, the row is left to do (class ``journal``), its reason naming the
    file, the line and the field, with no request sent, on every resume; the other rows replay as usual."""
    rows = rows_(4)
    with serve_in_thread(ServerConfig(seed=9), CannedBackend(1, profile)) as (url, server):
        first, path, byte = paid_then_corrupted(url, tmp_path, rows, "d:2", key, value)
        for _ in range(2):  # a later resume meets it again (from the projection a reader stored): still held
            with caplog.at_level("WARNING"):
                again = run(OpenRouterGenerator(cfg_(url), "deepseek", None, Ledger(),
                                                layout=RunLayout(tmp_path)), rows)
            assert server.counts["requests"] == 4
            held = again["d:2"]
            assert (held["status"], held["failure_class"], held["attempts"]) == ("not_generated", "journal", 0)
            assert f"{path}, the line at byte {byte}: " in held["error"] and key in held["error"]
            assert "paid for" in held["error"] and "repair or delete that line" in held["error"]
            assert "its prompt d:2 is held as paid" in caplog.text
            caplog.clear()
            for sid in ("d:0", "d:1", "d:3"):
                assert again[sid]["status"] == "ok" and again[sid]["attempts"] == 0
                assert again[sid]["output_ids"] == first[sid]["output_ids"]


def test_a_journaled_response_in_which_no_sample_id_reads_is_asked_again_and_said(profile, tmp_path, caplog):
    """Where not even the line's sample id reads, no prompt can be held: that prompt is asked (and paid for)
    again, and the warning says so, naming the file and the line."""
    rows = rows_(4)
    with serve_in_thread(ServerConfig(seed=9), CannedBackend(1, profile)) as (url, server):
        run(OpenRouterGenerator(cfg_(url), "deepseek", None, Ledger(), layout=RunLayout(tmp_path)), rows)
        (path,) = RunLayout(tmp_path).responses.glob("*.jsonl")
        lines = path.read_bytes().splitlines(keepends=True)
        at = next(i for i, ln in enumerate(lines) if json.loads(ln)["sample_id"] == "d:2")
        lines[at] = json.dumps({**json.loads(lines[at]), "sample_id": 2}).encode() + b"\n"
        path.write_bytes(b"".join(lines))
        byte = sum(len(ln) for ln in lines[:at])
        with caplog.at_level("WARNING"):
            again = run(OpenRouterGenerator(cfg_(url), "deepseek", None, Ledger(), layout=RunLayout(tmp_path)),
                        rows)
        assert server.counts["requests"] == 5 and again["d:2"]["status"] == "ok" and again["d:2"]["attempts"] == 1
    assert f"{path}: skipping the unreadable line at byte {byte}" in caplog.text
    assert "may be asked (and paid for) again" in caplog.text


def test_a_failure_billed_in_dollars_only_is_settled_not_released(profile, monkeypatch):
    from pipeline.generate.sources.http import engine as http_engine
    from pipeline.generate.sources.http.wire import Failure

    def billed_error(status, raw, retry_after, key):  # finish_reason "error", 0 completion tokens, usage.cost 0.004
        return Failure("in_band", "finish_reason error: upstream", True, 200, None, "P", 0, 0.004)

    monkeypatch.setattr(http_engine, "_interpret", billed_error)
    with serve_in_thread(ServerConfig(seed=10), CannedBackend(1, profile)) as (url, _):
        ledger = Ledger(budgets_usd={"d": 1.0})
        cfg = cfg_(url, max_attempts=2, prices={"prompt_usd_per_mtok": 1.0, "completion_usd_per_mtok": 1.0})
        out = run(OpenRouterGenerator(cfg, "deepseek", None, ledger), rows_(3))
    assert {r["status"] for r in out.values()} == {"not_generated"}
    d = ledger.report()["datasets"]["d"]
    assert d["spent_usd"] == pytest.approx(3 * 2 * 0.004) and d["released"] == 0


def test_a_dollar_cap_without_prices_learns_them_and_holds(profile):
    """No prices configured: the first request is a probe holding the rest of the budget; from its bill the
    engine bounds each token price and asks with them. The provider's own bill stays under the cap."""
    cap = 0.2  # a request costs ~$0.007; the learnt bounds ask ~$0.06: a few fit, not all 20
    # prompt tokens billed as the rendered prompt's (10 for these rows)
    with serve_in_thread(ServerConfig(seed=11, prompt_price_per_token=4e-4, price_per_token=1e-4),
                         CannedBackend(1, profile)) as (url, server):
        ledger = Ledger(budgets_usd={"d": cap})
        out = run(OpenRouterGenerator(cfg_(url), "deepseek", None, ledger), rows_(20))
        billed_usd = server.counts.get("billed_cost_nano_usd", 0) / 1e9
    passed = sum(r["status"] == "ok" for r in out.values())
    assert 1 < passed < 20 and {r["failure_class"] for r in out.values() if r["status"] != "ok"} == {"budget"}
    d = ledger.report()["datasets"]["d"]
    assert billed_usd <= d["spent_usd"] + 1e-9 <= cap + 1e-9 and not ledger.report()["violations"]


def dear_later_run(profile, guard: str, seed: int) -> tuple[dict[str, dict], float, float, dict]:
    """200 prompts under a $0.002 cap with no prices configured, on providers billing 1x, 40x and 40x."""
    cap = 0.002
    server_cfg = ServerConfig(seed=seed, price_per_token=1e-6, prompt_price_per_token=1e-7, price_factors=(1, 40, 40))
    with serve_in_thread(server_cfg, CannedBackend(200, profile)) as (url, server):  # 200 ms: many in flight
        cfg = cfg_(url, max_in_flight=32, default_budget="unlimited", default_budget_usd=cap, max_price_guard=guard)
        out = run(OpenRouterGenerator(cfg, "deepseek", None, Ledger(default_budget_usd=cap)), rows_(200))
        counts = dict(server.counts)
    return out, counts.get("billed_cost_nano_usd", 0) / 1e9, cap, counts


def test_a_dollar_cap_holds_when_later_providers_are_dearer_than_the_first(profile):
    """No prices configured: the first answer teaches the price, and later requests may be routed to dearer
    providers. Each request after it carries provider.max_price at the rates its reservation assumed, so no
    provider dearer than that serves it: the provider's own bill stays under the cap, demand far above it."""
    out, billed, cap, counts = dear_later_run(profile, "auto", seed=1)
    statuses = Counter(r["status"] for r in out.values())
    assert billed <= cap, (billed, counts)
    assert statuses["ok"] >= 100 and statuses["not_generated"] > 0, statuses  # the cap bound
    assert {r["failure_class"] for r in out.values() if r["status"] == "not_generated"} == {"budget"}
    # without the guard, the same run is billed past the cap: the test can fail
    _, unguarded, _, _ = dear_later_run(profile, "off", seed=1)
    assert unguarded > cap


def test_prices_below_every_provider_halt_the_source_as_config_and_bill_nothing(profile):
    """`prices` lower than what any provider charges: max_price leaves no provider, OpenRouter answers 404 "No
    allowed providers", and the same answer on every prompt halts the source with its rows left to do."""
    with serve_in_thread(ServerConfig(seed=13, price_per_token=1e-6), CannedBackend(1, profile)) as (url, server):
        cfg = cfg_(url, default_budget="unlimited", default_budget_usd=1.0,
                   prices={"prompt_usd_per_mtok": 0.01, "completion_usd_per_mtok": 0.5})  # providers bill 1-3 $/Mtok
        ledger = Ledger(default_budget_usd=1.0)
        out = run(OpenRouterGenerator(cfg, "deepseek", None, ledger), rows_(8))
        counts = dict(server.counts)
    assert Counter(r["status"] for r in out.values()) == {"not_generated": 8}
    assert {r["failure_class"] for r in out.values()} == {"config"}
    assert "No allowed providers" in ledger.report()["halted"]
    assert counts.get("billed_cost_nano_usd", 0) == 0 and counts.get("status_404", 0) >= 3


def test_provider_errors_inside_a_padded_200_are_retried_and_charge_nothing(profile):
    """Behind whitespace padding a provider's 429/502/503 can only come as ``{"error"}`` in a 200 body (no
    Retry-After): retried like the statuses, left to do, and the budget charges only what the providers billed."""
    rows = rows_(6, markers={1: "always-429", 2: "always-502", 3: "always-503"})
    with serve_in_thread(ServerConfig(seed=5, padding=16), CannedBackend(1, profile)) as (url, server):
        ledger = Ledger({"d": 10_000})
        out = run(OpenRouterGenerator(cfg_(url), "deepseek", None, ledger), rows)
        counts = dict(server.counts)
    for i in (1, 2, 3):
        r = out[f"d:{i}"]
        assert r["status"] == "not_generated" and r["failure_class"] == "transient" and r["attempts"] == 3, r
        assert "in_band" in r["error"], r  # told inside the 200 body, not by the status
    assert Counter(r["status"] for r in out.values()) == {"ok": 3, "not_generated": 3}
    assert counts["status_429"] == counts["status_502"] == counts["status_503"] == 3, counts
    d = ledger.report()["datasets"]["d"]
    assert d["spent"] == counts["billed_completion_tokens"] == sum(r["billed_completion_tokens"] for r in out.values()
                                                                   if r["status"] == "ok"), d


@pytest.mark.parametrize("fault", ["native-finish", "reasoning-details", "no-usage", "no-cost"])
def test_irregular_successes_are_samples_with_their_reasoning_and_a_safe_bill(profile, fault):
    """A provider's own finish word, reasoning only in reasoning_details, no usage, no usage.cost: every prompt is
    a sample whose ids are what the server generated; an unknown bill charges the whole reservation."""
    rows = [dict(r, thinking=True) for r in rows_(4, markers=dict.fromkeys(range(4), f"always-{fault}"))]
    with serve_in_thread(ServerConfig(seed=6), CannedBackend(1, profile)) as (url, server):
        ledger = Ledger({"d": 10_000}, budgets_usd={"d": 10.0})
        cfg = cfg_(url, prices={"prompt_usd_per_mtok": 1.0, "completion_usd_per_mtok": 10.0})
        out = run(OpenRouterGenerator(cfg, "deepseek", None, ledger), rows)
        billed, served = server.counts["billed_completion_tokens"], server.counts.get(f"fault_{fault}", 0)
    assert Counter(r["status"] for r in out.values()) == {"ok": 4} and served == 4, (served, out)
    for r in out.values():
        assert r["reasoning"] and len(r["output_ids"]) == billed // 4 and profile.think_end_id in r["output_ids"], r
    d = ledger.report()["datasets"]["d"]
    assert d["spent"] == (4 * 32 if fault == "no-usage" else billed), d  # 32: max_tokens, the reservation
    for name, st in ledger.report()["providers"].items():  # the text was rebuilt to what was billed
        assert st["invalid"] == 0 and not st["mean_abs_billing_drift"], (name, st)


def test_a_prompt_nested_deeper_than_the_request_writer_takes_is_quarantined_unsent(profile):
    """Tools nested 300 levels deep read (orjson reads 1,024, a .json list file has no cap of its own) but orjson
    writes only 254: the prompt cannot be sent, on any run. It is quarantined as its own fault, no request made;
    it was an internal error, left to do on every run."""
    deep: dict = {"type": "string"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"x": deep}}
    tools = json.dumps([{"type": "function", "function": {"name": "f", "parameters": deep}}])
    rows = rows_(3)
    rows[1]["tools"] = tools
    with serve_in_thread(ServerConfig(seed=21), CannedBackend(1, profile)) as (url, server):
        out = run(OpenRouterGenerator(cfg_(url, send_tools=True), "deepseek", None, Ledger({"d": 10_000})), rows)
        counts = dict(server.counts)
    bad = out["d:1"]
    assert bad["status"] == "quarantined" and bad["failure_class"] == "sample" and bad["attempts"] == 0, bad
    assert bad["error"].startswith("prompt cannot be sent"), bad["error"]
    assert [out[i]["status"] for i in ("d:0", "d:2")] == ["ok", "ok"] and counts["requests"] == 2, counts
