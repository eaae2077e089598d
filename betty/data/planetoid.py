"""Stage raw Planetoid files (``ind.<name>.*``) where DGL's citation classes read them."""

from __future__ import annotations

import shutil
from pathlib import Path

from betty.data.dgl_builtin import DGL_BUILTINS, PLANETOID_SUFFIXES, dgl_raw_path

__all__ = ["PLANETOID_NAMES", "stage_planetoid"]

PLANETOID_NAMES = ("cora", "citeseer", "pubmed")


def stage_planetoid(
    src_dir: str | Path, raw_dir: str | Path, name: str, *, symlink: bool = True
) -> Path:
    """Make ``src_dir/ind.<name>.*`` readable by DGL's class under ``raw_dir``.

    Creates ``dgl_raw_path(name, raw_dir)`` (e.g. ``raw_dir/cora_v2_d697a464``) holding
    ``ind.<dgl name>.<suffix>`` for the eight Planetoid suffixes, as symlinks to the
    source files (``symlink=False`` copies them). Existing staged files are kept, so
    staging twice is harmless. The source directory is only read.

    Args:
        src_dir: folder with the Planetoid files ``ind.<name>.{x,y,tx,ty,allx,ally,graph,test.index}``.
        raw_dir: the ``root`` later given to ``load_dataset(name, root=raw_dir)``.
        name: ``"cora"``, ``"citeseer"`` or ``"pubmed"``.

    Returns:
        The staged folder.

    Raises:
        ValueError: unknown ``name``. FileNotFoundError: source files missing.
    """
    if name not in PLANETOID_NAMES:
        raise ValueError(f"name={name!r} is not a Planetoid dataset; allowed: {list(PLANETOID_NAMES)}")
    src_dir = Path(src_dir)
    sources = [src_dir / f"ind.{name}.{s}" for s in PLANETOID_SUFFIXES]
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"Planetoid files for {name!r} missing: {', '.join(missing)}")
    folder = dgl_raw_path(name, raw_dir)
    folder.mkdir(parents=True, exist_ok=True)
    dgl_name = DGL_BUILTINS[name].dgl_name
    for source, suffix in zip(sources, PLANETOID_SUFFIXES):
        target = folder / f"ind.{dgl_name}.{suffix}"
        if target.exists():
            continue
        if target.is_symlink():  # dangling link from an earlier staging
            target.unlink()
        if symlink:
            target.symlink_to(source.resolve())
        else:
            shutil.copyfile(source, target)
    return folder
