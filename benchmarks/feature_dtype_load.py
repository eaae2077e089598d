"""Load time and resident memory of a cached dataset's features: float32, float32 cast
to bfloat16 after loading, and a bfloat16 cache entry, each in a fresh process.

Each case runs :func:`betty.data.load_dataset` on the cache entries of ``--dataset`` at
``--scale`` (built first if absent; imports not timed) in its own child process and
reports the wall time of the load (with the cast, for ``float32+cast``) and the
process's resident memory after it (``/proc/self/status``: ``VmRSS`` = ``RssAnon``,
memory the process allocated, + ``RssFile``, mapped file pages it touched)::

    PYTHONPATH=$PWD python benchmarks/feature_dtype_load.py --scale 0.25 --root /tmp/fd

Cases: ``float32`` (the float32 entry), ``float32+cast`` (the float32 entry, then
``feat.to(torch.bfloat16)``), ``bfloat16`` (``feature_dtype="bfloat16"``: its own
entry, the features mapped in bfloat16).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

_CASES = ("float32", "float32+cast", "bfloat16")


def _status() -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` of this process, bytes."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _child(args) -> None:
    import torch

    from betty.data import load_dataset

    dtype = "bfloat16" if args.child == "bfloat16" else None
    before, t0 = _status(), time.perf_counter()
    ds = load_dataset(args.dataset, args.root, scale=args.scale, feature_dtype=dtype)
    feat = ds.feat.to(torch.bfloat16) if args.child == "float32+cast" else ds.feat
    wall, after = time.perf_counter() - t0, _status()
    print(json.dumps({"wall": wall, "dtype": str(feat.dtype), "feat_bytes": feat.numel() * feat.element_size(),
                      **{k: after[k] - before[k] for k in after}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="synthetic-products")
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--root", default="data")
    ap.add_argument("--child", choices=_CASES, help=argparse.SUPPRESS)
    ap.add_argument("cases", nargs="*", help=f"any of {', '.join(_CASES)} (default: all)")
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    for dtype in ("float32", "bfloat16"):  # build the entries, untimed
        subprocess.run([sys.executable, "-c", "import sys; from betty.data import load_dataset; "
                        "load_dataset(sys.argv[1], sys.argv[2], scale=float(sys.argv[3]), feature_dtype=sys.argv[4])",
                        args.dataset, args.root, str(args.scale), dtype], check=True)
    print(f"{args.dataset} scale {args.scale}; change of resident memory over the load, MiB")
    print(f"{'case':<14} {'wall s':>7} {'feat MiB':>9} {'VmRSS':>8} {'RssAnon':>8} {'RssFile':>8}")
    for case in args.cases or _CASES:
        out = subprocess.run([sys.executable, __file__, "--dataset", args.dataset, "--scale", str(args.scale),
                              "--root", args.root, "--child", case], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"--child {case} failed:\n{out.stderr}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{case:<14} {r['wall']:7.3f} {r['feat_bytes'] / 2**20:9.1f} {r['VmRSS'] / 2**20:8.1f} "
              f"{r['RssAnon'] / 2**20:8.1f} {r['RssFile'] / 2**20:8.1f}")


if __name__ == "__main__":
    main()
