"""``betty validate SPEC...``: check specs without running anything."""

from __future__ import annotations

from typing import Annotated, List

import typer

from workflow.commands._common import JsonOpt, SetOpt, cli_errors, emit_json


@cli_errors
def validate(specs: Annotated[List[str], typer.Argument(metavar="SPEC", help="Specs: paths, file names in specs/ or stems.")],
             set_: SetOpt = None, json_: JsonOpt = False,
             strict: Annotated[bool, typer.Option("--strict", help="Treat warnings (missing data files, an unavailable train.device) as errors.")] = False) -> None:
    """Validate specs (and overrides); exit code 2 if any is invalid. Also warns when a
    spec cannot run on this machine (data files missing, train.device unavailable);
    --strict makes those errors."""
    from workflow.preflight_checks import environment_problems
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


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
