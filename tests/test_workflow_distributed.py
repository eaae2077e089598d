"""``betty run SPEC --nproc 2``: FINISHED runs with per-rank metrics and the
single-process losses; a failing or SIGKILLed rank ends every run FAILED, never RUNNING."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from test_workflow_support import assert_runs_failed, invoke, runs_of

EXPERIMENT = "dist-test"  # the conftest tracking fixture's experiment
FAST = ["-s", "partition.sweep.k=[2]", "-s", "partition.sweep.methods=[range]"]


def _single_process_losses(epochs: int) -> list[float]:
    from workflow.components import load_data, make_trainer
    from workflow.specfile import load_spec

    rspec = load_spec("tiny", FAST[1::2])
    trainer, _, _ = make_trainer(rspec, load_data(rspec), torch.device("cpu"))
    return [trainer.train_epoch(e).loss for e in range(epochs)]


def test_run_nproc_2_logs_per_rank_metrics_and_single_process_losses(tracking):
    uri, exp = tracking
    res = invoke("run", "tiny", "--nproc", "2", "--json", *FAST)
    assert res.exit_code == 0, res.output
    runs = runs_of(uri, exp)
    assert runs and all(r.info.status == "FINISHED" for r in runs)
    train = [r for r in runs if r.data.tags.get("stage") == "train"][0]
    m = train.data.metrics
    assert m["world_size"] == 2.0 and train.data.params["spec.train.world_size"] == "2"
    for r in (0, 1):
        for key in ("peak_mem_measured_bytes", "peak_mem_estimated_bytes", "time_compute_s",
                    "time_idle_s", "allreduce_wait_s", "host_rss_peak_bytes", "host_pss_bytes"):
            assert f"{key}.rank{r}" in m, f"{key}.rank{r} missing"
        assert 0 < m[f"host_pss_bytes.rank{r}"] <= m[f"host_rss_peak_bytes.rank{r}"]
        assert 0 <= m[f"time_idle_s.rank{r}"] < m["epoch_time_s"] + 1.0  # ranks' walls differ slightly
    for key in ("time_sample_s", "time_partition_s", "time_estimate_s", "time_block_s",
                "time_metrics_s", "time_h2d_s"):
        assert m[key] > 0, key
    assert m["time_idle_s"] == max(m["time_idle_s.rank0"], m["time_idle_s.rank1"])
    assert m["allreduce_bytes"] > 0
    assert m["peak_mem_measured_bytes"] == max(m["peak_mem_measured_bytes.rank0"],
                                               m["peak_mem_measured_bytes.rank1"])
    history = [x.value for x in MlflowClient(uri).get_metric_history(train.info.run_id, "loss")]
    reference = _single_process_losses(len(history))
    assert history == pytest.approx(reference, rel=1e-6, abs=0)  # float32 spec


@pytest.mark.parametrize("fault,words", [("raise@1", "rank 1 failed: RuntimeError: injected"),
                                         ("kill@1", "rank 1 was killed by SIGKILL")])
def test_failing_rank_ends_runs_failed_naming_the_rank(tracking, monkeypatch, fault, words):
    uri, exp = tracking
    monkeypatch.setenv("BETTY_FAULT", fault)
    res = invoke("run", "tiny", "--nproc", "2", *FAST, catch_exceptions=True)
    assert_runs_failed(res, uri, exp, words)


def test_verify_nproc_passes_and_fails_beyond_tolerance(tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    res = invoke("verify", "tiny", "--nproc", "2", "--k", "2,3", "--dtype", "float64", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{"):])
    assert out["ok"] and out["world_size"] == 2 and [r["k"] for r in out["results"]] == [2, 3]
    assert all(r["max_rel_update_diff"] < 1e-10 and r["max_rel_grad_diff"] < 1e-10 for r in out["results"])
    # negative control: per-call dropout masks differ between K-way and full-batch runs
    bad = invoke("verify", "tiny", "--nproc", "2", "--k", "2", "--dtype", "float64",
                  "--set", "model.dropout_mode=standard")
    assert bad.exit_code == 1 and "BEYOND TOLERANCE" in bad.output
    assert "K=2    FAIL" in bad.stdout and bad.stdout.splitlines()[-1] == "FAIL"  # per K and in all, as without --nproc


def test_verify_ranks_build_their_trainers_on_the_shared_dataset(tmp_path, monkeypatch):
    """What ``betty verify --nproc`` hands every rank (``verify_ranks``' ``build``, called
    once per K) builds its trainer on the launcher's shared dataset: nothing loads it again."""
    from functools import partial

    from betty.distributed.shared import share_dataset
    from workflow.commands.verify import fresh_trainer
    from workflow.components import load_data
    from workflow.specfile import load_spec

    rspec = load_spec("tiny", ["dataset.root=" + str(tmp_path)])
    dataset = load_data(rspec)
    threads = torch.get_num_threads()
    with share_dataset(dataset, str(tmp_path)) as shared:
        monkeypatch.setattr("betty.data.load_dataset", lambda *a, **k: pytest.fail("loaded again"))
        build = partial(fresh_trainer, rspec, shared)  # what verify_ranks pickles for the ranks
        try:
            trainer, _ = build()
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(trainer.dataset.feat, dataset.feat)
        assert trainer.dataset.feat.data_ptr() != dataset.feat.data_ptr()  # mapped from the shared files


def test_mlproject_nproc_parameter():
    import yaml

    from workflow.mlproject import parse_args

    _, overrides = parse_args(["main", "--spec", "tiny", "--set", "train.epochs=1", "--nproc", "3"])
    assert overrides == ["train.epochs=1", "train.world_size=3"]
    assert parse_args(["main", "--spec", "tiny", "--nproc", ""])[1] == []
    with pytest.raises(SystemExit):
        parse_args(["main", "--spec", "tiny", "--nproc", "two"])
    from test_workflow_support import PROJECT

    main = yaml.safe_load((PROJECT / "MLproject").read_text())["entry_points"]["main"]
    assert "nproc" in main["parameters"] and "--nproc {nproc}" in main["command"]


@pytest.mark.slow
def test_ranks_die_with_a_sigkilled_launcher(tmp_path):
    """``kill -9`` of the ``betty run --nproc 2`` process while its ranks train: both
    ranks end within seconds instead of going on as orphans."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    from test_workflow_support import PROJECT, command_line, new_store

    env = {**os.environ, "MLFLOW_TRACKING_URI": new_store(tmp_path / "store"), "PYTHONPATH": str(PROJECT),
           "MLFLOW_EXPERIMENT_NAME": "dist-kill", "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "betty"), "run", "tiny", "--nproc", "2", *FAST,
           "-s", "train.epochs=100000", "-s", "evaluate.every=0"]
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            ranks = [p for p in psutil.Process(proc.pid).children() if "spawn_main" in command_line(p)]
        assert len(ranks) == 2, (ranks, proc.poll(), (tmp_path / "run.log").read_text()[-3000:])
        time.sleep(3)  # into the epochs
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(ranks, timeout=15)
        assert not alive, ([p.pid for p in alive], (tmp_path / "run.log").read_text()[-3000:])
    finally:
        for p in [*ranks, psutil.Process(proc.pid)] if proc.poll() is None else ranks:
            try:
                p.kill()
            except psutil.Error:
                pass


def test_successful_multi_rank_run_prints_no_warning(tmp_path):
    """A clean ``betty verify --nproc 2`` exits 0 with no WARNING on stderr (torch
    elastic's "Closing process N via signal SIGTERM" is routine after success)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_workflow_support import PROJECT

    env = {**os.environ, "PYTHONPATH": str(PROJECT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([str(Path(sys.executable).parent / "betty"), "verify", "tiny", "--nproc", "2", "--k", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "WARNING" not in out.stderr, out.stderr[-3000:]


def test_a_failing_rank_is_one_line_on_stderr_not_its_traceback(tmp_path):
    """``betty run --nproc 2`` with a failing rank prints the rank's error once, as the
    command's own message; the rank's traceback (torch elastic logs dozens of lines of
    it) is left to ``BETTY_TRACEBACK=1``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_workflow_support import PROJECT

    env = {**os.environ, "PYTHONPATH": str(PROJECT), "OMP_NUM_THREADS": "1", "BETTY_FAULT": "raise@1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    for var in ("BETTY_TRACEBACK", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        env.pop(var, None)
    out = subprocess.run([str(Path(sys.executable).parent / "betty"), "run", "tiny", "--nproc", "2",
                          "-s", "train.epochs=1", "-s", "partition.sweep.k=[]", "-s", f"dataset.root={tmp_path}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "betty: RankFailed: rank 1 failed: RuntimeError: injected failure on rank 1" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_two_machines_train_every_repeat_and_node_0_never_reuses_their_train_run(tracking, tmp_path, monkeypatch):
    """``--nnodes 2`` with ``train.repeats: 2``: node 1 lends its rank to each of node 0's
    launches (one per repeat), and a second run of both commands trains again instead of
    reusing the first train run, which node 1's rank would wait for in vain."""
    from betty.distributed.launch import free_port
    from test_workflow_support import run_on_two_machines

    uri, exp = tracking
    for name in ("BETTY_NNODES", "BETTY_NODE_RANK", "BETTY_RDZV_ENDPOINT", "BETTY_RUN_ID"):
        monkeypatch.setenv(name, "")  # node 0's command sets them in this process: undone after the test
        monkeypatch.delenv(name)
    for attempt in range(2):
        common = ["--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                  "-s", "train.repeats=2", "-s", "train.epochs=2", *FAST]
        res = run_on_two_machines(common, tmp_path, tmp_path / f"node1-{attempt}.log")
        assert res.exit_code == 0, res.output
    runs = runs_of(uri, exp)
    assert runs and all(r.info.status == "FINISHED" for r in runs)
    trains = [r for r in runs if r.data.tags.get("stage") == "train" and r.data.tags.get("run_kind") == "stage"]
    assert len(trains) == 2, "the second run trains again"
    repeats = [r for r in runs if r.data.tags.get("run_kind") == "repeat"]
    assert sorted(r.data.tags["repeat"] for r in repeats) == ["0", "0", "1", "1"]
    assert all(r.data.metrics["world_size"] == 2.0 for r in repeats)
    mains = [r for r in runs if r.data.tags.get("run_kind") == "main"]
    assert all("train" not in r.data.tags.get("reused_stages", "") for r in mains)
    assert any("sample" in r.data.tags.get("reused_stages", "") for r in mains), "other stages are still reused"


@pytest.mark.parametrize("nnodes,node_rank,words", [("0", "0", "BETTY_NNODES must be an integer >= 1, got '0'"),
                                                     ("two", "0", "BETTY_NNODES must be an integer >= 1, got 'two'"),
                                                     ("2", "-1", "BETTY_NODE_RANK must be an integer >= 0, got '-1'")])
def test_malformed_launch_variables_are_named(monkeypatch, nnodes, node_rank, words):
    from workflow.training import launch_options

    monkeypatch.setenv("BETTY_NNODES", nnodes)
    monkeypatch.setenv("BETTY_NODE_RANK", node_rank)
    with pytest.raises(ValueError, match=words):
        launch_options()
    monkeypatch.setenv("BETTY_NNODES", "2")
    monkeypatch.setenv("BETTY_NODE_RANK", "1")
    assert launch_options()["nnodes"] == 2 and launch_options()["node_rank"] == 1


def test_verify_nproc_checks_the_gradients_adams_update_would_hide():
    """The ranks' gradients 10% too large: Adam's first update is about ``lr · sign(g)``
    and moves by far less than 10%, the gradient comparison shows the 10%."""
    from functools import partial

    from betty.distributed.verify import verify_ranks
    from distributed_cases import scaled_gradient_trainer

    out = verify_ranks(partial(scaled_gradient_trainer, 1.1), [2], 2, tol=1e-10)
    row = out["results"][0]
    assert not out["ok"] and not row["ok"]
    assert row["max_rel_grad_diff"] == pytest.approx(0.1, rel=1e-6)
    assert row["max_rel_update_diff"] < 1e-2  # what the update comparison alone saw
    assert verify_ranks(partial(scaled_gradient_trainer, 1.0), [2], 2, tol=1e-10)["ok"]


def test_verify_nproc_takes_the_single_process_tolerance_and_ignores_the_budget(tmp_path, monkeypatch):
    """In float32 the ``--nproc`` verdict is held to the tolerance the single-process
    verdict measures on the batch; a ``k: auto`` spec whose budget K=1 would not fit is
    verified at the given K (the budget is the device's, the ranks run on the host)."""
    import json

    monkeypatch.chdir(tmp_path)
    auto = ["--set", "partition.k=auto", "--set", "partition.memory_budget=170KiB"]
    one = invoke("verify", "tiny", "--k", "2", "--json", *auto)
    assert one.exit_code == 0, one.output
    ranks = invoke("verify", "tiny", "--nproc", "2", "--k", "2", "--json", *auto)
    assert ranks.exit_code == 0, ranks.output
    single = json.loads(one.stdout[one.stdout.index("{"):])
    out = json.loads(ranks.stdout[ranks.stdout.index("{"):])
    assert out["ok"] and out["tolerance"] == single["tol"] and "measured float32 rounding" in single["tol_basis"]


def test_verify_nproc_counts_two_skipped_steps_as_the_same_step():
    """A ``16-mixed`` step skipped on both sides (inf gradients) is compared by its
    update; skipped on one side only, never passes."""
    from betty.distributed.verify import gradient_difference

    ok = {"w": torch.ones(2)}
    inf = {"w": torch.tensor([1.0, float("inf")])}
    assert gradient_difference(inf, {"w": torch.tensor([float("nan"), 1.0])}) == 0.0
    assert gradient_difference(inf, ok) == float("inf") and gradient_difference(ok, inf) == float("inf")
    assert gradient_difference({"w": torch.tensor([1.0, 1.1])}, ok) == pytest.approx(0.1 / 2 ** 0.5)
