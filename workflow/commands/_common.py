"""Options and error handling shared by the commands."""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Annotated, List, Optional

import typer

__all__ = ["SpecArg", "SetOpt", "JsonOpt", "ExperimentOpt", "cli_errors", "load", "emit_json",
           "use_experiment", "experiment_id", "fail"]

SpecArg = Annotated[str, typer.Argument(help="Spec: a path, a file name in specs/ or its stem (e.g. synthetic).")]
SetOpt = Annotated[Optional[List[str]], typer.Option(
    "--set", "-s", help="Override a spec key: key.path=value (value parsed as YAML). Repeatable.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of a table.")]
ExperimentOpt = Annotated[Optional[str], typer.Option(
    "--experiment", "-e", help="MLflow experiment name (default: $MLFLOW_EXPERIMENT_NAME; run/stage: else the spec's experiment key or its name).")]


def fail(message: str, code: int) -> typer.Exit:
    """Print ``message`` on stderr and return the ``typer.Exit`` to raise."""
    typer.echo(f"betty: {message}", err=True)
    return typer.Exit(code)


def cli_errors(fn):
    """Turn exceptions into exit codes: 2 for spec errors, 130 for Ctrl-C, 1 otherwise
    (the traceback only with ``BETTY_TRACEBACK=1``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from workflow.spec import SpecError

        from workflow import signals

        previous = signals.install()  # SIGINT/SIGTERM -> KeyboardInterrupt once: runs end KILLED
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except SpecError as err:
            raise fail(str(err), 2) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except Exception as err:  # noqa: BLE001
            if os.environ.get("BETTY_TRACEBACK"):
                import traceback

                traceback.print_exc()
            raise fail(f"{type(err).__name__}: {err}", 1) from None
        finally:
            signals.restore(previous)

    return wrapper


def load(spec: str, overrides: list[str] | None):
    from workflow.specfile import load_spec

    return load_spec(spec, overrides or [])


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def use_experiment(name: str | None) -> None:
    """Make ``name`` the active MLflow experiment (created if needed)."""
    if name:
        import mlflow

        mlflow.set_experiment(name)


def experiment_id(name: str | None) -> str:
    """The ID of experiment ``name`` (default: the environment's or 'Default')."""
    from mlflow.tracking import MlflowClient

    name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if not name:
        return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")
    exp = MlflowClient().get_experiment_by_name(name)
    if exp is None:
        raise fail(f"no MLflow experiment named {name!r} in {_uri()}", 2)
    return exp.experiment_id


def _uri() -> str:
    import mlflow

    return mlflow.get_tracking_uri()
