"""Exact redundancy minimisation: a K-way hypergraph partition of the output nodes.

Model. Vertices are the ``n_out`` output nodes. Each layer-0 input node ``i`` is a
hyperedge ``e_i = {j : P_0[i, j] = 1}`` over the outputs whose sampled L-hop
neighbourhood contains it (:func:`~betty.partition.incidence.multi_hop_incidence`). A
K-way split loads input ``i`` once per micro-batch its hyperedge touches, ``λ(e_i)`` times, so

    Σ_k |inputs of micro-batch k| = Σ_i λ(e_i) = n_in + Σ_i (λ(e_i) - 1) = n_in + km1,

i.e. the connectivity-minus-one objective (km1) with unit hyperedge weights is exactly
the number of redundant input-feature loads, and ``redundancy = 1 + km1 / n_in``.
Hyperedges of size 1 never cost anything and are dropped before partitioning.

The partitioner is Mt-KaHyPar, imbalance ``epsilon = 0.03`` on the vertex weights (the
same tolerance as METIS's default ``ufactor = 30``), with the ``DEFAULT`` preset, or
the ``DETERMINISTIC`` preset (reproducible for a seed and thread count, several times
slower on large batches) when ``deterministic=True``. ``threads`` sizes Mt-KaHyPar's
thread pool (default: ``torch.get_num_threads()``, i.e. ``train.threads`` when a spec
sets it), never the machine's core count; a process has one pool, sized at its first
use. ``mtkahypar.set_seed`` seeds the ``DEFAULT`` preset; the ``DETERMINISTIC`` preset
ignores it (checked on mtkahypar 1.7), so the seed also relabels the vertices with a seeded random permutation before partitioning.

Time limit. Mt-KaHyPar's Python API has no time limit, so with ``time_limit_s`` the
partitioner runs in a child interpreter (a fresh process: no thread pool is inherited,
and the caller's ``__main__`` is not run again) that is killed at the deadline; the split then falls back to ``reg`` at the same K, with a
logged warning and ``info["fallback_from"] = "hypergraph"``. The limit covers the whole
hypergraph attempt: building the incidence, then the child's start-up, hypergraph
construction and partitioning get what is left of it (none left: Mt-KaHyPar is not
started). The ``reg`` fallback's own time comes on top.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from betty.batch import SampledBatch
from betty.partition.balance import fill_empty_micro_batches, integer_vertex_weights
from betty.partition.base import PartitionResult, c_int_seed, register
from betty.partition.incidence import multi_hop_incidence
from betty.partition.reg import REG_OPTIONS, reg_partition

__all__ = ["hypergraph_partition", "mtkahypar_initializer", "run_mtkahypar", "IMBALANCE_EPSILON"]

log = logging.getLogger(__name__)

#: Allowed block-weight imbalance (max block weight <= (1 + eps) * average).
IMBALANCE_EPSILON = 0.03
_PRESETS = ("DEFAULT", "DETERMINISTIC", "DETERMINISTIC_QUALITY", "QUALITY", "HIGHEST_QUALITY",
            "LARGE_K")

_POOL: dict[str, object] = {}
"""This process's Mt-KaHyPar initializer and its ``threads``: Mt-KaHyPar keeps one
thread pool per process, sized by its first initialisation."""


def _default_threads() -> int:
    import torch

    return max(1, int(torch.get_num_threads()))


def mtkahypar_initializer(threads: int):
    """Mt-KaHyPar's initializer, its pool sized ``threads`` at the first call in this
    process; a later call for another count gets the same pool, with a warning
    (:func:`pool_threads` tells the count in effect)."""
    threads = int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if not _POOL:
        import mtkahypar

        _POOL.update(initializer=mtkahypar.initialize(threads, False), threads=threads)
    elif _POOL["threads"] != threads and not _POOL.get("warned"):
        _POOL["warned"] = True
        log.warning("Mt-KaHyPar's thread pool has %d threads in this process (its first use); "
                    "%d asked for now are not available to it", _POOL["threads"], threads)
    return _POOL["initializer"]


def pool_threads(threads: int) -> int:
    """The threads Mt-KaHyPar runs with in this process when ``threads`` are asked for."""
    return int(_POOL.get("threads", threads))


def run_mtkahypar(n: int, pins: np.ndarray, indptr: np.ndarray, vweights: np.ndarray, k: int,
                  epsilon: float, preset: str, threads: int, seed: int) -> tuple[np.ndarray, int]:
    """One Mt-KaHyPar km1 partition of a hypergraph in CSR form.

    Args:
        n: number of vertices.
        pins: ``(nnz,)`` int32 vertex of each pin; hyperedge ``h`` is
            ``pins[indptr[h]:indptr[h + 1]]``.
        indptr: ``(m + 1,)`` hyperedge pointers.
        vweights: ``(n,)`` int32 vertex weights.
        k, epsilon, preset, threads, seed: Mt-KaHyPar's settings.

    Returns:
        ``(block of each vertex (n,) int64, km1)``.
    """
    import mtkahypar

    mk = mtkahypar_initializer(threads)
    ctx = mk.context_from_preset(mtkahypar.PresetType.__members__[preset])
    ctx.set_partitioning_parameters(int(k), float(epsilon), mtkahypar.Objective.KM1)
    ctx.logging = False
    mtkahypar.set_seed(c_int_seed(seed))
    m = indptr.size - 1
    # the Python API takes a sequence of pin sequences: views into one array
    edges = np.split(pins, indptr[1:-1]) if m else []
    hg = mk.create_hypergraph(ctx, int(n), m, edges, vweights, np.ones(m, dtype=np.int32))
    phg = hg.partition(ctx)
    return np.asarray(phg.get_partition(), dtype=np.int64), int(phg.km1())


_CHILD = ("import sys, json; sys.path[:0] = json.loads(sys.argv[1]); "
          "from betty.partition.hypergraph import _child_main; _child_main(sys.argv[2])")
"""The child's program: the parent's import path, then :func:`_child_main` on a folder.
A fresh interpreter (not ``multiprocessing``'s spawn, which imports the parent's
``__main__`` again: a user's script without an ``if __name__ == "__main__"`` guard
would rerun itself there)."""


def _child_main(folder: str) -> None:  # runs in the child interpreter
    """Read ``args.pkl`` from ``folder``, partition, write ``("ok", result)`` or
    ``("error", message)`` to ``out.pkl``."""
    import pickle
    from pathlib import Path

    with open(Path(folder) / "args.pkl", "rb") as fh:
        args = pickle.load(fh)
    try:
        out = ("ok", run_mtkahypar(*args))
    except BaseException as err:  # noqa: BLE001  (reported to the parent)
        out = ("error", f"{type(err).__name__}: {err}")
    with open(Path(folder) / "out.pkl.part", "wb") as fh:
        pickle.dump(out, fh, protocol=pickle.HIGHEST_PROTOCOL)
    Path(folder, "out.pkl.part").rename(Path(folder) / "out.pkl")


def _run_with_deadline(args: tuple, time_limit_s: float):
    """:func:`run_mtkahypar` in a child interpreter (:data:`_CHILD`); ``None`` if it
    missed the deadline (it is killed then)."""
    import json
    import os
    import pickle
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    deadline = time.monotonic() + time_limit_s
    with tempfile.TemporaryDirectory(prefix="betty-mtkahypar-") as folder:
        with open(Path(folder) / "args.pkl", "wb") as fh:
            pickle.dump(args, fh, protocol=pickle.HIGHEST_PROTOCOL)
        path = [os.fspath(p) for p in sys.path if isinstance(p, (str, os.PathLike))]  # import skips others
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(path), folder],
                                stdin=subprocess.DEVNULL)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        try:
            with open(Path(folder) / "out.pkl", "rb") as fh:
                status, payload = pickle.load(fh)
        except FileNotFoundError:  # the child died without a word
            status, payload = "error", f"the Mt-KaHyPar process exited with code {proc.returncode}"
    if status != "ok":
        raise RuntimeError(f"hypergraph partitioning failed: {payload}")
    return payload


@register("hypergraph", options=("time_limit_s", "threads", *REG_OPTIONS))  # REG's: its fallback's
def hypergraph_partition(
    batch: SampledBatch,
    k: int,
    *,
    seed: int = 0,
    weights=None,
    graph=None,
    epsilon: float = IMBALANCE_EPSILON,
    preset: str | None = None,
    deterministic: bool = False,
    threads: int | None = None,
    time_limit_s: float | None = None,
    **reg_options,
) -> PartitionResult:
    """Minimise km1 (= redundant input loads) with Mt-KaHyPar.

    Args:
        preset: a ``mtkahypar.PresetType`` name; default ``"DETERMINISTIC"`` if
            ``deterministic`` else ``"DEFAULT"``.
        deterministic: reproducible splits for a seed and thread count.
        threads: Mt-KaHyPar threads (default ``torch.get_num_threads()``); in this
            process its pool keeps the count of its first use (``info["threads"]`` is
            the count in effect), a time-limited child has its own.
        time_limit_s: wall-clock limit of the Mt-KaHyPar call; when it is hit the split
            is ``reg``'s at the same K (see the module docstring). ``None``: no limit
            (runs in this process).
        reg_options: the REG options of that fallback (``partitioner``,
            ``trainer_threads``, ``max_hub_degree``, ``hub_links``: as the ``reg`` method
            takes them; ``deterministic`` is passed on too).

    ``info`` holds ``km1`` (as reported by Mt-KaHyPar; equals
    ``Σ_k |inputs of micro-batch k| - n_in`` before any empty-micro-batch repair),
    ``hyperedges`` and ``pins`` (after dropping size-1 hyperedges), ``preset``,
    ``threads``; after a fallback, ``reg``'s info plus ``fallback_from``,
    ``fallback_reason`` and ``hypergraph_time_s`` (the wait for Mt-KaHyPar, also counted in
    ``time_partition_s``).

    Raises:
        ValueError: unknown preset, ``threads < 1``, ``time_limit_s <= 0`` or an option
            the ``reg`` fallback does not take.
    """
    preset = preset or ("DETERMINISTIC" if deterministic else "DEFAULT")
    if preset not in _PRESETS:
        raise ValueError(f"preset must be one of {sorted(_PRESETS)}, got {preset!r}")
    threads = _default_threads() if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 seconds or None, got {time_limit_s}")
    stray = sorted(set(reg_options) - set(REG_OPTIONS))
    if stray:
        raise ValueError(f"hypergraph_partition takes the reg fallback's options {list(REG_OPTIONS)}, not {stray}")

    start = time.perf_counter()
    n_out = batch.num_outputs
    incidence = multi_hop_incidence(batch)  # (n_in, n_out) CSR: row i = hyperedge of i
    size = np.diff(incidence.indptr)
    shared = incidence[size >= 2]
    # seeded relabelling: vertex v is passed to Mt-KaHyPar as perm[v]
    perm = np.random.default_rng(int(seed)).permutation(n_out).astype(np.int32)
    pins = perm[shared.indices]
    vweights = np.empty(n_out, dtype=np.int32)
    vweights[perm] = integer_vertex_weights(weights, n_out)
    args = (n_out, pins, np.asarray(shared.indptr, dtype=np.int64), vweights, int(k),
            float(epsilon), preset, threads, int(seed))
    built = time.perf_counter()
    if time_limit_s is None:
        out = run_mtkahypar(*args)
    else:
        left = float(time_limit_s) - (built - start)
        out = _run_with_deadline(args, left) if left > 0 else None
    if out is None:
        waited = time.perf_counter() - built
        reason = (f"the hypergraph split (Mt-KaHyPar {preset}, {threads} threads) did not "
                  f"finish K={k} within partition.time_limit_s={time_limit_s}")
        log.warning("%s; falling back to 'reg' for this split", reason)
        result = reg_partition(batch, k, seed=seed, weights=weights, deterministic=deterministic, **reg_options)
        result.info.update(fallback_from="hypergraph", fallback_reason=reason, hypergraph_time_s=waited)
        result.time_build_s += built - start
        result.time_partition_s += waited  # the time given to Mt-KaHyPar was spent partitioning
        return result
    part, km1 = out
    groups = part[perm]
    done = time.perf_counter()
    groups, moved = fill_empty_micro_batches(groups, k)
    info = {
        "km1": km1,
        "hyperedges": int(shared.shape[0]),
        "pins": int(shared.nnz),
        "moved_to_empty": moved,
        "epsilon": float(epsilon),
        "preset": preset,
        "threads": threads if time_limit_s is not None else pool_threads(threads),  # a child: its own pool
    }
    return PartitionResult(groups, k, "hypergraph", built - start, done - built, info)
