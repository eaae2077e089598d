"""Time of a load from betty's dataset cache, per ``verify`` setting, each in a fresh process.

Each listed setting runs :func:`betty.data.cache.load_cached` once in its own child
process (imports not timed) on the cache entry of ``--dataset`` at ``--scale`` (built
first if absent) and reports its wall time, CPU time (``time.process_time``) and the
bytes it read (``/proc/self/io``: ``rchar``, every byte read through ``read()``, the
hashing included; ``read_bytes``, what missed the page cache). ``--cold`` first drops
the entry's files (only those) from the page cache
(``posix_fadvise(POSIX_FADV_DONTNEED)``), so each load starts from the disk::

    PYTHONPATH=$PWD python benchmarks/cache_load.py --scale 1.0 --root /tmp/sv full true true false
    PYTHONPATH=$PWD python benchmarks/cache_load.py --scale 1.0 --root /tmp/sv --cold full true false

Settings: ``full`` (hash every file), ``true`` (the default), ``false`` (sizes only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from proc_io import process_io  # benchmarks/, the script's folder

_SETTINGS = {"full": "full", "true": True, "false": False}


def _evict(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache (clean pages only; nothing is lost)."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _child(args) -> None:
    from betty.data import cache_path
    from betty.data.cache import load_cached

    path = cache_path(args.dataset, args.root, scale=args.scale)
    io0, t0, c0 = process_io(), time.perf_counter(), time.process_time()
    ds = load_cached(path, verify=_SETTINGS[args.child])
    wall, cpu, io1 = time.perf_counter() - t0, time.process_time() - c0, process_io()
    if ds is None:
        raise SystemExit(f"no usable cache entry at {path}")
    files = sum(p.stat().st_size for p in path.iterdir() if p.suffix == ".bin")
    print(json.dumps({"wall": wall, "cpu": cpu, "files": files, "path": str(path),
                      "nodes": ds.num_nodes, "edges": ds.num_edges,
                      "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
                      "read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="synthetic-products")
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--root", default="data")
    ap.add_argument("--cold", action="store_true", help="drop the files from the page cache first")
    ap.add_argument("--child", choices=sorted(_SETTINGS), help=argparse.SUPPRESS)
    ap.add_argument("settings", nargs="*", help="any of full, true, false (default: full true true false)")
    args = ap.parse_args()
    args.settings = args.settings or ["full", "true", "true", "false"]
    if set(args.settings) - set(_SETTINGS):
        ap.error(f"settings are among {', '.join(_SETTINGS)}, not {args.settings}")
    if args.child:
        _child(args)
        return
    base = [sys.executable, __file__, "--dataset", args.dataset, "--scale", str(args.scale),
            "--root", args.root]
    from betty.data import cache_path

    folder = cache_path(args.dataset, args.root, scale=args.scale)
    if not folder.is_dir():
        subprocess.run([sys.executable, "-c", "import sys; from betty.data import load_dataset; "
                        "load_dataset(sys.argv[1], sys.argv[2], scale=float(sys.argv[3]))",
                        args.dataset, args.root, str(args.scale)], check=True)
    rows = []
    for setting in args.settings:
        if args.cold:
            _evict(folder)
        out = subprocess.run([*base, "--child", setting], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"--child {setting} failed:\n{out.stderr}")
        rows.append((setting, json.loads(out.stdout.strip().splitlines()[-1])))
    first = rows[0][1]
    print(f"{args.dataset} scale {args.scale}: {first['nodes']:,} nodes, {first['edges']:,} edges; "
          f".bin files {first['files'] / 2**30:.2f} GiB at {first['path']}"
          f"{'; page cache dropped before each load' if args.cold else ''}")
    print(f"{'verify':<8} {'wall s':>8} {'cpu s':>8} {'rchar GiB':>10} {'read_bytes GiB':>15}")
    for setting, r in rows:
        print(f"{setting:<8} {r['wall']:8.2f} {r['cpu']:8.2f} {r['rchar'] / 2**30:10.2f} "
              f"{r['read_bytes'] / 2**30:15.2f}")


if __name__ == "__main__":
    main()
