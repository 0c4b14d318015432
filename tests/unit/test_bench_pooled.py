"""bench.pooled: the per-round ratios it pools and how it reads a goal (logic only; the runs are
bench.serving_overhead's JSON)."""

from __future__ import annotations

import pytest

from bench.pooled import correlation, parts, pool, pooled_interval, round_ratios, same_state, state_split, verdict


def result(vllm: list, daemon: list) -> dict:
    keys = ("output_throughput", "cpu_ms_per_token", "p50_ttft_ms", "p50_itl_ms")
    return {"rows": [{"key": k, "vllm_serve": vllm, "daemon": daemon} for k in keys]}


def test_a_round_without_a_figure_is_left_out():
    assert round_ratios(result([10.0, 0.0, 10.0], [9.0, 5.0, None]), "daemon")["p50_ttft_ms"] == [0.9]


def test_the_interval_resamples_runs_before_rounds():
    steady = [[1.0] * 10, [1.0] * 10]
    assert pooled_interval(steady) == (1.0, 1.0)
    # an hour of one round far from an hour of nineteen: pooled as rounds, the one would never move
    # the median; resampled as runs, it is drawn twice a quarter of the time and spans the interval
    assert pooled_interval([[0.9], [1.1] * 19]) == (0.9, 1.1)


def test_a_goal_is_resolved_only_when_the_whole_interval_is_on_one_side():
    assert verdict(1.10, (1.06, 1.16), "<=", 1.05) == "missed, resolved"
    assert verdict(1.03, (0.99, 1.07), "<=", 1.05) == "met, within the noise"
    assert verdict(0.96, (0.93, 0.99), ">=", 0.98) == "missed, within the noise"


def test_pool_lists_each_runs_median_beside_the_pooled_one():
    runs = {"a": result([10.0, 10.0], [9.0, 9.5]), "b": result([10.0, 10.0], [10.0, 10.5])}
    g = pool(runs, "daemon")["output_throughput"]
    assert g["runs"] == {"a": 0.925, "b": 1.025} and g["rounds"] == 4
    assert g["median"] == 0.975 and g["verdict"].startswith("missed")


def gauged(vllm: list, daemon: list, vllm_gauge: list, daemon_gauge: list) -> dict:
    r = result(vllm, daemon)
    r["rows"].append({"key": "host_python_ms", "vllm_serve": vllm_gauge, "daemon": daemon_gauge})
    return r


def test_same_state_keeps_the_rounds_whose_two_windows_ran_on_one_host_state():
    # round 0 same state, round 1 the daemon's window slow, round 2 vllm serve's, round 3 no gauge
    r = gauged([10.0, 10.0, 10.0, 10.0], [9.0, 6.0, 14.0, 8.0], [0.8, 0.8, 1.3, None], [0.85, 1.3, 0.8, 0.8])
    assert same_state(r, "daemon", 0.1) == [True, False, False, False]
    assert state_split(r, "daemon", 0.1) == (1, 1, 1)
    assert round_ratios(r, "daemon", keep=same_state(r, "daemon", 0.1))["output_throughput"] == [0.9]
    assert pool({"a": r}, "daemon", 0.1)["output_throughput"]["rounds"] == 1


def test_a_run_without_the_gauge_has_no_round_in_one_known_state():
    r = result([10.0, 10.0], [9.0, 9.5])
    assert same_state(r, "daemon", 0.1) == [] and state_split(r, "daemon", 0.1) == (0, 0, 0)
    assert round_ratios(r, "daemon", keep=[])["p50_ttft_ms"] == []


def test_parts_pool_each_parts_difference_by_round_and_its_correlation_with_the_ttft():
    def run(ttft, between, outside, other="daemon"):
        return {"rows": [{"key": "p50_ttft_ms", "vllm_serve": [20.0] * len(ttft), other: ttft},
                         {"key": "ttft_between_ms", "vllm_serve": [10.0] * len(ttft), other: between},
                         {"key": "ttft_outside_ms", "vllm_serve": [5.0] * len(ttft), other: outside}]}
    # the TTFT's difference follows the way to the engine core, not what comes before vLLM
    a = run([21.0, 23.0, 22.0], [11.0, 13.0, 12.0], [6.0, 6.0, 3.0])
    b = run([22.0, None], [12.0, 12.5], [5.5, 5.0])
    got = parts({"a": a, "b": b}, "daemon")
    assert got["p50_ttft_ms"]["rounds"] == 4 and got["p50_ttft_ms"]["median"] == 2.0
    assert got["ttft_between_ms"]["rounds"] == 5 and got["ttft_between_ms"]["positive"] == 5
    assert got["ttft_between_ms"]["r_with_ttft"] == pytest.approx(1.0)  # the round without a TTFT is not paired
    assert abs(got["ttft_outside_ms"]["r_with_ttft"]) < 0.1
    assert "ttft_queue_ms" not in got  # not measured by these runs
    # against another kind, and only the rounds kept
    c = run([21.0, 25.0, 21.5], [11.0, 14.0, 11.0], [5.0, 5.0, 5.0], other="daemon_standby_none")
    for row in c["rows"]:
        row["daemon"] = [x + 1.0 for x in row["daemon_standby_none"]]
    kept = parts({"c": c}, "daemon", "daemon_standby_none", keep={"c": [True, False, True]})
    assert kept["p50_ttft_ms"]["rounds"] == 2 and kept["p50_ttft_ms"]["median"] == 1.0


def test_correlation_needs_three_pairs_and_a_moving_series():
    assert correlation([1.0, 2.0], [1.0, 2.0]) is None
    assert correlation([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None
    assert correlation([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == -1.0


def test_state_keeps_the_one_state_rounds_of_the_state_named():
    # fast in one state, slow in one state, mixed, fast in one state, within 10 % but either side of 1.1 ms
    r = gauged([10.0] * 5, [9.0, 8.0, 7.0, 9.5, 6.0], [0.85, 1.3, 0.85, 0.9, 1.05], [0.9, 1.35, 1.3, 0.88, 1.15])
    assert same_state(r, "daemon", 0.1) == [True, True, False, True, True]
    assert same_state(r, "daemon", 0.1, state="fast") == [True, False, False, True, False]
    assert same_state(r, "daemon", 0.1, state="slow") == [False, True, False, False, False]
    assert pool({"a": r}, "daemon", 0.1, state="slow")["output_throughput"]["median"] == 0.8


def test_the_correlation_is_taken_within_runs():
    # within each run the two move oppositely; the runs' levels alone would make them agree
    xs, ys, runs = [1.0, 2.0, 11.0, 12.0], [2.0, 1.0, 12.0, 11.0], ["a", "a", "b", "b"]
    assert correlation(xs, ys) > 0.9
    assert correlation(xs, ys, runs) == pytest.approx(-1.0)
