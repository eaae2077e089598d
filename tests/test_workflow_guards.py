"""Guards around the workflow: --upstream lineage checks, artifact checksums, progress
lines without a terminal, number formatting and spec-file diagnostics."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from test_workflow_support import activate_store, end_active_runs, runs_of
from workflow.cli import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture
def tracking(tmp_path, monkeypatch):
    yield activate_store(tmp_path, monkeypatch, experiment="guards-test")
    end_active_runs()


def _stage(*args: str) -> str:
    res = invoke("stage", *args, "--experiment", "guards-test", "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["run_id"]


def test_upstream_is_checked_before_a_run_exists(tracking):
    uri, exp = tracking
    download = _stage("download", "tiny")
    sample = _stage("sample", "tiny", "--upstream", f"download={download}")
    before = {r.info.run_id for r in runs_of(uri, exp)}

    def refused(*args: str) -> str:
        res = invoke("stage", *args, "--experiment", "guards-test")
        assert res.exit_code != 0, res.output
        return res.stderr

    # a sample run of spec tiny cannot feed the partition stage of spec synthetic
    err = refused("partition", "synthetic", "--upstream", f"sample={sample}")
    assert sample in err and "'tiny'" in err and "'synthetic'" in err and "stage_sha" in err
    # a run of another stage, a run that does not exist, a stage that is not upstream
    assert "is not a sample stage run" in refused("partition", "tiny", "--upstream", f"sample={download}")
    assert "no such run" in refused("train", "tiny", "--upstream", "partition=bogus")
    assert "takes runs of" in refused("sample", "tiny", "--upstream", f"partition={sample}")
    # a run that did not finish
    MlflowClient(uri).set_terminated(download, "KILLED")
    assert "KILLED, not FINISHED" in refused("sample", "tiny", "--upstream", f"download={download}")
    # refused before any run was created; a matching lineage is accepted
    assert {r.info.run_id for r in runs_of(uri, exp)} == before
    _stage("partition", "tiny", "--upstream", f"sample={sample}", "-s", "partition.sweep.k=[2]",
           "-s", "partition.sweep.methods=[range]")
