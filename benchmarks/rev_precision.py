"""RevGNN's reversible reconstruction under bf16 autocast, against depth.

Builds ``depth`` grouped additive couplings (:class:`betty.rev.coupling.ReversibleCoupling`,
2 groups, ``f = GCN(ReLU(LayerNorm(H)))``, independent weights) on a random graph, runs
``X_0 -> X_L`` forward and reconstructs ``X_0`` by inverting the couplings from ``X_L``
(what the reversible backward pass does, block by block). Prints, per depth and mode,
the relative reconstruction error ``||X_0' - X_0|| / ||X_0||`` and the forward drift
``||X_L - X_L^32|| / ||X_L^32||`` against the float32 chain:

* ``32``: no autocast;
* ``bf16, f32 adds``: ``f`` under bf16 autocast, the stream ``X`` and the coupling's
  additions/subtractions in float32 (autocast leaves ``bf16 + float32`` in float32),
  the inverse under the same autocast (so ``f`` recomputes bit for bit);
* ``bf16 adds``: as above, but the stream stored in bfloat16 after every coupling (the
  additions round to bfloat16);
* ``bf16 f, f32 inverse``: forward under autocast, inverse without it (``f`` recomputed
  in float32 differs from the forward's by bf16 rounding).

    PYTHONPATH=$PWD python benchmarks/rev_precision.py --depths 8 112 1001
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

from betty.rev.coupling import GroupFunction, ReversibleCoupling

MODES = ("32", "bf16, f32 adds", "bf16 adds", "bf16 f, f32 inverse")


def _graph(nodes: int, degree: int, seed: int):
    import dgl

    dgl.seed(seed)
    g = dgl.rand_graph(nodes, nodes * degree)
    return dgl.add_self_loop(dgl.remove_self_loop(g))


def run(depth: int, nodes: int, width: int, degree: int, seed: int = 0) -> dict[str, tuple[float, float]]:
    """``{mode: (reconstruction error, forward drift)}``."""
    torch.manual_seed(seed)
    g = _graph(nodes, degree, seed)
    couplings = [ReversibleCoupling([GroupFunction(width) for _ in range(2)]) for _ in range(depth)]
    x0 = torch.randn(nodes, 2 * width)
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    none = contextlib.nullcontext
    out, ref_last = {}, None
    with torch.no_grad():
        for mode in MODES:
            fwd_ctx = none if mode == "32" else bf16
            inv_ctx = none if mode in ("32", "bf16 f, f32 inverse") else bf16
            x = x0.bfloat16() if mode == "bf16 adds" else x0
            for c in couplings:
                with fwd_ctx():
                    x = c(g, x)
                if mode == "bf16 adds":
                    x = x.bfloat16()
            last = x.float()
            if mode == "32":
                ref_last = last
            for c in reversed(couplings):
                with inv_ctx():
                    x = c.inverse(g, x)
                if mode == "bf16 adds":
                    x = x.bfloat16()
            rec = float((x.float() - x0).norm() / x0.norm())
            drift = float((last - ref_last).norm() / ref_last.norm())
            out[mode] = (rec, drift)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 112, 1001])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--width", type=int, default=16, help="group width (2 groups)")
    parser.add_argument("--degree", type=int, default=5)
    args = parser.parse_args()
    start = time.process_time()
    print(f"nodes {args.nodes}, 2 groups x {args.width}, degree {args.degree}, torch {torch.__version__}")
    print(f"{'depth':>6} {'mode':<20} {'reconstruction':>14} {'forward drift':>14}")
    for depth in args.depths:
        for mode, (rec, drift) in run(depth, args.nodes, args.width, args.degree).items():
            print(f"{depth:>6} {mode:<20} {rec:14.2e} {drift:14.2e}")
    print(f"CPU {time.process_time() - start:.1f} s, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
