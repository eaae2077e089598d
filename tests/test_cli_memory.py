"""``betty estimate`` and ``betty calibrate`` through Typer's runner."""

from __future__ import annotations

import json

from test_workflow_support import invoke

LSTM = ["--set", "model.aggregator=lstm", "--set", "model.hidden=32", "--set", "dataset.num_nodes=1200"]


def test_estimate_measure_agrees_with_the_meter():
    res = invoke("estimate", "tiny", "--k", "3", "--measure", "--json", *LSTM)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["k"] == 3 and len(out["micro_batches"]) == 3
    for row in out["micro_batches"]:
        assert sum(row["components"].values()) == row["estimated_peak_bytes"]
        assert abs(row["relative_error"]) <= 0.05, row
    assert out["max_abs_relative_error"] <= 0.05


def test_estimate_auto_searches_k_for_the_budget():
    full = json.loads(invoke("estimate", "tiny", "--k", "1", "--json", *LSTM).stdout)
    budget = full["max_estimated_peak_bytes"] // 2
    res = invoke("estimate", "tiny", "--k", "auto", "--json", *LSTM,
                 "--set", f"partition.memory_budget={budget}", "--set", "partition.safety_margin=0.0")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["k"] > 1 and out["max_estimated_peak_bytes"] <= budget
    tried = {row["k"]: row["max_estimated_peak_bytes"] for row in out["k_tried"]}
    assert tried[out["k"]] <= budget
    assert all(peak > budget for k, peak in tried.items() if k < out["k"])


def test_estimate_prints_a_summary_and_micro_batches_only_on_request():
    full = json.loads(invoke("estimate", "tiny", "--k", "1", "--json", *LSTM).stdout)
    budget = full["max_estimated_peak_bytes"] // 4
    args = ["estimate", "tiny", "--k", "auto", *LSTM, "--set", f"partition.memory_budget={budget}",
            "--set", "partition.safety_margin=0.0"]
    out = json.loads(invoke(*args, "--json").stdout)
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert len(lines) <= 6 and not any(line.lstrip().startswith("micro-batch ") for line in lines)
    text = res.stdout
    assert f"K={out['k']}" in lines[0] and f"budget {budget / 2**20:.2f} MiB" in text
    tried = [row["k"] for row in out["k_tried"]]
    assert len(tried) > 1
    for k in tried:
        assert f" {k} (" in text.split("K tried:")[1], k
    worst = max(out["micro_batches"], key=lambda r: r["estimated_peak_bytes"])
    assert f"largest micro-batch: {worst['index']} of {out['k']}" in text
    listed = invoke(*args, "--micro-batches").stdout.splitlines()
    assert [line.split()[1] for line in listed if line.lstrip().startswith("micro-batch ")] == [
        str(i) for i in range(out["k"])]
    pointer = f"(--micro-batches lists all {out['k']} micro-batches)"
    assert pointer in text and pointer not in "\n".join(listed)  # no pointer to what is listed


def test_estimate_refuses_bad_k():
    res = invoke("estimate", "tiny", "--k", "zero", catch_exceptions=True)
    assert res.exit_code == 2 and "--k" in res.output


def test_calibrate_reports_constants_without_writing(tmp_path, monkeypatch):
    monkeypatch.setenv("BETTY_MEMORY_CONSTANTS", str(tmp_path / "constants.json"))
    res = invoke("calibrate", "--device", "cpu", "--no-write", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out and not (tmp_path / "constants.json").exists()


REV = ["--set", "dataset.num_nodes=600", "--set", "model.layers=6", "--set", "model.hidden=16",
       "--set", "partition.k=2"]


def test_estimate_covers_reversible_specs():
    res = invoke("estimate", "synthetic_revgnn", "--measure", "--json", *REV)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["k"] == 2 and len(out["num_nodes_per_part"]) == 2
    assert out["max_abs_relative_error"] <= 0.05
    one = json.loads(invoke("estimate", "synthetic_revgnn", "--json", *REV, "--k", "1").stdout)
    budget = int(0.7 * one["max_estimated_peak_bytes"])
    auto = json.loads(invoke("estimate", "synthetic_revgnn", "--json", *REV, "--k", "auto",
                             "--set", f"partition.memory_budget={budget}",
                             "--set", "partition.safety_margin=0.0").stdout)
    assert auto["k"] > 1 and auto["max_estimated_peak_bytes"] <= budget
    text = invoke("estimate", "synthetic_revgnn", *REV, "--micro-batches").stdout
    worst = max(out["micro_batches"], key=lambda r: r["estimated_peak_bytes"])  # --measure: the same estimates
    assert f"largest part: {worst['index']} of 2" in text and "largest part by component" in text
    assert [line.split()[1] for line in text.splitlines() if line.lstrip().startswith("part ")] == ["0", "1"]
    assert "micro-batch" not in text.replace("--micro-batches", "")
