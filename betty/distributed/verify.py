"""Compare an N-rank optimizer update with the single-process full-batch one.

With parameters ``θ0`` before a step, ``θ_ref`` after the single-process full-batch
(K = 1) step and ``θ_N`` after the N-rank K-way step, the reported difference is

    max over parameters p of ||Δ_N[p] - Δ_ref[p]|| / max(||Δ_ref[p]||, tiny),
    Δ = θ_after - θ0,

i.e. the update itself is compared, not the parameters (whose size would hide an error).
:func:`verify_ranks` measures it for a trainer at several K on N ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from betty.train import max_relative_difference

__all__ = ["update_difference", "update_tolerance", "parameters", "first_update", "verify_ranks"]


def update_tolerance(dtype: torch.dtype, precision=None) -> float:
    """The exactness bound of ``dtype`` (:func:`betty.verify.default_tol`: 1e-10 float64,
    1e-5 float32), or under a mixed ``precision`` its :data:`betty.verify.MIXED_TOL`."""
    from betty.precision import Precision
    from betty.verify import MIXED_TOL, default_tol

    prec = Precision.parse(precision if precision is not None else "32")
    return MIXED_TOL[prec.name] if prec.mixed else default_tol(dtype)


def update_difference(before: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                      other: Mapping[str, torch.Tensor]) -> float:
    """Largest relative difference between the updates ``other - before`` and
    ``reference - before`` (see the module docstring); the dicts are ``name -> tensor``."""
    ref = {n: reference[n].double() - before[n].double() for n in before}
    got = {n: other[n].double() - before[n].double() for n in before}
    return max_relative_difference(got, ref)


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``name -> tensor``: a detached CPU copy of ``model``'s parameters."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def first_update(build: Callable[[], tuple], k: int, parallel=None) -> tuple[dict, dict]:
    """Parameters before and after epoch 0 of a fresh trainer with K = ``k``
    micro-batches per batch (on ranks: ``parallel``, a :class:`DataParallel`).

    ``build() -> (trainer, model)`` makes a :class:`betty.engine.Trainer` and its model
    with the same seeds at every call (so the same batch, partition seed and dropout)."""
    trainer, model = build()
    trainer.plan.k = k
    trainer.parallel = parallel
    before = parameters(model)
    trainer.train_epoch(0)
    return before, parameters(model)


def _rank_updates(build: Callable[[], tuple], ks: list[int]) -> dict[int, dict] | None:
    """On each rank: the parameters after epoch 0 at every K (rank 0 returns them)."""
    import torch.distributed as dist

    from betty.distributed.parallel import DataParallel

    out = {k: first_update(build, k, DataParallel(check_every=1))[1] for k in ks}
    return out if dist.get_rank() == 0 else None


def verify_ranks(build: Callable[[], tuple], ks: list[int], nproc: int, *, tol: float,
                 threads: int | None = 1) -> dict:
    """The ``nproc``-rank update of epoch 0 at each K in ``ks`` against the
    single-process full-batch (K = 1) update (:func:`update_difference`).

    Args:
        build: makes ``(trainer, model)`` on the CPU, the same at every call; it must
            pickle (a module-level function or a ``functools.partial`` of one): each
            rank calls it.
        tol: the largest relative update difference that passes (:func:`update_tolerance`).
        threads: torch threads per rank.

    Returns:
        ``{"world_size", "tolerance", "results": [{"k", "max_rel_update_diff", "ok"}], "ok"}``.
    """
    from betty.distributed.launch import launch

    before, reference = first_update(build, 1)
    ranks = launch(_rank_updates, (build, list(ks)), nproc=nproc, threads=threads)[0]
    results = [{"k": k, "max_rel_update_diff": update_difference(before, reference, ranks[k])} for k in ks]
    for row in results:
        row["ok"] = row["max_rel_update_diff"] <= tol
    return {"world_size": nproc, "tolerance": tol, "results": results, "ok": all(r["ok"] for r in results)}
