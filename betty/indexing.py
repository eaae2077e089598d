"""Index arrays on the CPU: the gathers, scatters and sorts of preparation, on NumPy.

On one thread NumPy's kernels for these are faster than torch's on the CPU: ``np.take``
of millions of random positions about 2x ``tensor[index]``; its stable sort, a timsort,
finds the ascending runs the sampler's ID lists are made of. Off the CPU each function
is the torch op on the tensor's device. Results equal the torch ops' bit for bit.

Why runs: a sampled layer lists its sources as its destinations followed by the other
sources in ascending global ID (:func:`betty.sampling.sample_full_batch`), recursively,
so layer ``l``'s ``src_nid`` is ``L - l + 1`` ascending runs (a micro-batch's input IDs
too); timsort merges them in O(n log r) for ``r`` runs where ``torch.argsort`` sorts
from scratch: on 2.45M IDs in three runs, 0.04 s against 0.45 s (one thread).

``torch_ops=True`` runs the torch op on the CPU as well: the path a device takes,
checked on the CPU against the NumPy one (:class:`betty.microbatch.Carver`).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["argsort_runs", "take", "put", "take_rows", "put_rows"]


def _on_torch(t: torch.Tensor, torch_ops: bool) -> bool:
    return torch_ops or t.device.type != "cpu"


def argsort_runs(values: torch.Tensor, *, torch_ops: bool = False) -> torch.Tensor:
    """``(n,)`` int64 positions that sort the 1-D tensor ``values`` ascending, ties in
    their original order (the same as ``torch.argsort(values, stable=True)``), on
    ``values``' device (off the CPU: ``torch.argsort`` there)."""
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D, got shape {tuple(values.shape)}")
    if _on_torch(values, torch_ops):
        return torch.argsort(values, stable=True)
    order = np.argsort(values.numpy(), kind="stable")
    return torch.from_numpy(order.astype(np.int64, copy=False))


def take(table: torch.Tensor, index: torch.Tensor, *, torch_ops: bool = False) -> torch.Tensor:
    """``table[index]`` for a 1-D ``table`` and an integer ``index`` on its device."""
    if _on_torch(table, torch_ops):
        return table[index]
    return torch.from_numpy(np.take(table.numpy(), index.numpy()))


def put(table: torch.Tensor, index: torch.Tensor, value, *, torch_ops: bool = False) -> None:
    """``table[index] = value`` in place, for a 1-D ``table``; ``value`` a scalar or a
    tensor of ``index``'s shape."""
    if _on_torch(table, torch_ops):
        table[index] = value
        return
    table.numpy()[index.numpy()] = value.numpy() if isinstance(value, torch.Tensor) else value


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of CPU tensor ``t``; bfloat16 (which NumPy lacks) as its int16 bits."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def take_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for an ``(N, ...)`` ``table``: whole rows, any dtype (bfloat16
    rows are moved as their bits); about 2x ``table[index]`` on the CPU (one thread)."""
    if table.device.type != "cpu":
        return table[index]
    rows = torch.from_numpy(np.take(_as_numpy(table), index.numpy(), axis=0))
    return rows.view(torch.bfloat16) if table.dtype == torch.bfloat16 else rows


def put_rows(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``out[index] = rows`` in place for ``(N, ...)`` ``out`` and ``(len(index), ...)``
    ``rows`` of its dtype."""
    if out.device.type != "cpu":
        out[index] = rows
        return
    _as_numpy(out)[index.numpy()] = _as_numpy(rows)
