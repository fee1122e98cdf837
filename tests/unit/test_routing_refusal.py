"""OpenRouter's own "no provider meets your routing" answer as a 503 (its error docs list it beside the 404 "No
allowed providers"): a config fault that waiting does not fix. Read as a 503 worth retrying, a `provider.only`
naming no provider retried every prompt, gave up after ``give_up_s`` and did the same on every re-run; now it
halts the source as config after ``config_error_prompts`` prompts, billing nothing, its rows left to do."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from pipeline.demo.openrouter_server import CannedBackend, ServerConfig
from pipeline.generate.ledger import Ledger
from pipeline.generate.sources.http.config import OpenRouterSourceConfig
from pipeline.generate.sources.http.openrouter import OpenRouterGenerator
from pipeline.generate.sources.http.wire import interpret
from pipeline.profiles import load_profile
from tests.helpers.server import serve_in_thread

MODEL = "tiny/deepseek-tiny"


def rows_(n: int) -> list[dict]:
    return [{"sample_id": f"d:{i}", "dataset": "d", "row_index": i, "tools": "", "thinking": False,
             "messages": json.dumps([{"role": "user", "content": f"Question {i}?"}]),
             "prompt_ids": [0, 5, 6], "prompt_assistant_mask": [0, 0, 0]} for i in range(n)]


@pytest.mark.parametrize("status", [404, 503])
def test_routing_that_leaves_no_provider_halts_the_source_as_config_whatever_the_status(status):
    cfg = OpenRouterSourceConfig.model_validate(dict(
        model=MODEL, api_key_required=False, max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.05,
        request_timeout_s=5.0, tune_gc=False, max_in_flight=2, config_error_wait_s=5.0,
        sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 32, "seed": 0},
        provider={"only": ["Nowhere"]}))
    with serve_in_thread(ServerConfig(seed=3, routing_status=status), CannedBackend(1, load_profile("deepseek"))) \
            as (url, server):
        ledger = Ledger()
        gen = OpenRouterGenerator(cfg.model_copy(update={"base_url": url}), "deepseek", None, ledger)

        async def go():
            try:
                return await gen(rows_(8))
            finally:
                await gen.close()

        out = asyncio.run(go()).to_pylist()
        counts = dict(server.counts)
    assert Counter(r["status"] for r in out) == {"not_generated": 8}
    assert {r["failure_class"] for r in out} == {"config"}
    halted = ledger.report()["halted"]
    assert ("routing requirements" if status == 503 else "No allowed providers") in halted, halted
    # the streak's prompts, each asked once (no retries of a 503 that waiting does not fix), nothing billed
    assert 3 <= counts[f"status_{status}"] <= 4 and counts.get("billed_cost_nano_usd", 0) == 0, counts


@pytest.mark.parametrize(("body", "klass"), [
    ({"error": {"code": 503, "message": "There is no available model provider that meets your routing "
                                        "requirements."}}, "sample"),
    ({"error": {"code": 503, "message": "No endpoints found matching your data policy"}}, "sample"),
    # a provider's own 503 names it: that provider's bad hour, retried
    ({"error": {"code": 503, "message": "No allowed providers are available",
                "metadata": {"provider_name": "Alpha"}}}, "transient"),
    ({"error": {"code": 503, "message": "Service Unavailable"}}, "transient"),
    ("<html>503 Service Unavailable</html>", "transient"),
])
def test_only_openrouters_own_routing_503_is_not_retried(body, klass):
    raw = json.dumps(body) if isinstance(body, dict) else body
    failure = interpret(503, raw.encode())
    assert failure.failure_class == klass and failure.retryable == (klass == "transient")
    assert (failure.signature is not None) == (klass == "sample")  # judged by the config streak
