"""Dropout whose mask is a function of (key, layer, global ID), not of the call.

Why: with ordinary dropout, a node that appears in two micro-batches (or in the full
batch and in one micro-batch) draws two different masks, so K-way training is no longer
the full-batch computation. Here the keep/drop decision for element ``j`` of the row
belonging to global node (or edge) ``i`` at layer ``l`` is

    r_i = mix64(i XOR k_l)            (row word, fully mixed)
    c_j = mix64(j XOR k_l')           (column word, fully mixed)
    u   = ((r_i XOR c_j) * M) >> 40   (top 24 bits of a 64-bit multiplicative hash)
    keep  <=>  u >= round(p * 2^24)

with ``k_l = mix64(key, l)``, ``mix64`` the SplitMix64 finaliser (a bijective
avalanche on 64-bit words) and ``M`` an odd 64-bit constant. The same (key, layer, ID)
gives the same mask in every micro-batch, on every device. Only the ``(n,)`` row words
pay for full mixing; the ``(n, width)`` part is one xor, one multiply and one compare,
done in cache-sized chunks (a 2M x 100 mask took about 1.3 s on this 2-core machine,
against 40 s for full SplitMix64 per element). Measured on 100k x 64 masks: keep rate
within 1e-3 of 1 - p, correlation between neighbouring rows/columns and between keys
below 1e-3. Kept elements are scaled by 1 / (1 - p) as in
``torch.nn.functional.dropout``.

Memory: the mask is never stored. The forward pass computes it in row chunks (bounded
temporaries) and the backward pass recomputes it from the IDs, so the only saved tensor
is the ``(n,)`` ID vector that is alive anyway.
"""

from __future__ import annotations

import torch

from betty.catalog import MAX_DROPOUT
from betty.checks import check_dropout

__all__ = ["hash_keep_mask", "hash_dropout", "dropout_key", "mix64", "MAX_DROPOUT", "check_dropout"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
CHUNK_ELEMENTS = 1 << 15  # int64 scratch per chunk: 256 KiB, stays in cache
_SIGN = -(1 << 63)


def _signed(c: int) -> int:
    """A 64-bit constant as the signed int64 torch stores."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


def _py_mix64(z: int) -> int:
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def dropout_key(*parts: int) -> int:
    """Combine integers (seed, epoch, ...) into one 64-bit dropout key."""
    z = 0
    for p in parts:
        z = _py_mix64(z ^ (int(p) & _MASK64))
    return _signed(z)


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on an int64 tensor (wrapping arithmetic), out of place."""
    z = z + _signed(_GOLDEN)
    z = (z ^ _lsr(z, 30)) * _signed(_M1)
    z = (z ^ _lsr(z, 27)) * _signed(_M2)
    return z ^ _lsr(z, 31)


def _row_col_words(ids: torch.Tensor, width: int, key: int, layer: int):
    layer_key = dropout_key(key, layer)
    rows = mix64(ids.to(torch.int64) ^ layer_key)  # (n,)
    cols = mix64(
        torch.arange(width, device=ids.device, dtype=torch.int64) ^ dropout_key(layer_key, 1)
    )  # (width,)
    return rows, cols


def _threshold(p: float) -> int:
    """``round(p * 2^24) << 40`` shifted into signed order (unsigned compare trick)."""
    return (int(round(p * (1 << 24))) << 40) + _SIGN


def _keep_chunk(rows: torch.Tensor, cols: torch.Tensor, thr: int, scratch: torch.Tensor,
                out: torch.Tensor) -> None:
    """Write the keep-mask of ``rows`` ``(m,)`` x ``cols`` ``(w,)`` into ``out`` (m, w)."""
    z = scratch[: rows.shape[0]]
    torch.bitwise_xor(rows[:, None], cols[None, :], out=z)
    z.mul_(_signed(_M1))
    z.bitwise_xor_(_SIGN)  # unsigned order -> signed order
    torch.ge(z, thr, out=out)


def _chunks(n: int, width: int):
    rows = max(1, min(n, CHUNK_ELEMENTS // max(width, 1)))
    for start in range(0, n, rows):
        yield start, min(n, start + rows)


def hash_keep_mask(
    ids: torch.Tensor, width: int, p: float, key: int, layer: int
) -> torch.Tensor:
    """Boolean keep-mask ``(n, width)`` for rows with global IDs ``ids`` ``(n,)``."""
    rows, cols = _row_col_words(ids, width, key, layer)
    thr = _threshold(p)
    out = torch.empty(ids.shape[0], width, dtype=torch.bool, device=ids.device)
    scratch = torch.empty(min(ids.shape[0], max(1, CHUNK_ELEMENTS // max(width, 1))), width,
                          dtype=torch.int64, device=ids.device)
    for start, stop in _chunks(ids.shape[0], width):
        _keep_chunk(rows[start:stop], cols, thr, scratch, out[start:stop])
    return out


class _HashDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ids, p, key, layer):  # noqa: D401 - autograd signature
        ctx.save_for_backward(ids)
        ctx.p, ctx.key, ctx.layer = p, key, layer
        return _apply_mask(x, ids, p, key, layer)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        grad_in = _apply_mask(grad_out, ids, ctx.p, ctx.key, ctx.layer)
        return grad_in, None, None, None, None


def _apply_mask(x: torch.Tensor, ids: torch.Tensor, p: float, key: int, layer: int) -> torch.Tensor:
    """``x * keep / (1 - p)`` computed in row chunks; ``x`` is ``(n, *)``."""
    n = x.shape[0]
    flat = x.reshape(n, -1)
    width = flat.shape[1]
    rows, cols = _row_col_words(ids, width, key, layer)
    thr = _threshold(p)
    out = torch.empty_like(flat)
    rows_per_chunk = min(n, max(1, CHUNK_ELEMENTS // max(width, 1)))
    scratch = torch.empty(rows_per_chunk, width, dtype=torch.int64, device=x.device)
    keep = torch.empty(rows_per_chunk, width, dtype=torch.bool, device=x.device)
    scale = 1.0 / (1.0 - p)
    for start, stop in _chunks(n, width):
        k = keep[: stop - start]
        _keep_chunk(rows[start:stop], cols, thr, scratch, k)
        torch.mul(flat[start:stop], k, out=out[start:stop])
    out.mul_(scale)
    return out.view_as(x)


def hash_dropout(
    x: torch.Tensor, ids: torch.Tensor, p: float, key: int, layer: int, training: bool = True
) -> torch.Tensor:
    """Dropout on ``x`` ``(n, *)`` with a mask keyed by ``ids`` ``(n,)``.

    Args:
        x: rows to drop elements from; row ``r`` belongs to global ID ``ids[r]``.
        ids: ``(n,)`` int64 global node (or edge) IDs, on ``x``'s device.
        p: drop probability in ``[0, MAX_DROPOUT]`` (``1 - 2^-24``).
        key: the step's key (see :func:`dropout_key`), e.g. ``dropout_key(seed, epoch)``.
        layer: layer index; different layers draw independent masks.
        training: identity when False.
    """
    if not training or p == 0.0:
        return x
    check_dropout(p, "p")
    if ids.shape[0] != x.shape[0]:
        raise ValueError(f"need one ID per row: x has {x.shape[0]} rows, ids {ids.shape[0]}")
    if x.shape[0] == 0:
        return x.clone()
    return _HashDropout.apply(x, ids, float(p), int(key), int(layer))
