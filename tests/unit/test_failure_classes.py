"""Failure classes and the circuit breaker: pure rules, no network."""

from __future__ import annotations

import pytest

from pipeline.generate.ledger import Ledger
from pipeline.generate.sources.http.circuit import Circuit
from pipeline.generate.sources.http.wire import interpret


@pytest.mark.parametrize("status,cls", [(400, "sample"), (401, "account"), (402, "account"), (403, "account"),
                                        (404, "sample"), (408, "transient"), (429, "transient"),
                                        (500, "transient"), (502, "transient"), (503, "transient"),
                                        (504, "transient"), (524, "transient"), (529, "transient")])
def test_http_statuses_fall_into_classes(status, cls):
    f = interpret(status, b'{"error": {"code": %d, "message": "x"}}' % status)
    assert f.failure_class == cls
    # an error status bills nothing, but a proxy's timeout: the origin may have generated (and billed) behind it
    assert f.maybe_billed == (status in (408, 504, 524))


def test_a_moderation_403_is_the_prompts_not_the_accounts():
    body = (b'{"error": {"code": 403, "message": "Input was flagged", "metadata": {"reasons": ["violence"], '
            b'"flagged_input": "some text", "provider_name": "P"}}}')
    f = interpret(403, body)
    assert f.failure_class == "sample" and "violence" in f.message and f.signature is None
    assert interpret(403, b'{"error": {"code": 403, "message": "Key not allowed"}}').failure_class == "account"


def test_signatures_tell_a_config_error_from_prompts_too_long():
    a = interpret(404, b'{"error": {"code": 404, "message": "No endpoints found for tiny-typo."}}')
    b = interpret(404, b'{"error": {"code": 404, "message": "No endpoints found for tiny-typo."}}')
    assert a.signature is not None and a.signature == b.signature
    long_ = interpret(400, b'{"error": {"code": 400, "message": "This model\'s maximum context length is 8192 '
                           b'tokens, you requested 9000"}}')
    longer = interpret(400, b'{"error": {"code": 400, "message": "This model\'s maximum context length is 8192 '
                            b'tokens, you requested 12000"}}')
    # one signature for every too-long prompt: the streak tells max_tokens past the context (every prompt) from
    # one long prompt among answered ones (its own fault)
    assert long_.failure_class == "sample" and long_.signature is not None and long_.signature == longer.signature


def test_in_band_errors_and_cut_bodies():
    credits = interpret(200, b'{"error": {"code": 402, "message": "Insufficient credits"}}')
    assert credits.failure_class == "account"
    cut = interpret(200, b'   {"id": "gen-1", "choices": [{"message": {"content": "hel')
    assert cut.failure_class == "transient" and cut.maybe_billed  # generated and billed, then cut in transit
    billed = interpret(200, b'{"choices": [], "usage": {"completion_tokens": 7}}')
    assert billed.failure_class == "transient" and billed.billed == 7 and not billed.maybe_billed
    unknown = interpret(200, b'{"choices": [{"finish_reason": "error", "message": {"content": ""}}]}')
    assert unknown.failure_class == "transient" and unknown.maybe_billed  # no usage: the bill is unknown


def test_circuit_opens_probes_and_closes():
    c = Circuit(threshold=3, cooldown_s=10, max_cooldown_s=40, give_up_s=100)
    for t in range(3):
        assert c.admit(t) == "go"
        c.record(False, t, "502")
    assert c.is_open and c.admit(5) == "wait"
    assert c.admit(12.5) == "go" and c.admit(12.6) == "wait"  # one probe only
    c.record(False, 13, "502")  # the probe failed: twice the cool-down
    assert c.admit(22) == "wait" and c.admit(33.5) == "go"
    c.record(True, 34)
    assert not c.is_open and c.admit(35) == "go"


def test_circuit_gives_up_after_its_limit_and_successes_reset_the_count():
    c = Circuit(threshold=2, cooldown_s=1, max_cooldown_s=1, give_up_s=5)
    c.record(False, 0, "refused")
    c.record(True, 0.5)
    c.record(False, 1, "refused")
    assert not c.is_open  # not two in a row
    c.record(False, 2, "refused")
    assert c.is_open and c.admit(6.9) in ("go", "wait") and c.admit(7.1) == "give_up"
    assert "refused" in c.describe(7.1)


def test_ledger_halt_refuses_every_later_reservation():
    led = Ledger({"d": 1000})
    assert led.reserve("d", 10) == "granted"
    res, _, halted = led.apply([("halt", "out of credits (402)"), ("reserve", "d", 10)])
    assert res == [None, "halted"] and halted == "out of credits (402)"
    led.apply([("halt", "second reason")])
    assert led.report()["halted"] == "out of credits (402)"  # the first cause is kept
    led.apply([("settle", "d", 10, 4, 0.0, "p", "ok", 0)])
    rep = led.report()["datasets"]["d"]
    assert (rep["sent"], rep["settled"], rep["released"], rep["reserved"]) == (1, 1, 0, 0)


def test_a_probe_that_never_went_out_leaves_the_next_one_free():
    c = Circuit(threshold=2, cooldown_s=1, max_cooldown_s=4, give_up_s=100)
    c.record(False, 0, "502")
    c.record(False, 0, "502")
    assert c.admit(1.5) == "go" and c.admit(1.6) == "wait"  # the probe is out
    c.unsent()  # its budget was held: nothing was sent
    assert c.admit(1.7) == "go"
