"""MLflow runs: every run betty creates is opened by :func:`tracked_run`, which tags
it, logs the resolved spec and ends it ``FINISHED``, ``FAILED`` or ``KILLED`` (never
left ``RUNNING``), with the ``error`` tag and ``error.txt`` on failure.

Tags, params and endings: docs/workflow.md, *What every run records* and *Failures*.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import socket
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from workflow import env as _env  # noqa: F401  (before MLflow is imported)
import mlflow
from mlflow.tracking import MlflowClient

from betty.environment import environ
from betty.owner import Owner
from workflow.provenance import backend_version, code_version, git_commit
from workflow.reuse import DEVICE_DEPENDENT, device_identity
from workflow.signals import check, shield
from workflow.spec import short_text
from workflow.specfile import ResolvedSpec
from workflow.tracking import mark_model_training

__all__ = [
    "ERROR_TAG_LIMIT",
    "disk_full",
    "error_summary",
    "tracked_run",
    "record_failure",
    "mark_failed",
    "log_metrics",
    "clean_metrics",
    "local_store",
    "encode_upstream",
    "decode_upstream",
]

ERROR_TAG_LIMIT = 500  # characters of the error message kept in the ``error`` tag


def clean_metrics(metrics: Mapping[str, float | int | None]) -> dict[str, float]:
    """``metrics`` without ``None`` and non-finite values, as floats."""
    out = {}
    for key, value in metrics.items():
        if value is None or isinstance(value, bool):
            continue
        value = float(value)
        if math.isfinite(value):
            out[key] = value
    return out


def log_metrics(metrics: Mapping[str, float | int | None], step: int | None = None, dataset=None) -> None:
    """Log the finite, non-``None`` entries of ``metrics`` on the active run; with
    ``dataset`` (an MLflow dataset) each metric names it (a logged model that takes these
    metrics then lists it under "Datasets used")."""
    clean = clean_metrics(metrics)
    if clean:
        mlflow.log_metrics(clean, step=step, dataset=dataset)


def encode_upstream(upstream: Mapping[str, str]) -> str:
    """``{"download": "abc", ...}`` -> ``"download=abc;..."`` (the MLproject form)."""
    return ";".join(f"{k}={v}" for k, v in upstream.items())


def decode_upstream(text: str | None) -> dict[str, str]:
    """Inverse of :func:`encode_upstream`; also accepts ``,`` as separator. A stage named
    twice with two runs is refused (``ValueError``)."""
    out = {}
    for part in (text or "").replace(",", ";").split(";"):
        part = part.strip()
        if not part:
            continue
        stage, sep, run_id = part.partition("=")
        if not sep or not stage.strip() or not run_id.strip():
            raise ValueError(f"upstream entry {part!r} must look like stage=RUN_ID")
        stage, run_id = stage.strip(), run_id.strip()
        if out.get(stage, run_id) != run_id:
            raise ValueError(f"upstream names two {stage} runs ({out[stage]} and {run_id}); give one per stage")
        out[stage] = run_id
    return out


DISK_FULL_TEXTS = ("database or disk is full", "No space left on device")


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says a disk is full: an
    ``OSError`` with ``ENOSPC``, or SQLite's "database or disk is full"."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if any(text in str(exc) for text in DISK_FULL_TEXTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def error_summary(exc: BaseException) -> str:
    """What a user reads: ``Type: message``, without a native library's stack trace
    (DGL appends its C++ frames after a ``Stack trace:`` line; the run's ``error.txt``
    keeps everything), or, when a disk is full, what to do (the SQL and parameters
    MLflow's error carries are of no use then)."""
    if disk_full(exc):
        return (f"disk full: no space left under the tracking store ({mlflow.get_tracking_uri()}) "
                f"or the artifact or data folder ({type(exc).__name__}); free some space, then "
                "`betty cleanup --fail` ends any run this left RUNNING")
    message = str(exc).split("\nStack trace:", 1)[0]
    return f"{type(exc).__name__}: {message}".strip().rstrip(":")


def record_failure(run_id: str, exc: BaseException) -> None:
    """Set the ``error`` tag and log ``error.txt`` (the traceback) on ``run_id``.

    Never raises: a failure while reporting a failure must not hide the original one.
    """
    client = MlflowClient()
    try:
        client.set_tag(run_id, "error", short_text(error_summary(exc), ERROR_TAG_LIMIT))
    except Exception:  # noqa: BLE001
        pass
    try:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        client.log_text(run_id, text, "error.txt")
    except Exception:  # noqa: BLE001
        pass


ENDING_REQUESTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": 1, "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": 1,
                   "MLFLOW_HTTP_REQUEST_TIMEOUT": 10}
"""The most a tracking server's requests may take while :func:`mark_failed` ends a run
(one retry, 10 s an attempt; lower values the user set are kept). MLflow's defaults
retry for minutes, and signals are held meanwhile: a server that is gone must not
keep an interrupted process alive that long."""


def mark_failed(run_id: str, exc: BaseException) -> None:
    """Record ``exc`` on ``run_id`` and end it ``FAILED`` (``KILLED`` for
    ``KeyboardInterrupt``) unless it has already ended. Signals meanwhile are held
    back (:func:`workflow.signals.shield`): a second Ctrl-C must not leave it ``RUNNING``.
    Never raises: a store that cannot be reached leaves the run for ``betty cleanup``
    (on a tracking server within :data:`ENDING_REQUESTS`' bounds), and ``exc`` is
    what the caller reports."""
    with shield(), _brief_requests():
        record_failure(run_id, exc)
        try:
            _end(run_id, "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
        except Exception:  # noqa: BLE001  (reporting a failure must not hide it)
            pass


def _brief_requests() -> contextlib.AbstractContextManager:
    """Bound a tracking server's requests by :data:`ENDING_REQUESTS` inside (MLflow
    reads these variables on every request); a no-op on a local store."""
    if local_store():
        return contextlib.nullcontext()
    return environ(**{key: str(bound) for key, bound in ENDING_REQUESTS.items()
                      if not _at_most(os.environ.get(key), bound)})


def _at_most(text: str | None, bound: float) -> bool:
    try:
        return text is not None and float(text) <= bound
    except ValueError:
        return False


def _run_tags(kind: str, stage: str, rspec: ResolvedSpec, device: str | None,
              extra: Mapping[str, str] | None) -> dict[str, str]:
    tags = {
        "run_kind": kind,
        "stage": stage,
        "spec_name": rspec.name,
        "spec_sha": rspec.sha,
        "dataset": rspec.spec.dataset.name,
        "code_version": code_version(),
        "betty.host": socket.gethostname(),
        "betty.pid": str(os.getpid()),
        "betty.owner": Owner.current().prefix() + "run",  # pid, start time, PID namespace, boot
    }
    if kind != "stage" or stage in DEVICE_DEPENDENT:  # the others never import a GNN framework
        tags["backend"] = backend_version(rspec.spec.model.backend)
    commit = git_commit()
    if commit:  # MLflow sets it only when the entry script lies in a repository
        tags["mlflow.source.git.commit"] = commit
    if rspec.source:
        tags["spec_source"] = rspec.source
    if rspec.overrides:
        tags["spec_overrides"] = "; ".join(rspec.overrides)[:ERROR_TAG_LIMIT]
    if device is not None:
        tags["device"] = device
        tags["device_identity"] = device_identity(device)  # cpu, or the kind of GPU
    tags.update(extra or {})
    return tags


@contextmanager
def tracked_run(kind: str, stage: str, rspec: ResolvedSpec, *, nested: bool = False,
                run_name: str | None = None, device: str | None = None,
                tags: Mapping[str, str] | None = None,
                log_spec: bool = True) -> Iterator[mlflow.ActiveRun]:
    """Open (or resume, under ``mlflow run``) a run: tags (:func:`_run_tags` plus
    ``tags``), the experiment marked as model training, with ``log_spec`` the spec as
    ``spec.<key.path>`` params and ``spec.yaml``. Ends ``FINISHED``, or through
    :func:`mark_failed` when the body raises."""
    # the tags are written with the run (one insert): a run killed right after its
    # creation still has betty.host/betty.pid, so 'betty cleanup' can end it. On a
    # database or file store a signal while MLflow creates the run is held (shield) and
    # raised by check() below, once the run exists to be ended KILLED (raised inside
    # start_run, it would leave it RUNNING). A tracking server's client retries for
    # minutes when the server is gone: there Ctrl-C must stay at once.
    run = None
    try:
        with shield() if local_store() else contextlib.nullcontext():
            run = mlflow.start_run(nested=nested, run_name=run_name,
                                   tags=_run_tags(kind, stage, rspec, device, tags))
        check()
        mark_model_training(run.info.experiment_id)
        if log_spec:
            mlflow.log_params(rspec.params())
            mlflow.log_text(rspec.yaml(), "spec.yaml")
        yield run
    except BaseException as exc:
        if run is not None:
            mark_failed(run.info.run_id, exc)
        raise
    else:
        _end(run.info.run_id, "FINISHED")


def local_store() -> bool:
    """Whether the tracking store is a database or folder this process writes itself
    (not a tracking server reached over HTTP)."""
    from urllib.parse import urlparse

    return urlparse(mlflow.get_tracking_uri()).scheme not in ("http", "https", "databricks")


def _end(run_id: str, status: str) -> None:
    """End ``run_id`` with ``status``: the innermost active run through MLflow's run
    stack; any other (another run is on top, or this process never resumed it) by ID,
    unless it has ended already."""
    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:
        mlflow.end_run(status)
        return
    client = MlflowClient()
    try:
        if client.get_run(run_id).info.status in ("RUNNING", "SCHEDULED"):
            client.set_terminated(run_id, status)
    except Exception:  # noqa: BLE001  (reporting a failure must not hide it)
        pass
