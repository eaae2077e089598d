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
slower on large batches) when ``deterministic=True``. ``threads`` sets Mt-KaHyPar's
thread pool (default: ``torch.get_num_threads()``, i.e. ``train.threads`` when a spec
sets it), never the machine's core count. ``mtkahypar.set_seed`` seeds the ``DEFAULT``
preset; the ``DETERMINISTIC`` preset ignores it (checked on mtkahypar 1.7), so the seed
also relabels the vertices with a seeded random permutation before partitioning.

Time limit. Mt-KaHyPar's Python API has no time limit, so with ``time_limit_s`` the
partitioner runs in a child process (spawned, so no thread pool is inherited) that is
killed at the deadline; the split then falls back to ``reg`` at the same K, with a
logged warning and ``info["fallback_from"] = "hypergraph"``. The limit covers the whole
hypergraph attempt: building the incidence, then the child's start-up, hypergraph
construction and partitioning get what is left of it (none left: Mt-KaHyPar is not
started). The ``reg`` fallback's own time comes on top.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
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

_INITIALIZERS: dict[int, object] = {}


def _default_threads() -> int:
    import torch

    return max(1, int(torch.get_num_threads()))


def mtkahypar_initializer(threads: int):
    """Mt-KaHyPar's initializer with ``threads`` threads (one per thread count per
    process)."""
    threads = int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if threads not in _INITIALIZERS:
        import mtkahypar

        _INITIALIZERS[threads] = mtkahypar.initialize(threads, False)
    return _INITIALIZERS[threads]


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


def _child(conn, args) -> None:  # runs in the spawned process
    try:
        conn.send(("ok", run_mtkahypar(*args)))
    except BaseException as err:  # noqa: BLE001  (reported to the parent)
        conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        conn.close()


def _run_with_deadline(args: tuple, time_limit_s: float):
    """:func:`run_mtkahypar` in a spawned child; ``None`` if it missed the deadline."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, args), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(time_limit_s):
            return None
        status, payload = recv.recv()
    except EOFError:  # the child died without a word: its exit code, once it is known
        proc.join(timeout=5)
        status, payload = "error", f"the Mt-KaHyPar process exited with code {proc.exitcode}"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()
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
        threads: Mt-KaHyPar threads (default ``torch.get_num_threads()``).
        time_limit_s: wall-clock limit of the Mt-KaHyPar call; when it is hit the split
            is ``reg``'s at the same K (see the module docstring). ``None``: no limit
            (runs in this process).
        reg_options: the REG options of that fallback (``partitioner``,
            ``trainer_threads``, ``max_hub_degree``, ``hub_links``: as the ``reg`` method
            takes them; ``deterministic`` is passed on too).

    ``info`` holds ``km1`` (as reported by Mt-KaHyPar; equals
    ``Σ_k |inputs of micro-batch k| - n_in`` before any empty-micro-batch repair),
    ``hyperedges`` and ``pins`` (after dropping size-1 hyperedges), ``preset``,
    ``threads``; after a fallback, ``reg``'s info plus ``fallback_from`` and
    ``fallback_reason``.

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
        reason = (f"the hypergraph split (Mt-KaHyPar {preset}, {threads} threads) did not "
                  f"finish K={k} within partition.time_limit_s={time_limit_s}")
        log.warning("%s; falling back to 'reg' for this split", reason)
        result = reg_partition(batch, k, seed=seed, weights=weights, deterministic=deterministic, **reg_options)
        result.info.update(fallback_from="hypergraph", fallback_reason=reason,
                           hypergraph_time_s=time.perf_counter() - built)
        result.time_build_s += built - start
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
        "threads": threads,
    }
    return PartitionResult(groups, k, "hypergraph", built - start, done - built, info)
