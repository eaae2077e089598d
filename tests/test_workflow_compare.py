"""``betty compare`` over hand-made parent runs: columns, filters, formats, repeats."""

from __future__ import annotations

import csv
import io
import json

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from test_workflow_support import activate_store, end_active_runs
from workflow.cli import app


@pytest.fixture
def store(tmp_path, monkeypatch):
    """Three FINISHED parent runs: two repeats of spec ``a`` (test_acc 0.8 and 0.9, 10 s
    and 20 s long), one of spec ``b``; plus a stage run compare must ignore."""
    uri, exp = activate_store(tmp_path, monkeypatch, experiment="cmp")
    client = MlflowClient(uri)
    made = []
    for i, (spec, sha, acc, secs) in enumerate([("a", "s1", 0.8, 10), ("b", "s2", 0.5, 5), ("a", "s1", 0.9, 20)]):
        start = 1_700_000_000_000 + i * 100_000
        run = client.create_run(exp, start_time=start, run_name=f"{spec}-{i}",
                                tags={"run_kind": "main", "spec_name": spec, "spec_sha": sha,
                                      "stage_run.train": f"train-{i}"})
        client.log_metric(run.info.run_id, "test_acc", acc)
        client.log_metric(run.info.run_id, "k", 2)
        client.set_terminated(run.info.run_id, "FINISHED", end_time=start + secs * 1000)
        made.append(run.info.run_id)
    stage = client.create_run(exp, tags={"run_kind": "stage", "spec_name": "a"})
    client.set_terminated(stage.info.run_id, "FINISHED")
    yield made
    end_active_runs()


def invoke(*args):
    return CliRunner().invoke(app, ["compare", "--experiment", "cmp", *args], catch_exceptions=False)


def test_json_rows_and_repeat_summary(store):
    res = invoke("--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    rows = out["runs"]
    assert [r["run_id"] for r in rows] == store[::-1]  # newest first, stage run left out
    assert [r["duration s"] for r in rows] == [20.0, 5.0, 10.0]
    assert rows[0]["run id"] == store[2] and rows[0]["status"] == "FINISHED"
    assert rows[0]["start (UTC)"] == 1_700_000_200_000
    [rep] = out["repeats"]
    assert rep["spec"] == "a" and rep["n"] == 2 and set(rep["run_ids"]) == {store[0], store[2]}
    assert rep["mean"]["test"] == pytest.approx(0.85) and rep["std"]["test"] == pytest.approx(0.05)
    assert rep["mean"]["duration s"] == pytest.approx(15.0) and rep["std"]["K"] == 0


def test_a_pipeline_run_that_reused_the_training_repeats_nothing(store):
    """A parent run whose train stage was reused from an earlier one (same figures, no
    new training) is listed but not counted as a repeat."""
    client = MlflowClient()
    exp = client.get_run(store[0]).info.experiment_id
    again = client.create_run(exp, run_name="a-again", tags={"run_kind": "main", "spec_name": "a",
                                                             "spec_sha": "s1", "stage_run.train": "train-0"})
    client.log_metric(again.info.run_id, "test_acc", 0.8)
    client.set_terminated(again.info.run_id, "FINISHED")
    out = json.loads(invoke("--json").stdout)
    assert again.info.run_id in [r["run_id"] for r in out["runs"]]
    [rep] = out["repeats"]
    assert rep["n"] == 2 and set(rep["run_ids"]) == {store[0], store[2]}


def test_runs_on_another_backend_are_not_repeats(store):
    """The same spec content on DGL and on PyG (``model.backend: auto`` in two
    environments) is two configurations, not repeats of one."""
    client = MlflowClient()
    exp = client.get_run(store[0]).info.experiment_id
    for i, backend in enumerate(["pyg (torch_geometric 2.8.0, torch 2.13.0)"] * 2):
        run = client.create_run(exp, run_name=f"a-pyg-{i}", tags={
            "run_kind": "main", "spec_name": "a", "spec_sha": "s1", "stage_run.train": f"pyg-{i}",
            "backend": backend})
        client.log_metric(run.info.run_id, "test_acc", 0.5)
        client.set_terminated(run.info.run_id, "FINISHED")
    reps = json.loads(invoke("--json").stdout)["repeats"]
    assert sorted((rep["n"], rep["mean"]["test"]) for rep in reps) == [(2, pytest.approx(0.5)),
                                                                       (2, pytest.approx(0.85))]
    assert {rep["backend"] for rep in reps} == {None, "pyg (torch_geometric 2.8.0, torch 2.13.0)"}
    table = invoke("--wide").stdout
    assert "mean ± std (n=2, pyg)" in table and "mean ± std (n=2)" in table  # the groups told apart
    rows = list(csv.reader(io.StringIO(invoke("--csv").stdout)))
    assert rows[0][-2:] == ["spec_sha", "backend"]
    assert {r[-1] for r in rows[1:] if r[0] == "mean"} == {"", "pyg (torch_geometric 2.8.0, torch 2.13.0)"}


def test_runs_on_another_device_are_not_repeats(store):
    """The same spec content on the CPU and on a GPU (``train.device: auto`` on two
    machines) is two groups: their times and peaks are not one experiment's spread."""
    client = MlflowClient()
    exp = client.get_run(store[0]).info.experiment_id
    for i, device in enumerate(["cpu", "cpu", "cuda (NVIDIA H100 80GB HBM3)", "cuda (NVIDIA H100 80GB HBM3)"]):
        run = client.create_run(exp, run_name=f"c-{i}", tags={
            "run_kind": "main", "spec_name": "c", "spec_sha": "s3", "stage_run.train": f"c-{i}",
            "backend": "dgl (dgl 2.1.0, torch 2.2.1)", "device_identity": device})
        client.log_metric(run.info.run_id, "epoch_time_s", 10.0 if device == "cpu" else 1.0)
        client.set_terminated(run.info.run_id, "FINISHED")
    reps = [r for r in json.loads(invoke("--json").stdout)["repeats"] if r["spec_sha"] == "s3"]
    assert sorted((r["device"], r["n"], r["std"]["epoch s"]) for r in reps) == [
        ("cpu", 2, 0.0), ("cuda (NVIDIA H100 80GB HBM3)", 2, 0.0)]
    assert "mean ± std (n=2, dgl, cpu)" in invoke("--wide").stdout


def test_filters_last_and_spec(store):
    last = json.loads(invoke("--json", "--last", "2").stdout)
    assert [r["run_id"] for r in last["runs"]] == [store[2], store[1]] and last["repeats"] == []
    only_b = json.loads(invoke("--json", "--spec", "b").stdout)
    assert [r["run_id"] for r in only_b["runs"]] == [store[1]]


def test_csv_and_markdown(store):
    res = invoke("--csv")
    assert res.exit_code == 0, res.output
    table = list(csv.DictReader(io.StringIO(res.stdout)))
    assert [r["row"] for r in table] == ["run", "run", "run", "mean", "std"]
    assert float(table[3]["test"]) == pytest.approx(0.85) and float(table[4]["test"]) == pytest.approx(0.05)
    assert table[0]["run id"] == store[2] and table[0]["status"] == "FINISHED"
    md = invoke("--markdown").stdout.splitlines()
    assert md[0].startswith("| run | run id | start (UTC) | status | duration s |")
    assert len(md) == 2 + 3 + 1
    assert "mean ± std (n=2)" in md[-1] and "0.85 ± 0.05" in md[-1]
    assert "2023-11-14 22:13:20" in md[4]  # the first run started at 1.7e12 ms = this, UTC
    both = invoke("--csv", "--markdown")
    assert both.exit_code == 2 and "--csv" in both.stderr


def test_table_has_the_new_columns(store):
    res = invoke()
    assert res.exit_code == 0
    for header in ("run id", "start (UTC)", "status", "duration s", "mean ± std (n=2)"):
        assert header in res.stdout


def test_table_fits_the_terminal_and_wide_shows_every_column(store, monkeypatch):
    from workflow.report import HEADERS

    monkeypatch.setenv("COLUMNS", "100")
    res = invoke()
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "…" not in res.stdout  # no cell squeezed to an ellipsis
    header_line = next(line for line in lines if "┃" in line and " K " in line)
    for header in ("run", "spec", "K", "mem measured", "epoch s", "valid", "test"):
        assert f" {header} " in header_line, header
    for run in ("a-0", "b-1", "a-2", "mean ± std (n=2)", "0.85 ± 0.05"):
        assert run in res.stdout
    note = res.stdout[res.stdout.index("(not shown"):]
    assert "--wide shows them" in note and "run id" in note
    wide = invoke("--wide")
    assert wide.exit_code == 0 and "…" not in wide.stdout
    wide_header = next(line for line in wide.stdout.splitlines() if "┃" in line and " K " in line)
    assert all(f" {h} " in wide_header for h in HEADERS)
    assert max(len(line) for line in wide.stdout.splitlines()) > 100
