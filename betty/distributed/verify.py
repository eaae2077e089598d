"""Compare an N-rank step with the single-process full-batch one.

With parameters ``θ0`` before a step, ``θ_ref`` after the single-process full-batch
(K = 1) step and ``θ_N`` after the N-rank K-way step, and ``g_ref``, ``g_N`` the
gradients the two steps took, two differences are reported:

    max over parameters p of ||Δ_N[p] - Δ_ref[p]|| / max(||Δ_ref[p]||, tiny),
    Δ = θ_after - θ0,

the update itself, not the parameters (whose size would hide an error), and the same of
``g_N`` against ``g_ref``: an optimizer whose update hardly depends on the gradient's
size (Adam's first step is about ``lr · sign(g)``) would hide a gradient that is off by
a factor. :func:`verify_ranks` measures both for a trainer at several K on N ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from betty.train import gradients, max_relative_difference

__all__ = ["update_difference", "gradient_difference", "parameters", "first_update", "verify_ranks"]


def update_difference(before: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                      other: Mapping[str, torch.Tensor]) -> float:
    """Largest relative difference between the updates ``other - before`` and
    ``reference - before`` (see the module docstring); the dicts are ``name -> tensor``."""
    ref = {n: reference[n].double() - before[n].double() for n in before}
    got = {n: other[n].double() - before[n].double() for n in before}
    return max_relative_difference(got, ref)


def gradient_difference(other: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> float:
    """:func:`betty.train.max_relative_difference` of the step's gradients, 0 where both
    steps were skipped (a ``16-mixed`` loss scaler found an inf or NaN on each side: the
    gradients hold them, and the updates, both zero, are compared instead); ``inf``
    where only one was."""
    def finite(grads) -> bool:
        return all(bool(torch.isfinite(g).all()) for g in grads.values())

    if not finite(other) and not finite(reference):
        return 0.0
    return max_relative_difference(other, reference)


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``name -> tensor``: a detached CPU copy of ``model``'s parameters."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def first_update(build: Callable[[], tuple], k: int, parallel=None) -> tuple[dict, dict, dict]:
    """Parameters before and after epoch 0 of a fresh trainer with K = ``k``
    micro-batches per batch (on ranks: ``parallel``, a :class:`DataParallel`), and the
    gradients of its last step (the step leaves them; under ``parallel`` all-reduced).
    The plan's memory budget is dropped: K is given, and K = 1, the reference, need
    not fit it (the ranks run on the host).

    ``build() -> (trainer, model)`` makes a :class:`betty.engine.Trainer` and its model
    with the same seeds at every call (so the same batch, partition seed and dropout)."""
    trainer, model = build()
    trainer.plan.k = k
    trainer.plan.memory_budget = None
    trainer.parallel = parallel
    before = parameters(model)
    trainer.train_epoch(0)
    return before, parameters(model), gradients(model)


def _rank_updates(build: Callable[[], tuple], ks: list[int]) -> dict[int, tuple] | None:
    """On each rank: the parameters after epoch 0 and its last step's gradients at every
    K (rank 0 returns them)."""
    import torch.distributed as dist

    from betty.distributed.parallel import DataParallel

    out = {k: first_update(build, k, DataParallel(check_every=1))[1:] for k in ks}
    return out if dist.get_rank() == 0 else None


def verify_ranks(build: Callable[[], tuple], ks: list[int], nproc: int, *, tol: float,
                 threads: int | None = 1) -> dict:
    """The ``nproc``-rank step of epoch 0 at each K in ``ks`` against the single-process
    full-batch (K = 1) step: its update (:func:`update_difference`) and its gradients.

    Args:
        build: makes ``(trainer, model)`` on the CPU, the same at every call; it must
            pickle (a module-level function or a ``functools.partial`` of one): each
            rank calls it.
        tol: the largest relative difference (of the update and of the gradients) that
            passes (:func:`betty.verify.exactness_tolerance`).
        threads: torch threads per rank.

    Returns:
        ``{"world_size", "tolerance", "results": [{"k", "max_rel_update_diff",
        "max_rel_grad_diff", "ok"}], "ok"}``.
    """
    from betty.distributed.launch import launch

    before, reference, ref_grads = first_update(build, 1)
    ranks = launch(_rank_updates, (build, list(ks)), nproc=nproc, threads=threads)[0]
    results = [{"k": k, "max_rel_update_diff": update_difference(before, reference, ranks[k][0]),
                "max_rel_grad_diff": gradient_difference(ranks[k][1], ref_grads)} for k in ks]
    for row in results:
        row["ok"] = row["max_rel_update_diff"] <= tol and row["max_rel_grad_diff"] <= tol
    return {"world_size": nproc, "tolerance": tol, "results": results, "ok": all(r["ok"] for r in results)}
