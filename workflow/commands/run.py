"""``betty run SPEC``: every stage as nested runs of one parent, in this process."""

from __future__ import annotations

from typing import Annotated

import typer

from workflow.commands._common import (ExperimentOpt, JsonOpt, NnodesOpt, NodeRankOpt, NprocOpt, RdzvOpt, SetOpt,
                                       SpecArg, distributed_overrides, emit_json, experiment_id, load)

SUMMARY_KEYS = ("k", "redundancy", "edges_kept_fraction", "peak_mem_estimated_bytes", "peak_mem_measured_bytes",
                "mem_estimate_error", "epoch_time_s", "loss", "train_acc", "valid_acc", "test_acc",
                "valid_rocauc", "test_rocauc")


def run(spec: SpecArg, set_: SetOpt = None, experiment: ExperimentOpt = None,
        reuse: Annotated[bool, typer.Option("--reuse/--no-reuse",
                                            help="Reuse finished stages with the same key.")] = True,
        json_: JsonOpt = False, nproc: NprocOpt = None, nnodes: NnodesOpt = 1, node_rank: NodeRankOpt = 0,
        rdzv_endpoint: RdzvOpt = None) -> None:
    """Run download, sample, partition, train and evaluate as child runs of one parent
    run, with a live progress display (on stderr). ``--nproc N`` trains on N ranks per
    machine (``--nnodes M --node-rank i --rdzv-endpoint HOST:PORT`` for several
    machines: node 0 runs the pipeline and logs, never reusing a train run, the others
    only lend their ranks, once per repeat)."""
    from mlflow.tracking import MlflowClient

    from workflow.pipeline import run_pipeline
    from workflow.progress import make_reporter

    from workflow.tracking import use_spec_experiment

    rspec = load(spec, [*(set_ or []), *distributed_overrides(nproc, nnodes, node_rank, rdzv_endpoint)])
    if nnodes > 1 and node_rank > 0:
        from workflow.training import train_distributed

        for repeat in range(rspec.spec.train.repeats):  # this machine's ranks; node 0 holds the runs
            train_distributed(rspec, repeat)
        return
    use_spec_experiment(rspec, experiment) or experiment_id(experiment)  # the environment's: it must exist
    with make_reporter() as reporter:  # several machines: train runs, the others' ranks wait for it
        outcomes = run_pipeline(rspec, reuse=reuse, reporter=reporter, rerun=("train",) if nnodes > 1 else ())
    parent = MlflowClient().get_run(outcomes["main"]["run_id"])
    metrics = parent.data.metrics
    if json_:
        emit_json({"run_id": parent.info.run_id, "experiment_id": parent.info.experiment_id,
                   "spec": rspec.name, "spec_sha": rspec.sha, "stages": {s: o for s, o in outcomes.items() if s != "main"},
                   "metrics": metrics})
        return
    from rich.console import Console
    from rich.table import Table

    from workflow.progress import format_number
    from betty.sizes import format_bytes

    table = Table(title=f"{rspec.name} (run {parent.info.run_id})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in SUMMARY_KEYS:
        if key in metrics:
            value = format_bytes(metrics[key]) if key.endswith("_bytes") else format_number(metrics[key])
            table.add_row(key, value)
    Console().print(table)
