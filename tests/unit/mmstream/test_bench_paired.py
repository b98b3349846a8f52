"""Paired rounds (``--vs server --rounds N``): each round's ratios of the pipeline run over the
baseline run right after it, and their median and range per rate."""

import pytest

from mmstream.bench.config import BenchConfig
from mmstream.bench.paired import pair, text_table


def run(mode, rate, number, cpu, text_p95, text_p99=None):
    # Arrivals are Poisson: what each run achieved differs from the rate asked, run to run.
    offered = rate * (0.95 + 0.01 * number + (0.005 if mode == "server" else 0.0))
    return {"mode": mode, "config": {"rate": rate}, "offered_rate": offered, "round": number, "cpu": {"per_request_ms": cpu},
            "latency_ms": {"text": {"e2e": {"p50": 10.0, "p95": text_p95, "p99": text_p99 or 2 * text_p95}}}}


def test_each_round_is_read_against_its_own_baseline_and_the_rounds_give_a_median_and_range() -> None:
    runs = [run("pipeline", 45.0, 1, 28.0, 150.0), run("server", 45.0, 1, 16.0, 100.0),
            run("pipeline", 45.0, 2, 23.0, 100.0), run("server", 45.0, 2, 16.5, 125.0),
            run("pipeline", 45.0, 3, 30.0, 210.0), run("server", 45.0, 3, 18.0, 140.0)]
    [p] = pair(runs, "pipeline", "server")
    assert p["rate"] == 45.0 and [r["round"] for r in p["rounds"]] == [1, 2, 3]
    assert [r["cpu_per_request"] for r in p["rounds"]] == [1.75, 1.394, 1.667]
    assert p["ratios"]["cpu_per_request"] == {"median": 1.667, "min": 1.394, "max": 1.75}
    assert p["ratios"]["text_p95"]["median"] == 1.5
    # Pairing each round with its own server run is not the ratio of the medians (28.0 / 16.5 = 1.70).
    assert "image_p99" not in p["ratios"]  # no image requests in either run: no ratio, no crash
    assert "median 1.67  (1.39-1.75)" in text_table([p])
    # Light load is bounded in ms over the baseline, not as a ratio.
    assert [r["text_p95_ms_over"] for r in p["rounds"]] == [50.0, -25.0, 70.0]
    assert p["over_ms"]["text_p95_ms_over"] == {"median": 50.0, "min": -25.0, "max": 70.0}
    assert p["over_ms"]["text_p50_ms_over"]["median"] == 0.0
    assert "text_p95_ms_over median +50.0 ms  (-25.0 to +70.0)" in text_table([p])


def test_rates_are_paired_apart_and_a_round_missing_a_side_or_a_value_is_left_out() -> None:
    runs = [run("pipeline", 10.0, 1, 20.0, 50.0), run("server", 10.0, 1, 10.0, 25.0),
            run("pipeline", 20.0, 1, 30.0, 60.0), run("server", 20.0, 1, 15.0, 30.0),
            run("pipeline", 20.0, 2, 33.0, 60.0)]  # its server run never came
    runs.append(run("server", 20.0, 3, 15.0, 30.0))
    runs.append({**run("pipeline", 20.0, 3, 45.0, 60.0), "cpu": {"per_request_ms": None}})  # nothing answered
    low, high = pair(runs, "pipeline", "server")
    assert (low["rate"], high["rate"]) == (10.0, 20.0)
    assert low["ratios"]["cpu_per_request"]["median"] == 2.0
    assert [r["round"] for r in high["rounds"]] == [1, 3]
    assert high["rounds"][1]["cpu_per_request"] is None and high["rounds"][1]["text_p95"] == 2.0
    assert high["ratios"]["cpu_per_request"] == {"median": 2.0, "min": 2.0, "max": 2.0}


def test_a_baseline_pairs_only_pipeline_runs_of_one_modality_traffic() -> None:
    assert BenchConfig(workload="capacity", vs="server", rounds=5).rounds == 5
    for bad in ({"vs": "server", "mode": "server"}, {"vs": "pipeline"}, {"vs": "server", "workload": "mixed"},
                {"vs": "monolithic", "workload": "fairness"}, {"vs": "server", "rate_schedule": ((10.0, 5.0),)},
                {"rounds": 0}):
        with pytest.raises(ValueError):
            BenchConfig(**bad)
    assert BenchConfig(workload="mixed", vs="monolithic").vs == "monolithic"
