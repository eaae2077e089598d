"""``betty specs``: the shipped specs, one line each."""

from __future__ import annotations

from pathlib import Path

import typer

from workflow.commands._common import JsonOpt, emit_json, fail


def describe(path: Path) -> str:
    """The spec's ``description:`` field, else its first comment line, else ``""``;
    ``"(unreadable: ...)"`` for a file that cannot be read as text (the listing goes on)."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        return f"(unreadable: {getattr(err, 'strerror', None) or type(err).__name__})"
    try:
        raw = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError):
        raw = None
    if isinstance(raw, dict) and isinstance(raw.get("description"), str):
        return raw["description"].strip()
    for line in text.splitlines():
        if line.strip().startswith("#"):
            return line.strip().lstrip("#").strip()
    return ""


def specs(json_: JsonOpt = False) -> None:
    """List the shipped specs (use a name with run/validate/stage)."""
    from workflow.specfile import shipped_specs, specs_dir

    if not specs_dir().is_dir():
        raise fail(f"the specs folder {str(specs_dir())!r} does not exist (BETTY_SPECS_DIR, else the "
                   "project's specs/)", 2)
    rows = [{"name": p.stem, "path": str(p), "description": describe(p)} for p in shipped_specs()]
    if json_:
        emit_json({"specs_dir": str(specs_dir()), "specs": rows})
        return
    width = max((len(r["name"]) for r in rows), default=0)
    for r in rows:
        typer.echo(f"{r['name']:<{width}}  {r['description']}")
