"""Options and error handling shared by the commands."""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Annotated, List, Optional

import typer

__all__ = ["SpecArg", "SetOpt", "JsonOpt", "ExperimentOpt", "NprocOpt", "NnodesOpt", "NodeRankOpt",
           "RdzvOpt", "distributed_overrides", "cli_errors", "load", "emit_json", "emit_fields",
           "active_experiment_ids", "experiment_id", "fail", "check_k_fits"]

SpecArg = Annotated[str, typer.Argument(metavar="SPEC", help="Spec: a path, a file name in specs/ or its stem (e.g. synthetic).")]
SetOpt = Annotated[Optional[List[str]], typer.Option(
    "--set", "-s", help="Override a spec key: key.path=value (value parsed as YAML). Repeatable.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of a table.")]
ExperimentOpt = Annotated[Optional[str], typer.Option(
    "--experiment", "-e", help="MLflow experiment name (default: $MLFLOW_EXPERIMENT_NAME; run/stage: else the spec's experiment key or its name).")]
NprocOpt = Annotated[Optional[int], typer.Option(
    "--nproc", min=1, help="Ranks on this machine (torch.distributed; sets train.world_size = nproc x nnodes).")]
NnodesOpt = Annotated[int, typer.Option("--nnodes", min=1, help="Machines taking part (node 0 hosts the rendezvous).")]
NodeRankOpt = Annotated[int, typer.Option("--node-rank", min=0, help="This machine's index; 0 logs the runs.")]
RdzvOpt = Annotated[Optional[str], typer.Option(
    "--rdzv-endpoint", help="HOST:PORT of node 0's rendezvous (needed with --nnodes > 1).")]


def distributed_overrides(nproc: int | None, nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> list[str]:
    """``--nproc/--nnodes/--node-rank/--rdzv-endpoint`` -> spec overrides
    (``train.world_size``) and, for several machines, the ``BETTY_*`` launch variables
    read by :func:`workflow.training.launch_options`."""
    if node_rank >= nnodes:
        raise typer.BadParameter(f"--node-rank must be in [0, {nnodes}) (--nnodes is {nnodes}), got {node_rank}")
    if nproc is None:
        if nnodes > 1:
            raise typer.BadParameter("--nnodes needs --nproc (ranks per machine)")
        return []
    if nnodes > 1:
        if not rdzv_endpoint:
            raise typer.BadParameter("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
        os.environ.update(BETTY_NNODES=str(nnodes), BETTY_NODE_RANK=str(node_rank),
                          BETTY_RDZV_ENDPOINT=rdzv_endpoint, BETTY_RUN_ID="betty")
    return [f"train.world_size={nproc * nnodes}"]


def fail(message: str, code: int) -> typer.Exit:
    """Print ``message`` on stderr and return the ``typer.Exit`` to raise."""
    typer.echo(f"betty: {message}", err=True)
    return typer.Exit(code)


def cli_errors(fn):
    """Turn exceptions into exit codes: 2 for spec errors and bad arguments (a refused
    ``--upstream`` run included), 130 for Ctrl-C (also, once the command returns, one
    whose ``KeyboardInterrupt`` a library swallowed while it ran), 1 otherwise (the
    traceback only with ``BETTY_TRACEBACK=1``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from workflow.lineage import UpstreamMismatch
        from workflow.spec import SpecError

        from workflow import signals

        previous = signals.install()  # SIGINT/SIGTERM -> KeyboardInterrupt once: runs end KILLED
        signals.release_hold()  # the betty command's start-up (workflow.cli)
        try:
            signals.check()  # one that came while the command was starting
            result = fn(*args, **kwargs)
            signals.check()  # one a library swallowed while the command ran (a finalizer)
            return result
        except (typer.Exit, typer.Abort):
            raise
        except (SpecError, UpstreamMismatch) as err:  # the spec, or the --upstream runs given
            raise fail(str(err), 2) from None
        except typer.BadParameter as err:  # raised by a command's own argument checks
            raise fail(err.format_message(), 2) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except Exception as err:  # noqa: BLE001
            if os.environ.get("BETTY_TRACEBACK"):
                import traceback

                traceback.print_exc()
            from workflow.runs import error_summary

            raise fail(error_summary(err), 1) from None
        finally:
            signals.restore(previous)

    return wrapper


def load(spec: str, overrides: list[str] | None, options: dict | None = None):
    """``spec`` with the ``--set`` ``overrides``, then ``key.path=value`` for each of the
    command's own ``options`` given (``{"partition.k": k}``; ``None``: not given)."""
    from workflow.specfile import load_spec

    given = [f"{key}={value}" for key, value in (options or {}).items() if value is not None]
    return load_spec(spec, [*(overrides or []), *given])


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def emit_fields(out: dict, json_: bool, *, width: int, show=str) -> None:
    """``out`` as one JSON object (``--json``), else one ``key: value`` line per entry,
    the keys right-aligned in ``width`` characters and each value written by ``show``."""
    if json_:
        emit_json(out)
        return
    for key, value in out.items():
        typer.echo(f"{key:>{width}}: {show(value)}")


def active_experiment_ids() -> list[str]:
    """The IDs of every active experiment of the tracking store, page by page (MLflow
    answers at most 1,000 a request)."""
    from mlflow.tracking import MlflowClient

    client, ids, token = MlflowClient(), [], None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        ids += [e.experiment_id for e in page]
        token = page.token
        if not token:
            return ids


def experiment_id(name: str | None) -> str:
    """The ID of experiment ``name`` (default: the environment's or 'Default')."""
    import mlflow
    from mlflow.tracking import MlflowClient

    name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if not name:
        exp_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
        if exp_id is None:
            return "0"
        from mlflow.exceptions import MlflowException

        try:
            MlflowClient().get_experiment(exp_id)
        except MlflowException as err:  # a store that cannot answer is not told apart here
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise fail(f"no MLflow experiment with ID {exp_id!r} (MLFLOW_EXPERIMENT_ID) in "
                       f"{mlflow.get_tracking_uri()}", 2) from None
        return exp_id
    exp = MlflowClient().get_experiment_by_name(name)
    if exp is None:
        raise fail(f"no MLflow experiment named {name!r} in {mlflow.get_tracking_uri()}", 2)
    return exp.experiment_id


def check_k_fits(trainer, k: int, given: str) -> None:
    """Exit 2 when ``k`` (the largest K the command was ``given``, e.g. ``"--k 500"``)
    is more than the first batch's output nodes (RevGNN: the graph's nodes) it would
    split: training would quietly use fewer micro-batches than were asked for."""
    batches = getattr(trainer, "batches", None)
    n, what = (int(batches[0].numel()), "the first batch's output nodes") if batches is not None \
        else (int(trainer.dataset.num_nodes), "the graph's nodes")
    if k > n:
        raise fail(f"{given}: K must be at most {what} ({n:,})", 2)
