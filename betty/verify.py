"""Self-check: does K-way accumulation reproduce the full-batch gradient here?

Runs one sampled batch through the independent full-batch reference
(:func:`betty.reference.full_batch_reference`: the sampler's own blocks, no partitioning
or carving code) and through K-way accumulation for K = 1 and each requested K (same
weights, same dropout key). Per K it reports the largest relative gradient difference
over the parameters, ``max_p ||g_K,p - g_ref,p|| / ||g_ref,p||``, and the relative loss
difference ``|L_K - L_ref| / |L_ref|``, and a verdict: PASS when both are at most
the tolerance. On a correct installation both are at rounding level.

The tolerance (:func:`exactness_tolerance`):

* given (``tol``): used as is;
* float64: :data:`DEFAULT_TOL` (1e-10);
* float32: scaled to what float32 rounding gives on this model and batch. The
  full-batch reference is run twice with dropout off, in float32 and in a float64
  copy of the model (same weights, same features); their largest relative gradient
  (or loss) difference ``r`` is the rounding scale of the data at hand (sums over
  high-degree nodes and gradients that nearly cancel make it far larger than float32's
  epsilon: about 2e-5 for GAT on Cora and CiteSeer). K-way accumulation and the
  reference are two float32 computations, each off the exact gradient by about ``r``,
  so their difference is at most about ``2 r``; the tolerance is
  ``ROUNDING_FACTOR * r`` (= 4 r: the factor 2 of that triangle inequality times 2
  for the piecewise sums and the dropout the measurement leaves out), never below
  :data:`DEFAULT_TOL`'s 1e-5 and never above :data:`MAX_SCALED_TOL` (1e-3), so that
  no data can make the check blind to an error of 0.1%. A real mismatch (per-call
  dropout: about 0.7) stays far above it. The measure costs two more full-batch passes
  (one in float64, on a float64 copy of the model: twice its parameter memory).
* a mixed precision (``bf16-mixed``, ``16-mixed``): :data:`MIXED_TOL`, fixed per
  precision just above the worst K-way difference measured by
  ``benchmarks/precision.py`` and on the default spec (docs/precision.md). Autocast
  rounds every matrix product's output to 8 (bfloat16) or 11 (float16) significant
  bits, and a micro-batch's product of the same rows can round differently from the
  full batch's (a different blocking of the sum), so K-way and full-batch differ by
  that rounding, far below a real mismatch (per-call dropout: about 0.5).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from betty.batch import SampledBatch
from betty.models.dropout import dropout_key
from betty.partition import partition_batch
from betty.precision import Precision, parameter_dtype
from betty.reference import full_batch_reference
from betty.train import accumulate_gradients, gradients, max_relative_difference

__all__ = ["verify_exactness", "DEFAULT_TOL", "MIXED_TOL", "default_tol", "ROUNDING_FACTOR", "MAX_SCALED_TOL",
           "rounding_scale", "exactness_tolerance", "measured_tolerance"]

DEFAULT_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}

MIXED_TOL = {"bf16-mixed": 3e-2, "16-mixed": 4e-3}
"""The verdict's tolerance under each mixed precision (see the module docstring)."""
"""Relative tolerance of the verdict per compute dtype (float32: the floor of the scaled one)."""

ROUNDING_FACTOR = 4.0
"""float32 tolerance = this factor x the measured float32-vs-float64 rounding scale."""

MAX_SCALED_TOL = 1e-3
"""The scaled float32 tolerance never exceeds this."""


def default_tol(dtype: torch.dtype) -> float:
    """The verdict's default tolerance for ``dtype`` (float32 or float64)."""
    if dtype not in DEFAULT_TOL:
        allowed = ", ".join(str(d).replace("torch.", "") for d in DEFAULT_TOL)
        raise ValueError(f"no default exactness tolerance for {dtype}; allowed dtypes: {allowed} "
                         "(or pass tol explicitly)")
    return DEFAULT_TOL[dtype]


def rounding_scale(model: torch.nn.Module, batch: SampledBatch, feat: torch.Tensor,
                   label: torch.Tensor, *, device="cpu", multilabel: bool = False) -> float:
    """The float32 rounding scale of ``model`` (float32 weights) on ``batch``: the
    largest relative gradient or loss difference between the full-batch reference in
    float32 and in a float64 copy of the model, both with dropout off (eval mode, so
    the measure does not depend on how dropout draws its masks). Leaves ``model``'s
    mode as it was and its gradients zeroed."""
    was_training = model.training
    wide = copy.deepcopy(model).to(torch.float64).eval()
    model.eval()
    try:
        low = full_batch_reference(model, batch, feat, label, device=device, dtype=torch.float32,
                                   multilabel=multilabel)
        high = full_batch_reference(wide, batch, feat, label, device=device, dtype=torch.float64,
                                    multilabel=multilabel)
    finally:
        model.train(was_training)
    grad_err = max_relative_difference({k: v.double() for k, v in low.grads.items()}, high.grads)
    loss_err = abs(low.loss - high.loss) / max(abs(high.loss), torch.finfo(torch.float64).tiny)
    return max(grad_err, loss_err)


def exactness_tolerance(dtype: torch.dtype, scale: float | None = None,
                        precision: Precision | str | None = None) -> tuple[float, str]:
    """``(tolerance, why)`` of the verdict for compute ``dtype``: a mixed ``precision``
    its fixed :data:`MIXED_TOL`; float64 (or no ``scale``) the fixed
    :data:`DEFAULT_TOL`; float32 with a measured :func:`rounding_scale`
    ``min(MAX_SCALED_TOL, max(DEFAULT_TOL, ROUNDING_FACTOR * scale))``."""
    prec = Precision.parse(precision if precision is not None else "32")
    if prec.mixed:
        tol = MIXED_TOL[prec.name]
        return tol, f"fixed {prec.name} tolerance {tol:.0e} (autocast rounding, docs/precision.md)"
    floor = default_tol(dtype)
    name = str(dtype).replace("torch.", "")
    if dtype != torch.float32 or scale is None:
        return floor, f"fixed {name} tolerance {floor:.0e}"
    tol = min(MAX_SCALED_TOL, max(floor, ROUNDING_FACTOR * scale))
    why = (f"{ROUNDING_FACTOR:g} x measured float32 rounding {scale:.2e} (float32 vs float64 "
           "full-batch gradient on this batch, dropout off)")
    if tol == floor:
        why += f", raised to the floor {floor:.0e}"
    elif tol == MAX_SCALED_TOL:
        why += f", capped at {MAX_SCALED_TOL:.0e}"
    return tol, why


def measured_tolerance(model: torch.nn.Module, batch: SampledBatch, feat: torch.Tensor,
                       label: torch.Tensor, dtype: torch.dtype, precision: Precision | str | None = None, *,
                       device="cpu", multilabel: bool = False) -> tuple[float, str, float | None]:
    """``(tolerance, why, rounding scale or None)``: :func:`exactness_tolerance` of
    ``model`` on ``batch``, in float32 (not mixed) scaled to its measured
    :func:`rounding_scale`."""
    prec = Precision.parse(precision if precision is not None else "32")
    scale = None
    if dtype == torch.float32 and not prec.mixed:
        scale = rounding_scale(model, batch, feat, label, device=device, multilabel=multilabel)
    tol, why = exactness_tolerance(dtype, scale, prec)
    return tol, why, scale


def verify_exactness(model: torch.nn.Module, batch: SampledBatch, feat: torch.Tensor,
                     label: torch.Tensor, ks: Sequence[int], *, method: str = "random",
                     seed: int = 0, device="cpu", dtype: torch.dtype | None = None,
                     multilabel: bool = False, graph=None, tol: float | None = None,
                     precision: Precision | str | None = None) -> dict:
    """Compare K-way accumulated gradients (K=1 and each of ``ks``) with the reference.

    Args:
        precision: ``train.precision`` (default ``32``): under a mixed one the reference
            and every K-way pass run their forward and loss under autocast.
        tol: relative tolerance of the verdict (> 0); default: :func:`exactness_tolerance`
            (float32: scaled to the measured rounding of this model and batch).

    Returns:
        ``{"method", "dtype", "num_outputs", "loss_full", "tol", "tol_basis" (why that
        tolerance), "rounding_scale" (the float32 default's measure, else ``None``),
        "passed", "verdict",
        "results": [{"k", "max_rel_grad_diff", "loss_rel_diff", "loss_diff", "passed",
        "verdict"}, ...]}`` with ``results[0]`` the K=1 row; the model's gradients are
        left zeroed.
    """
    bad = [k for k in ks if not 1 <= int(k) <= batch.num_outputs]
    if bad:
        raise ValueError(f"--k values must be between 1 and {batch.num_outputs} "
                         f"(the batch's output nodes), got {bad}")
    compute_dtype = dtype or parameter_dtype(model)
    prec = Precision.parse(precision if precision is not None else "32")
    why = prec.unsupported(getattr(model, "backend_name", ""), torch.device(device).type)
    if why is not None:  # refused as the trainer refuses it, not by a kernel halfway
        raise ValueError(why)
    scale = None
    if tol is None:
        tol, basis, scale = measured_tolerance(model, batch, feat, label, compute_dtype, prec, device=device,
                                               multilabel=multilabel)
    else:
        tol, basis = float(tol), "given"
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    was_training = model.training
    model.train()
    key = dropout_key(seed, 0)
    ref = full_batch_reference(model, batch, feat, label, dropout_key=key, device=device,
                               dtype=dtype, multilabel=multilabel, precision=prec)

    def run(k: int):
        model.zero_grad(set_to_none=True)
        groups = partition_batch(batch, k, method, seed=seed, graph=graph).groups
        res = accumulate_gradients(model, batch, groups, feat, label, k=k, device=device,
                                   dropout_key=key, multilabel=multilabel, dtype=dtype,
                                   precision=prec)
        return res.loss, gradients(model)

    results = []
    for k in [1] + [int(k) for k in ks if int(k) != 1]:
        loss_k, grad_k = run(k)
        grad_err = max_relative_difference(grad_k, ref.grads)
        loss_abs = abs(loss_k - ref.loss)
        loss_rel = loss_abs / max(abs(ref.loss), torch.finfo(compute_dtype).tiny)
        passed = grad_err <= tol and loss_rel <= tol
        results.append({"k": k, "max_rel_grad_diff": grad_err, "loss_rel_diff": loss_rel,
                        "loss_diff": loss_abs, "passed": passed,
                        "verdict": "PASS" if passed else "FAIL"})
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    passed = all(r["passed"] for r in results)
    return {"method": method, "dtype": str(compute_dtype).replace("torch.", ""),
            "precision": prec.name,
            "num_outputs": batch.num_outputs, "loss_full": ref.loss, "tol": tol,
            "tol_basis": basis, "rounding_scale": scale,
            "passed": passed, "verdict": "PASS" if passed else "FAIL", "results": results}
