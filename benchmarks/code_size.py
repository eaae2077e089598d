"""Lines of Python in a package, split into code, docstrings, comments and blank lines.

    python benchmarks/code_size.py                     # betty/ and workflow/ as they are on disk
    python benchmarks/code_size.py workflow --rev 02ed1c2   # workflow/ at a commit

A line is a docstring line when it lies in a string expression statement (a module's,
class's or function's docstring, or any bare string); a comment line starts with ``#``;
everything else that is not blank is code. ``total`` is what ``wc -l`` counts.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def count(source: str) -> dict[str, int]:
    """``{"total", "code", "docstring", "comment", "blank"}`` line counts of one file."""
    lines = source.splitlines()
    doc: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc.update(range(node.lineno, node.end_lineno + 1))
    out = {"total": len(lines), "code": 0, "docstring": 0, "comment": 0, "blank": 0}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        kind = "docstring" if number in doc else "blank" if not text else "comment" if text.startswith("#") else "code"
        out[kind] += 1
    return out


def sources(folder: str, rev: str | None) -> dict[str, str]:
    """``{path: text}`` of every ``*.py`` under ``folder`` on disk, or at commit ``rev``."""
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / folder).rglob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, folder], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    return {name: subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, check=True, capture_output=True,
                                 text=True).stdout for name in names if name.endswith(".py")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", default=["betty", "workflow"])
    parser.add_argument("--rev", help="a git commit (default: the files on disk)")
    args = parser.parse_args()
    print("| folder | files | total | code | docstring | comment | blank |")
    print("|---|---|---|---|---|---|---|")
    for folder in args.folders:
        files = sources(folder, args.rev)
        sums = {"total": 0, "code": 0, "docstring": 0, "comment": 0, "blank": 0}
        for text in files.values():
            for key, value in count(text).items():
                sums[key] += value
        print(f"| {folder} | {len(files)} | " + " | ".join(f"{sums[k]:,}" for k in sums) + " |")


if __name__ == "__main__":
    main()
