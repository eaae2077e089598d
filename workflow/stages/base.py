"""What every stage receives: the resolved spec, its upstream runs, a reporter.

A stage is a function ``run(ctx: StageContext) -> dict[str, float]`` that executes
inside an active MLflow run (opened by :func:`workflow.runs.tracked_run`), logs its
metrics and artifacts there, and returns the metrics worth a summary line. Artifacts of
earlier stages are read by run ID (``runs:/<id>/<path>``) through :meth:`upstream_file`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workflow.checksums import fetch
from workflow.components import load_data, resolve_device
from workflow.progress import Reporter
from workflow.specfile import ResolvedSpec

__all__ = ["StageContext", "UpstreamMissing", "sweep_grid"]


class UpstreamMissing(RuntimeError):
    """A stage needs an earlier stage's run and none was given."""


@dataclass
class StageContext:
    """Inputs of one stage run.

    Attributes:
        rspec: the resolved spec.
        upstream: run IDs of earlier stages (``{"sample": "<run id>", ...}``).
        reporter: progress sink.
        workdir: scratch folder for files before they are logged.
        shared: objects reused across stages of one process (the loaded dataset).
    """

    rspec: ResolvedSpec
    upstream: dict[str, str]
    reporter: Reporter
    workdir: Path
    shared: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return resolve_device(self.rspec.spec.train.device)

    def dataset(self):
        """The spec's dataset, loaded once per process (keyed by its resolved section)."""
        key = json.dumps(self.rspec.data["dataset"], sort_keys=True)
        if self.shared.get("dataset_key") != key:
            self.shared.pop("dataset", None)  # release the previous one first
            self.shared["dataset"] = load_data(self.rspec)
            self.shared["dataset_key"] = key
        return self.shared["dataset"]

    def upstream_file(self, stage: str, artifact_path: str, *, required: bool = False) -> Path | None:
        """Download ``artifact_path`` of the ``stage`` run, checked against its checksum
        (:func:`workflow.checksums.fetch`, raises
        :class:`~workflow.checksums.ArtifactDamaged` naming the run and file); ``None``
        when no such run was given (or :class:`UpstreamMissing` if ``required``)."""
        run_id = self.upstream.get(stage)
        if run_id is None:
            if required:
                raise UpstreamMissing(
                    f"this stage needs the {stage} stage's run: run the pipeline (betty run / "
                    f"mlflow run -e main) or pass --upstream {stage}=<RUN_ID>")
            return None
        dst = self.workdir / f"upstream-{stage}-{run_id}"
        dst.mkdir(parents=True, exist_ok=True)
        return fetch(run_id, artifact_path, dst)


def sweep_plan(ks: list[int], method: str, max_k: Mapping[str, int] | None) -> tuple[list[int], str | None]:
    """``(Ks to try, reason for the others or None)``: ``ks`` bounded by ``max_k[method]``
    (the spec's ``partition.sweep.max_k``), the same on every machine."""
    cap = (max_k or {}).get(method)
    if cap is None:
        return list(ks), None
    dropped = [k for k in ks if k > cap]
    reason = f"K={','.join(map(str, dropped))} skipped: above sweep.max_k.{method}={cap}" if dropped else None
    return [k for k in ks if k <= cap], reason


def time_limit_reason(k: int, took: float, limit: float, rest: list[int]) -> str:
    """The ``sweep_skipped`` text when ``time_limit_s`` cut a method short."""
    return (f"K={k} took {took:.1f}s > sweep.time_limit_s={limit} (machine-dependent); "
            f"K={','.join(map(str, rest))} skipped")


def sweep_grid(methods: Sequence[str], ks: Sequence[int], measure: Callable[[str, int], dict], *,
               time_limit_s: float | None = None, max_k: Mapping[str, int] | None = None,
               reporter: Reporter | None = None) -> tuple[list[dict], dict[str, str]]:
    """Every method at every K (``ks`` increasing, ``<= max_k[method]``, see
    :func:`sweep_plan`): ``measure(method, k)`` returns the row's metrics (``method`` and
    ``k`` are put first). A method that raises gets a row with ``error`` and is cut short;
    so is one whose K took longer than ``time_limit_s`` seconds (:func:`time_limit_reason`).
    The partition stages of both engines run their sweeps through this loop.

    Returns:
        ``(rows, skipped)``: one row per (method, K) tried and ``{method: reason}`` naming
        the Ks not tried and why.
    """
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    advance = reporter.steps("partition sweep", len(ks) * len(methods)) if reporter else None
    for method in methods:
        planned, capped = sweep_plan(list(ks), method, max_k)
        reasons = [capped] if capped else []
        for i, k in enumerate(planned):
            start = time.perf_counter()
            stop = None
            try:
                row = measure(method, k)
            except Exception as err:  # noqa: BLE001  (a method unsuited to this graph)
                reason = f"{type(err).__name__}: {err}"
                rows.append({"method": method, "k": k, "error": reason})
                stop = f"failed at K={k}: {reason}"
            else:
                rows.append({"method": method, "k": k, **row})
                took = time.perf_counter() - start
                if time_limit_s is not None and took > time_limit_s and i + 1 < len(planned):
                    stop = time_limit_reason(k, took, time_limit_s, planned[i + 1:])
            if advance:
                advance(1)
            if stop:
                reasons.insert(0, stop)
                if advance and len(planned) - i - 1:
                    advance(len(planned) - i - 1)
                break
        if advance and len(ks) > len(planned):
            advance(len(ks) - len(planned))
        if reasons:
            skipped[method] = "; ".join(reasons)
            if reporter:
                reporter.note(f"sweep: {method} {skipped[method]}")
    return rows, skipped
