"""Balance helpers shared by the graph partitioners: integer vertex weights and the
deterministic repair of empty micro-batches."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["checked_weights", "integer_vertex_weights", "fill_empty_micro_batches", "DEFAULT_MAX_VERTEX_WEIGHT"]

#: Largest integer vertex weight handed to a partitioner (the heaviest output gets it).
DEFAULT_MAX_VERTEX_WEIGHT = 10_000
# Mt-KaHyPar sums node weights in 32-bit integers (METIS uses pymetis's idx_t, 64-bit
# here, and betty.partition.metis_cut checks its totals); keep the total below 2**30.
_MAX_TOTAL_WEIGHT = 2**30


def checked_weights(weights, num_outputs: int) -> np.ndarray:
    """``weights`` as a float64 ``(n_out,)`` array, after checking that it is one finite,
    non-negative weight per output node.

    Raises:
        ValueError: another shape, or a negative or non-finite entry (named).
    """
    w = torch.as_tensor(weights).detach().cpu().to(torch.float64).numpy()
    if w.shape != (num_outputs,):
        raise ValueError(
            f"weights must have shape ({num_outputs},) (one per output node), "
            f"got {tuple(w.shape)}"
        )
    if not np.isfinite(w).all() or (w < 0).any():
        bad = w[~np.isfinite(w) | (w < 0)][0]
        raise ValueError(f"weights must be finite and non-negative, got an entry {bad}")
    return w


def integer_vertex_weights(
    weights, num_outputs: int, max_weight: int = DEFAULT_MAX_VERTEX_WEIGHT
) -> np.ndarray:
    """Integer vertex weights ``(n_out,)`` int32, all ``>= 1``.

    ``None`` gives all ones (balance the number of outputs). Otherwise
    ``w_int = max(1, round(w / max(w) * s))`` with ``s = min(max_weight, 2**30 // n_out)``
    so that the total fits the partitioners' 32-bit weight sums; an all-zero vector is
    treated as ``None``.

    Raises:
        ValueError: ``weights`` is not ``(n_out,)``, or has a negative or non-finite entry.
    """
    if weights is None:
        return np.ones(num_outputs, dtype=np.int32)
    w = checked_weights(weights, num_outputs)
    top = w.max() if w.size else 0.0
    if top == 0.0:
        return np.ones(num_outputs, dtype=np.int32)
    scale = max(1, min(int(max_weight), _MAX_TOTAL_WEIGHT // max(num_outputs, 1)))
    return np.maximum(1, np.rint(w / top * scale)).astype(np.int32)


def fill_empty_micro_batches(groups, k: int) -> tuple[torch.Tensor, int]:
    """Make every one of the ``k`` micro-batches non-empty, deterministically.

    For each empty micro-batch in increasing order, the currently largest micro-batch (lowest index
    on ties) gives up its output with the highest position. Needs ``k <= n_out``.

    Returns:
        ``(groups (n_out,) int64, number of outputs moved)``.
    """
    g = torch.as_tensor(np.asarray(groups), dtype=torch.int64).clone()
    sizes = torch.bincount(g, minlength=k)
    empty = torch.nonzero(sizes == 0).flatten().tolist()
    for index in empty:  # at most k iterations, each O(n_out) vectorized
        donor = int(torch.argmax(sizes))
        node = int(torch.nonzero(g == donor).flatten()[-1])
        g[node] = index
        sizes[donor] -= 1
        sizes[index] += 1
    return g, len(empty)
