"""``betty validate SPEC...``: check specs without running anything."""

from __future__ import annotations

from typing import Annotated, List

import typer

from workflow.commands._common import JsonOpt, SetOpt, cli_errors, emit_json


@cli_errors
def validate(specs: Annotated[List[str], typer.Argument(help="Specs: paths, file names in specs/ or stems.")],
             set_: SetOpt = None, json_: JsonOpt = False) -> None:
    """Validate specs (and overrides); exit code 2 if any is invalid."""
    from workflow.library import missing_features
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
            results.append({"spec": ref, "valid": True, "name": r.name, "source": r.source, "spec_sha": r.sha,
                            "not_available_yet": missing_features(r.spec), "notes": spec_notes(r.spec)})
    if json_:
        emit_json({"valid": all(r["valid"] for r in results), "specs": results})
    else:
        for r in results:
            if r["valid"]:
                typer.echo(f"ok      {r['name']}  spec_sha={r['spec_sha']}  ({r['source']})")
                for note in r["not_available_yet"] + r["notes"]:
                    typer.echo(f"        note: {note}", err=True)
            else:
                typer.echo(f"INVALID {r['message']}", err=True)
    if not all(r["valid"] for r in results):
        raise typer.Exit(2)


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
