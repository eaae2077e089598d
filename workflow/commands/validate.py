"""``betty validate SPEC...``: check specs without running anything, and warn (with
``--strict``: fail) when one cannot run here (:func:`environment_problems`).
"""

from __future__ import annotations

from typing import Annotated, List

import typer

from workflow.commands._common import JsonOpt, SetOpt, emit_json


def environment_problems(rspec) -> list[str]:
    """Why ``rspec`` cannot run on this machine: its dataset's files are missing
    (:func:`betty.data.check_available`), ``train.device`` is not here (``auto`` and
    ``cpu`` always are: torch is imported only to ask about another device), or its
    precision cannot train its backend on the device it resolves to here
    (:meth:`betty.precision.Precision.unsupported`)."""
    from betty.data import DatasetNotFoundError, check_available

    problems = []
    ds, train = rspec.spec.dataset, rspec.spec.train
    try:
        check_available(ds.name, ds.root, **rspec.dataset_options)
    except DatasetNotFoundError as err:
        problems.append(f"data files missing: {err}")
    mixed16 = train.precision == "16-mixed" and rspec.spec.model.arch != "revgnn"
    if train.device not in ("auto", "cpu") or mixed16:
        from workflow.components import resolve_device

        try:
            device = resolve_device(train.device).type  # raises for no device but auto and cpu
        except RuntimeError as err:
            return [*problems, str(err)]
        if mixed16:
            from betty.backends import resolve_backend
            from betty.precision import Precision

            why = Precision.parse("16-mixed").unsupported(resolve_backend(rspec.spec.model.backend), device)
            if why is not None:
                problems.append(why)
    return problems


def validate(specs: Annotated[List[str], typer.Argument(metavar="SPEC", help="Specs: paths, file names in specs/ or stems.")],
             set_: SetOpt = None, json_: JsonOpt = False,
             strict: Annotated[bool, typer.Option("--strict", help="Treat warnings (missing data files, an unavailable train.device) as errors.")] = False) -> None:
    """Validate specs (and overrides); exit code 2 if any is invalid. Also warns when a
    spec cannot run on this machine (data files missing, train.device unavailable);
    --strict makes those errors."""
    from workflow.spec import SpecError, spec_notes
    from workflow.specfile import load_spec

    results = []
    for ref in specs:
        try:
            r = load_spec(ref, set_ or [])
        except SpecError as err:
            results.append({"spec": ref, "valid": False, "errors": [str(p) for p in err.problems],
                            "message": str(err)})
        else:
            warnings = environment_problems(r)
            results.append({"spec": ref, "valid": not (strict and warnings), "name": r.name, "source": r.source,
                            "spec_sha": r.sha, "warnings": warnings,
                            "notes": spec_notes(r.spec)})
    if json_:
        emit_json({"valid": all(r["valid"] for r in results), "specs": results})
    else:
        for r in results:
            if "message" in r:
                typer.echo(f"INVALID {r['message']}", err=True)
                continue
            label = "ok     " if r["valid"] else "INVALID"
            typer.echo(f"{label} {r['name']}  spec_sha={r['spec_sha']}  ({r['source']})", err=not r["valid"])
            for warning in r["warnings"]:
                typer.echo(f"        {'error' if strict else 'warning'}: {warning}", err=True)
            for note in r["notes"]:
                typer.echo(f"        note: {note}", err=True)
    if not all(r["valid"] for r in results):
        raise typer.Exit(2)
