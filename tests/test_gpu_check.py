"""benchmarks/gpu_check.py runs on the host with --quick and writes a valid report.

The GPU check is only ever run for real on a borrowed GPU machine; this keeps it from
rotting. One subprocess run (``--device cpu --quick``, about 7 s of CPU) is shared by the
tests below, which validate the JSON's schema and its values: per-model worst estimate
error under the tolerances below (measured here on the quick run: sage-mean 0.23%,
sage-pool 0.04%, sage-lstm 0.70%, gat 0.24%, revgnn 0.42%), no budget overrun, every
budget run split (K > 1) and capped under its budget, the impossible budget refused with
the K search's error, a timed epoch split into the five phases at K = 1 and at the K
chosen for 25% of the K = 1 peak, and the pipeline's epochs in every mode (copy-ahead
included) with the serial run's updates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
MODELS = ("sage-mean", "sage-pool", "sage-lstm", "gat", "revgnn")
# worst |estimated - measured| / measured allowed per model on the host (a few times
# the errors measured, see the module docstring; the CUDA target is 3%)
TOLERANCE = {"sage-mean": 0.01, "sage-pool": 0.01, "sage-lstm": 0.02, "gat": 0.01,
             "revgnn": 0.01}
PHASES = ("sampling", "partitioning", "carving", "host_to_device", "compute")
PIPELINE_MODES = ("serial", "pipelined", "gathered_ahead", "device_preparation", "copy_ahead")

BACKENDS = [pytest.param("dgl", marks=pytest.mark.dgl), "pyg"]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), MLFLOW_DISABLE_TELEMETRY="true")
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", params=BACKENDS)
def report(request, tmp_path_factory) -> dict:
    """One quick run per backend (the GPU machine has no DGL: it runs ``--backend pyg``)."""
    pytest.importorskip("torch_geometric" if request.param == "pyg" else "dgl")
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    proc = _run("--device", "cpu", "--quick", "--backend", request.param, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "budget_overruns: 0" in proc.stdout
    return json.loads(out.read_text())


def test_top_level_schema(report):
    for key in ("schema", "estimate_error", "estimate_error_shipped", "budget_overruns",
                "environment", "settings", "calibration", "estimates", "budget", "timing",
                "pipeline", "phase_s", "wall_s"):
        assert key in report, key
    assert set(report["estimate_error"]) == set(MODELS)
    assert set(report["estimate_error_shipped"]) == set(MODELS)
    assert isinstance(report["budget_overruns"], int)
    env = report["environment"]
    assert env["device"] == "cpu" and env["torch"] and env["backend"] in ("dgl", "pyg")
    assert report["calibration"]["constants"]["source"] == "calibrated"
    assert report["calibration"]["shipped_constants"]["source"] in ("calibrated", "derived")


def test_estimate_error_per_model(report):
    for model in MODELS:
        err = report["estimate_error"][model]
        assert 0.0 <= err <= TOLERANCE[model], (model, err)
        assert report["estimate_error_shipped"][model] >= 0.0


def test_estimate_rows_cover_sizes_k_and_micro_batches(report):
    rows = report["estimates"]
    sizes = sorted({r["nodes"] for r in rows})
    assert len(sizes) == 2
    for model in MODELS:
        for n in sizes:
            for k in (1, 4):
                got = [r for r in rows if r["model"] == model and r["nodes"] == n and r["k"] == k]
                assert sorted(r["index"] for r in got) == list(range(k)), (model, n, k)
    for model in MODELS:  # the top-level figure is the worst row, recomputed
        errs = [abs(r["estimated_calibrated"] - r["measured"]) / r["measured"]
                for r in rows if r["model"] == model]
        assert report["estimate_error"][model] == pytest.approx(max(errs), rel=1e-12)
        assert all(r["measured"] > 0 for r in rows if r["model"] == model)


def test_budget_runs_fit_and_impossible_budget_raises(report):
    budgets = {b["model"]: b for b in report["budget"]}
    assert set(budgets) == set(MODELS)
    assert report["budget_overruns"] == 0
    assert report["budget_overruns"] == sum(b["overruns"] for b in budgets.values())
    for model, b in budgets.items():
        assert b["error"] is None, (model, b["error"])
        assert b["budget"] == int(0.4 * b["k1_peak"])
        assert b["k"] > 1, model  # 40% of the K = 1 peak cannot fit K = 1
        assert b["measured"] and max(b["measured"]) == b["max_measured"] <= b["budget"], model
        assert len(b["measured"]) == 2 * b["k"], model  # two steps, every micro-batch measured
        imp = b["impossible_budget"]
        assert imp["raised"] and "budget" in imp["error"], (model, imp)


def test_timed_epochs(report):
    tm = report["timing"]
    assert tm["dataset"] == "synthetic-products"
    assert tm["budget"] == int(0.25 * tm["k1_estimated_peak"])
    k1, kk = tm["epochs"]
    assert k1["k"] == 1 and kk["k"] == tm["k_chosen"] > 1
    assert tm["k_estimated_max"] <= tm["budget"]
    for epoch in (k1, kk):
        assert tuple(epoch["seconds"]) == PHASES
        assert all(v >= 0.0 for v in epoch["seconds"].values())
        assert epoch["seconds"]["compute"] > 0.0 and epoch["seconds"]["sampling"] > 0.0
        assert epoch["epoch_s"] == pytest.approx(sum(epoch["seconds"].values()))
    assert kk["seconds"]["partitioning"] > 0.0


def test_pipeline_section(report):
    pl = report["pipeline"]
    assert pl["k"] == report["timing"]["k_chosen"]
    for mode in PIPELINE_MODES:
        assert [e["epoch"] for e in pl[mode]] == list(range(pl["epochs_per_mode"]))
        for e in pl[mode]:
            assert 0.0 < e["compute_s"] <= e["epoch_s"] and 0.0 <= e["idle_fraction"] < 1.0
            assert e["sample_s"] > 0.0
    assert all(e["prefetch_bytes"] == 0 for e in pl["serial"] + pl["device_preparation"])
    assert all(e["prefetch_bytes"] > 0 for e in pl["pipelined"])
    # the features gathered ahead are held with the prepared batch, gathered on the thread
    for mode in ("gathered_ahead", "copy_ahead"):
        assert min(e["prefetch_bytes"] for e in pl[mode]) > \
               max(e["prefetch_bytes"] for e in pl["pipelined"]), mode
    assert all(e["h2d_s"] > 0 for mode in PIPELINE_MODES for e in pl[mode])
    # the serial updates up to the run-to-run noise of multi-threaded CPU kernels (PyG's
    # scatter sums in a thread-dependent order: two serial runs differ by ~1e-8 too)
    assert set(pl["relative_difference"]) == set(PIPELINE_MODES[1:])
    assert all(diff < 1e-6 for diff in pl["relative_difference"].values()), pl["relative_difference"]
    assert pl["max_relative_difference"] == max(pl["relative_difference"].values())


def test_unknown_backend_is_refused_naming_the_choices(tmp_path):
    proc = _run("--device", "cpu", "--quick", "--backend", "jax", "--out",
                str(tmp_path / "x.json"), timeout=120)
    assert proc.returncode == 2
    assert "auto" in proc.stderr and "dgl" in proc.stderr and "pyg" in proc.stderr
    assert not (tmp_path / "x.json").exists()
