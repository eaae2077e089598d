"""Gradient all-reduce and parameter checks over a ``torch.distributed`` process group.

Gradient sum: with ranks r = 1..R each holding ``g_r = Σ_{k in P_r} ∇L_k`` (its micro-batches'
gradients, already scaled by the global ``1/|outputs|``), the all-reduce gives every
rank ``Σ_r g_r = Σ_k ∇L_k = ∇L``, the full-batch gradient.

A parameter no micro-batch touched keeps ``grad = None`` in a single process, and optimizers
skip such parameters (Adam's step counter and moments stay put). To reproduce that,
each parameter carries a presence flag (1 if this rank produced a gradient) summed with
the gradients; a parameter whose flag sums to 0 gets ``grad = None`` again.

Bucketing: gradients (plus flags) are flattened into buckets of at most ``bucket_bytes``
(a parameter larger than that gets its own bucket), one ``all_reduce(SUM)`` per bucket,
in parameter order on every rank.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ReduceStats", "ParameterDivergence", "allreduce_gradients", "parameter_checksum",
           "check_parameters_in_sync", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass
class ReduceStats:
    """One gradient all-reduce: ``bytes`` sent into the collective per rank (payload
    of every bucket), ``buckets``, ``wait_s`` wall time inside ``all_reduce``."""

    bytes: int
    buckets: int
    wait_s: float


class ParameterDivergence(RuntimeError):
    """Ranks hold different parameters after a step."""


def _buckets(params: Sequence[torch.nn.Parameter], bucket_bytes: int) -> list[list[int]]:
    out: list[list[int]] = []
    size = 0
    for i, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if out and size + nbytes <= bucket_bytes:
            out[-1].append(i)
            size += nbytes
        else:
            out.append([i])
            size = nbytes
    return out


def allreduce_gradients(params: Iterable[torch.nn.Parameter], group=None,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ReduceStats:
    """Sum every parameter's ``.grad`` over the ranks of ``group`` in place.

    Every parameter of one bucket must share dtype and device (true for a model cast
    with ``.to(dtype)``); ``None`` gradients count as zeros and stay ``None`` when no
    rank produced one.
    """
    params = [p for p in params if p.requires_grad]
    total_bytes, wait, count = 0, 0.0, 0
    for bucket in _buckets(params, bucket_bytes):
        ps = [params[i] for i in bucket]
        ref = ps[0]
        flat = torch.zeros(sum(p.numel() for p in ps) + len(ps), dtype=ref.dtype, device=ref.device)
        offset = 0
        for j, p in enumerate(ps):
            if p.grad is not None:
                flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
                flat[-len(ps) + j] = 1.0
            offset += p.numel()
        start = time.perf_counter()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        wait += time.perf_counter() - start
        total_bytes += flat.numel() * flat.element_size()
        count += 1
        offset = 0
        for j, p in enumerate(ps):
            n = p.numel()
            if float(flat[-len(ps) + j]) == 0.0:
                p.grad = None
            elif p.grad is None:
                p.grad = flat[offset:offset + n].view_as(p).clone()
            else:
                p.grad.copy_(flat[offset:offset + n].view_as(p))
            offset += n
    return ReduceStats(bytes=total_bytes, buckets=count, wait_s=wait)


def parameter_checksum(params: Iterable[torch.Tensor]) -> int:
    """CRC32 of the raw bytes of every tensor, in order (bit-exact: any difference
    in any parameter changes it with probability 1 - 2^-32)."""
    crc = 0
    for p in params:
        data = p.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        crc = zlib.crc32(data, crc)
    return crc


def check_parameters_in_sync(params: Iterable[torch.Tensor], step: int, group=None) -> int:
    """All-gather every rank's :func:`parameter_checksum`; raise on any mismatch.

    Raises:
        ParameterDivergence: naming the ranks whose checksum differs from rank 0's.
    """
    mine = parameter_checksum(params)
    world = dist.get_world_size(group)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([mine], dtype=torch.int64), group=group)
    sums = [int(t) for t in gathered]
    bad = [r for r, s in enumerate(sums) if s != sums[0]]
    if bad:
        raise ParameterDivergence(
            f"parameters diverged after step {step}: rank(s) {bad} differ from rank 0 "
            f"(checksums {dict(enumerate(sums))}); this rank is {dist.get_rank(group)}")
    return mine
