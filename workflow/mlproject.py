"""MLproject entry points: ``python -m workflow.mlproject ENTRY --spec S [--set ...]``.

``ENTRY`` is ``main`` (every stage, as nested runs in this process, as ``betty run``
does: :func:`workflow.pipeline.run_pipeline`) or a stage name. Each call resumes
the run ``mlflow run`` created for it (``MLFLOW_RUN_ID``), except when that run is in
"Default" (``mlflow run`` without ``--experiment-name``): the entry point's runs then go
to the spec's experiment (:func:`workflow.tracking.leave_default_experiment`). Overrides come from the
``set`` parameter (``"train.epochs=3;model.hidden=64"``) and from undeclared
``-P key.path=value`` parameters, which MLflow appends as ``--key.path value``;
``-P nproc=N`` is ``train.world_size=N`` (N ranks, :mod:`workflow.training`).

Exit codes: 0 success, 2 invalid spec or ``upstream`` runs it cannot use (no traceback),
1 any other failure (message on stderr, traceback in the run's ``error.txt``), 130
interrupted.

Interrupts (:mod:`workflow.signals`, installed before anything heavy is imported):
``SIGINT``, ``SIGTERM`` or the death of ``mlflow run`` at any moment, imports included,
end this process's run (``MLFLOW_RUN_ID``) and, under ``main``, the stage in flight
``KILLED``, with an ``error`` tag that says ``KeyboardInterrupt``; if ``mlflow run``
ended the run before this process started, no stage starts. After a Ctrl-C, ``mlflow
run`` ends its run ``FAILED``, its own status for an interrupted run.
"""

from __future__ import annotations

from workflow import env as _env  # noqa: F401  (before MLflow is imported)
from workflow import signals as _signals

if __name__ == "__main__":
    _signals.install(die_with_parent=True)  # before the heavy imports

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

__all__ = ["main", "parse_args"]

ENTRIES = ("main", "download", "sample", "partition", "train", "evaluate")
"""``main`` and :data:`workflow.specfile.STAGES` (spelled out: that module is not light)."""
REUSE_ANSWERS = {"true": True, "1": True, "yes": True, "on": True,
                 "false": False, "0": False, "no": False, "off": False}
"""The spellings ``-P reuse=...`` takes (a typo must not mean reuse)."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """``(args, overrides)``; unknown ``--key.path value`` pairs become overrides,
    ``args.reuse`` a bool (:data:`REUSE_ANSWERS`)."""
    parser = argparse.ArgumentParser(prog="python -m workflow.mlproject")
    parser.add_argument("entry", choices=ENTRIES)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--set", dest="set_", default="")
    parser.add_argument("--upstream", default="")
    parser.add_argument("--reuse", default="true")
    parser.add_argument("--nproc", default="", help="ranks (-P nproc=N): train.world_size=N")
    args, extra = parser.parse_known_args(argv)
    answer = str(args.reuse).strip().lower()
    if answer not in REUSE_ANSWERS:
        parser.error(f"reuse must be one of {', '.join(sorted(REUSE_ANSWERS))}, got {args.reuse!r}")
    args.reuse = REUSE_ANSWERS[answer]
    overrides = [args.set_] if args.set_ else []
    if str(args.nproc).strip():
        if not str(args.nproc).strip().isdigit() or int(args.nproc) < 1:
            parser.error(f"nproc must be an integer >= 1, got {args.nproc!r}")
        overrides.append(f"train.world_size={int(args.nproc)}")
    i = 0
    while i < len(extra):
        item = extra[i]
        if not item.startswith("--") or len(item) == 2:
            parser.error(f"unexpected argument {item!r}")
        key = item[2:]
        if "=" in key:
            overrides.append(key)
            i += 1
        elif i + 1 < len(extra):
            overrides.append(f"{key}={extra[i + 1]}")
            i += 2
        else:
            parser.error(f"override --{key} has no value")
    return args, overrides


def _fail(message: str, code: int, exc: BaseException | None = None) -> int:
    with _signals.shield():  # imports MLflow if the interrupt came first: no second one now
        print(f"betty: {message}", file=sys.stderr, flush=True)
        run_id = os.environ.get("MLFLOW_RUN_ID")
        if exc is not None and run_id:
            from workflow.runs import mark_failed

            mark_failed(run_id, exc)
    return code


def _check_launcher_run() -> None:
    """Raise :class:`KeyboardInterrupt` if ``mlflow run`` already ended this process's
    run (``MLFLOW_RUN_ID``): its launcher was interrupted while it started this process,
    so no stage may start (resuming the run would set it ``RUNNING`` again)."""
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        return
    from mlflow.tracking import MlflowClient  # imported in _main's start-up shield

    status = MlflowClient().get_run(run_id).info.status
    if status not in ("RUNNING", "SCHEDULED"):
        raise KeyboardInterrupt(f"the launcher ended run {run_id} ({status}) before it started")


def main(argv: list[str] | None = None) -> int:
    """Run the entry point; every exit path ends this process's run (see the module docstring)."""
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return _main(args, overrides)
    except KeyboardInterrupt as err:  # also while importing or loading the spec
        return _fail("interrupted", 130, err)


def _main(args: argparse.Namespace, overrides: list[str]) -> int:
    # Signals during the imports (MLflow and the pipeline's included) and the spec load
    # are recorded, not raised: a KeyboardInterrupt inside an import leaves that module
    # half-initialised, and _fail's own import of MLflow then fails. check() raises
    # them right after, before any work starts.
    with _signals.shield():
        import mlflow.tracking  # noqa: F401

        import workflow.pipeline  # noqa: F401
        import workflow.tracking  # noqa: F401  (guards the store's sessions)
        from workflow.lineage import UpstreamMismatch
        from workflow.progress import LogReporter, format_metrics
        from workflow.spec import SpecError
        from workflow.specfile import load_spec

        try:
            rspec = load_spec(args.spec, overrides)
        except SpecError as err:
            return _fail(str(err), 2, err)
    _signals.check()
    _check_launcher_run()
    reporter = LogReporter()
    try:
        from workflow.tracking import leave_default_experiment

        leave_default_experiment(rspec)  # no experiment named: the spec's, not "Default"
        if args.entry == "main":
            from workflow.pipeline import run_pipeline

            run_pipeline(rspec, reuse=args.reuse, reporter=reporter)
        else:
            from workflow.pipeline import run_stage
            from workflow.runs import decode_upstream

            try:
                upstream = decode_upstream(args.upstream)
            except ValueError as err:  # a malformed upstream parameter: a usage error
                return _fail(str(err), 2, err)
            run_id, metrics = run_stage(args.entry, rspec, upstream, reporter=reporter)
            reporter.note(f"{args.entry}: {format_metrics(metrics)}")
    except UpstreamMismatch as err:  # the upstream parameter names runs this spec cannot use
        return _fail(str(err), 2, err)
    except Exception as err:  # noqa: BLE001  (reported, traceback logged as error.txt)
        if os.environ.get("BETTY_TRACEBACK"):
            import traceback

            traceback.print_exc()
        return _fail(f"{type(err).__name__}: {err}", 1, err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
