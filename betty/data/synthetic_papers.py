"""``synthetic-papers``: a graph of ogbn-papers100M's shape, written straight to disk.

At ``scale = 1`` the published shape: N = 111,059,956 nodes, about 1,615,685,872
directed edges, F = 128 features (float32, or the dtype asked for), C = 172 classes,
1,207,179 / 125,265 / 214,338 train / valid / test nodes (the only labelled ones: every other label is
``-1``, as in ogbn-papers100M). ``scale`` multiplies the node, edge and split counts.

The generator never holds the graph: it walks the nodes in blocks of about
``chunk_edges`` in-edges and appends each block's CSR rows, features and labels to the
store's files (:class:`betty.data.store.StoreWriter`); its memory is O(block), whatever
N is. Each block draws from its own ``numpy.random.Generator(PCG64([seed, block]))``,
so the output depends on ``seed`` and ``chunk_edges`` only.

Model (a citation-like graph, directed, in-edges = references received):

* **Popularity.** A node of rank ``r`` (0 = most cited) is ``π(r)``, ``π`` an affine
  bijection ``r -> (a r + b) mod N`` (so IDs carry no popularity order). A cited
  source is drawn as ``π(floor(N u^α))``, ``u`` uniform: rank density ``∝ r^{1/α-1}``,
  a power-law share of citations to the top ranks (``α = 3``).
* **Communities.** ``num_communities = max(C, round(4096 · scale))`` contiguous ID
  ranges; community ``c`` has class ``c mod C``. A share ``p_in = 0.7`` of a node's
  in-edges come from a uniform node of its own community, the rest from the popularity
  draw over all nodes.
* **In-degrees.** ``d_v = floor(m · g_v + u_v)`` with ``g_v`` Lomax(2.5) normalized to
  mean 1 and ``m = E / N``: mean degree ``E / N``, a heavy tail. Each row's sources are
  sorted ascending (canonical CSR order); parallel edges and self-loops are kept as
  drawn. Edge IDs are CSR positions (no ``eid`` array).
* **Features.** ``x_v = s μ_{y_v} + ε_v``, ``μ_k ~ N(0, I_F)`` (drawn from ``seed``),
  ``ε_v ~ N(0, I_F)``, ``s = feature_snr``; ``y_v = class of v's community``.
* **Splits.** A second affine bijection ``ρ`` ranks the nodes; ranks ``[0, n_train)``
  train, the next ``n_valid`` validate, the next ``n_test`` test; only those nodes
  carry their label.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from betty.data.store import StoreWriter

__all__ = ["PAPERS_SHAPE", "PAPERS_DEFAULTS", "normalize_papers_options", "write_synthetic_papers",
           "papers_counts"]

#: ogbn-papers100M's published counts.
PAPERS_SHAPE = {"num_nodes": 111_059_956, "num_edges": 1_615_685_872, "num_features": 128,
                "num_classes": 172, "num_train": 1_207_179, "num_valid": 125_265, "num_test": 214_338}
PAPERS_DEFAULTS = {"scale": 1.0, "seed": 0, "feature_snr": 0.5, "chunk_edges": 1 << 23}

_ALPHA = 3.0
_P_IN = 0.7
_LOMAX = 2.5


def normalize_papers_options(opts: dict) -> dict:
    """Checked options in canonical form (``scale`` a float > 0 giving fewer than 2^31
    nodes, ``seed`` an int >= 0, ``feature_snr`` a float >= 0, ``chunk_edges`` an int >= 1024)."""
    out = dict(opts)
    scale = out["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale={scale!r} (allowed: a number > 0)")
    out["scale"] = float(scale)
    for key, low in (("seed", 0), ("chunk_edges", 1024)):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{key}={v!r} (allowed: an integer >= {low})")
    snr = out["feature_snr"]
    if isinstance(snr, bool) or not isinstance(snr, (int, float)) or snr < 0:
        raise ValueError(f"feature_snr={snr!r} (allowed: a number >= 0)")
    out["feature_snr"] = float(snr)
    n = papers_counts(out["scale"])["num_nodes"]
    if n >= 2**31:
        largest = math.floor(2**31 / PAPERS_SHAPE["num_nodes"] * 100) / 100  # rounded down: allowed
        raise ValueError(f"scale={scale!r} gives {n:,} nodes (allowed: a scale giving fewer than 2^31 "
                         f"nodes, int32 indices: at most {largest})")
    return out


def papers_counts(scale: float) -> dict[str, int]:
    """The counts at ``scale`` (each at least 1; splits at most N in total)."""
    n = max(int(round(PAPERS_SHAPE["num_nodes"] * scale)), 8)
    out = {"num_nodes": n, "num_edges": max(int(round(PAPERS_SHAPE["num_edges"] * scale)), n)}
    for key in ("num_train", "num_valid", "num_test"):
        out[key] = max(int(round(PAPERS_SHAPE[key] * scale)), 1)
    if out["num_train"] + out["num_valid"] + out["num_test"] > n:
        raise ValueError(f"scale={scale} is too small for the splits ({n} nodes)")
    return out


def _coprime_multiplier(n: int, rng: np.random.Generator) -> int:
    while True:
        a = int(rng.integers(1, n))
        if math.gcd(a, n) == 1:
            return a


def write_synthetic_papers(folder: str | Path, opts: dict, *, name: str = "synthetic-papers",
                           scalars: dict | None = None, feature_dtype: torch.dtype = torch.float32) -> dict:
    """Generate the dataset block by block into a store at ``folder`` (the arrays
    ``indptr`` int64, ``indices`` int32, ``feat`` (N, 128) in ``feature_dtype``, each
    block's float32 draw cast as it is appended, ``label`` int64, ``train_idx`` /
    ``valid_idx`` / ``test_idx`` int64); returns the counts written."""
    counts = papers_counts(opts["scale"])
    n, f, c = counts["num_nodes"], PAPERS_SHAPE["num_features"], PAPERS_SHAPE["num_classes"]
    seed, chunk = int(opts["seed"]), int(opts["chunk_edges"])
    head = np.random.default_rng([seed, 2**32 - 1])
    mean_degree = counts["num_edges"] / n
    num_comm = max(c, int(round(4096 * opts["scale"])))
    comm_size = -(-n // num_comm)
    pop_a, pop_b = _coprime_multiplier(n, head), int(head.integers(0, n))
    split_a, split_b = _coprime_multiplier(n, head), int(head.integers(0, n))
    centroids = head.standard_normal((c, f)).astype(np.float32) * np.float32(opts["feature_snr"])
    lomax_mean = 1.0 / (_LOMAX - 1.0)
    n_lab = counts["num_train"] + counts["num_valid"] + counts["num_test"]
    rows_per_block = max(1, int(chunk / max(mean_degree, 1.0)))
    offset = 0
    with StoreWriter(folder, scalars) as w:
        indptr_w = w.array("indptr", torch.int64)
        indices_w = w.array("indices", torch.int32)
        feat_w = w.array("feat", feature_dtype, (f,))
        label_w = w.array("label", torch.int64)
        indptr_w.append(np.zeros(1, dtype=np.int64))
        for block, lo in enumerate(range(0, n, rows_per_block)):
            hi = min(lo + rows_per_block, n)
            rng = np.random.default_rng([seed, block])
            v = np.arange(lo, hi, dtype=np.int64)
            g = rng.pareto(_LOMAX, hi - lo) / lomax_mean
            deg = np.floor(mean_degree * g + rng.random(hi - lo)).astype(np.int64)
            total = int(deg.sum())
            row = np.repeat(v, deg)
            local = rng.random(total) < _P_IN
            comm_lo = (row // comm_size) * comm_size
            comm_len = np.minimum(comm_lo + comm_size, n) - comm_lo
            src = np.empty(total, dtype=np.int64)
            src[local] = comm_lo[local] + (rng.random(int(local.sum())) * comm_len[local]).astype(np.int64)
            far = ~local
            rank = np.minimum((n * rng.random(int(far.sum())) ** _ALPHA).astype(np.int64), n - 1)
            src[far] = (pop_a * rank + pop_b) % n
            del local, far, rank, comm_lo, comm_len
            order = np.lexsort((src, row))  # rows ascending (already), sources ascending in each
            indices_w.append(src[order].astype(np.int32))
            del src, row, order
            indptr_w.append(offset + np.cumsum(deg))
            offset += total
            y = (v // comm_size) % c
            x = rng.standard_normal((hi - lo, f), dtype=np.float32)
            x += centroids[y]
            feat_w.append(x)
            split_rank = (split_a * v + split_b) % n
            label_w.append(np.where(split_rank < n_lab, y, -1))
        inv = pow(split_a, -1, n)
        bounds = np.cumsum([0, counts["num_train"], counts["num_valid"], counts["num_test"]])
        for key, a, b in zip(("train_idx", "valid_idx", "test_idx"), bounds[:-1], bounds[1:]):
            ranks = np.arange(a, b, dtype=np.int64)
            w.put(key, torch.from_numpy(np.sort((inv * (ranks - split_b)) % n)))
    return {**counts, "num_edges": offset}
