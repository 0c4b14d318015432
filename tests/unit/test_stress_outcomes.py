"""``chaos.stress``'s outcome classification and checks, on hand-made records and reports
(the real run is ``tests/chaos/test_load_faults.py``)."""

from __future__ import annotations

import copy

from chaos.load import RequestRecord
from chaos.stress import EXPECTED_REASON, classify, failures


def rec(**kw) -> RequestRecord:
    r = RequestRecord(0, "p", 48)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_a_503_is_retriable_only_as_a_status_before_any_token_with_retry_after():
    assert classify(rec(outcome="error", status=503, retry_after="5")) == "retriable"
    assert classify(rec(outcome="error", status=503, retry_after=None)) == "failed"
    assert classify(rec(outcome="error", status=500, retry_after="5")) == "failed"
    # a 503 error event in a stream that already delivered tokens: a failure, not a retry
    mid = rec(outcome="error", error="RuntimeError: stream error: {'code': 503}", text="Once upon",
              chunk_times=[1.0, 2.0], token_ids=[1, 2])
    assert classify(mid) == "failed_after_tokens"
    # an error event before any token (the response had started with 200): not the documented 503
    assert classify(rec(outcome="error", error="RuntimeError: stream error: 503", chunk_times=[1.0])) == "failed"
    assert classify(rec(outcome="error", error="APIConnectionError: 503?")) == "failed"
    for kind in ("ok", "hung_up", "past_deadline", "pending"):
        assert classify(rec(outcome=kind)) == kind


def good_report() -> dict:
    faults = [{"fault": f, "reason": EXPECTED_REASON[f], "streams_running": 20,
               "hang_ups": {"hung_up": 4, "parked_before": 20, "parked_after": 16, "state_before": "recovering",
                            "state_after": "recovering", "ok": True},
               "burst": {"sent": 80, "ok": 60, "rejected_503": 20, "with_retry_after": 20}} for f in EXPECTED_REASON]
    stats = {"rss_kib": 600_000, "fds": 120, "threads": 37}
    return {
        "queue": 64, "burst_extra": 16, "faults_planned": list(EXPECTED_REASON), "faults": faults,
        "close": {"exit_code": 0, "left_after_stop": "none", "cluster_after_stop": {"placement_groups": [], "actors": []}},
        "outcome": {
            "requests": 1000, "ok_exact": 980, "mismatched": 0, "tokens_duplicated": 0, "retriable_errors": 12,
            "failed_after_tokens": 0, "other_errors": [], "hung_up": 8, "hung_up_in_recovery": 12,
            "past_deadline": 0, "lost": 0, "clients_crashed": [], "daemon_counted": {"ok": 1000, "continued": 160},
            "daemon_served": 1160, "clients_read_whole": 1160,
            "bursts": {"sent": 240, "ok_exact": 180, "mismatched": 0, "rejected_503": 60,
                       "rejected_with_retry_after": 60, "other": []},
            "hang_up_check": {"ok": True}, "after_load": {"ok": True},
            "daemon_before": stats, "daemon_after": dict(stats, rss_kib=620_000),
        },
    }


def broken(change) -> list[str]:
    report = copy.deepcopy(good_report())
    change(report)
    return failures(report)


def test_the_good_report_passes():
    assert failures(good_report()) == []


def test_each_broken_behaviour_fails():
    o = lambda r: r["outcome"]  # noqa: E731
    cases = {
        "failed_after_tokens": lambda r: o(r).update(failed_after_tokens=3),
        "below the floor": lambda r: o(r).update(ok_exact=800, retriable_errors=40),
        "above the cap": lambda r: o(r).update(retriable_errors=60),
        "lost": lambda r: o(r).update(lost=1),
        "the daemon served": lambda r: o(r).update(daemon_served=1164),
        "admission limit was not reached": lambda r: o(r)["bursts"].update(rejected_503=0, rejected_with_retry_after=0),
        "admission burst": lambda r: o(r)["bursts"].update(rejected_with_retry_after=59),
        "recovered as 'worker_death', not 'engine_dead'": lambda r: r["faults"][1].update(reason="worker_death"),
        "recovered as 'engine_dead', not 'hang'": lambda r: r["faults"][2].update(reason="engine_dead"),
        "hung up while parked": lambda r: r["faults"][0]["hang_ups"].update(parked_after=20, ok=False),
        "left after the load": lambda r: o(r)["after_load"].update(ok=False, engine_running_waiting=4),
        "grew over the load": lambda r: o(r)["daemon_after"].update(fds=400),
        "'rss_kib'": lambda r: o(r)["daemon_after"].update(rss_kib=1_200_000),
    }
    for expected, change in cases.items():
        fails = broken(change)
        assert any(expected in f for f in fails), (expected, fails)
