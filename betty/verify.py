"""Self-check: does K-way accumulation reproduce the full-batch gradient here?

Runs one sampled batch through the independent full-batch reference
(:func:`betty.reference.full_batch_reference`: the sampler's own blocks, no partitioning
or carving code) and through K-way accumulation for K = 1 and each requested K (same
weights, same dropout key). Per K it reports the largest relative gradient difference
over the parameters, ``max_p ||g_K,p - g_ref,p|| / ||g_ref,p||``, and the relative loss
difference ``|L_K - L_ref| / |L_ref|``, and a verdict: PASS when both are at most
``tol`` (default :data:`DEFAULT_TOL`: 1e-10 in float64, 1e-5 in float32). On a correct
installation both are at rounding level (about 1e-7 in float32, 1e-16 in float64).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from betty.batch import SampledBatch
from betty.models.dropout import dropout_key
from betty.partition import partition_batch
from betty.reference import full_batch_reference
from betty.train import accumulate_gradients, gradients, max_relative_difference

__all__ = ["verify_exactness", "DEFAULT_TOL", "default_tol"]

DEFAULT_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
"""Relative tolerance of the verdict per compute dtype."""


def default_tol(dtype: torch.dtype) -> float:
    """The verdict's default tolerance for ``dtype`` (float32 or float64)."""
    if dtype not in DEFAULT_TOL:
        allowed = ", ".join(str(d).replace("torch.", "") for d in DEFAULT_TOL)
        raise ValueError(f"no default exactness tolerance for {dtype}; allowed dtypes: {allowed} "
                         "(or pass tol explicitly)")
    return DEFAULT_TOL[dtype]


def verify_exactness(model: torch.nn.Module, batch: SampledBatch, feat: torch.Tensor,
                     label: torch.Tensor, ks: Sequence[int], *, method: str = "random",
                     seed: int = 0, device="cpu", dtype: torch.dtype | None = None,
                     multilabel: bool = False, graph=None, tol: float | None = None) -> dict:
    """Compare K-way accumulated gradients (K=1 and each of ``ks``) with the reference.

    Args:
        tol: relative tolerance of the verdict (> 0); default by compute dtype.

    Returns:
        ``{"method", "dtype", "num_outputs", "loss_full", "tol", "passed", "verdict",
        "results": [{"k", "max_rel_grad_diff", "loss_rel_diff", "loss_diff", "passed",
        "verdict"}, ...]}`` with ``results[0]`` the K=1 row; the model's gradients are
        left zeroed.
    """
    bad = [k for k in ks if not 1 <= int(k) <= batch.num_outputs]
    if bad:
        raise ValueError(f"--k values must be between 1 and {batch.num_outputs} "
                         f"(the batch's output nodes), got {bad}")
    compute_dtype = dtype or next(model.parameters()).dtype
    tol = default_tol(compute_dtype) if tol is None else float(tol)
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    was_training = model.training
    model.train()
    key = dropout_key(seed, 0)
    ref = full_batch_reference(model, batch, feat, label, dropout_key=key, device=device,
                               dtype=dtype, multilabel=multilabel)

    def run(k: int):
        model.zero_grad(set_to_none=True)
        groups = partition_batch(batch, k, method, seed=seed, graph=graph).groups
        res = accumulate_gradients(model, batch, groups, feat, label, k=k, device=device,
                                   dropout_key=key, multilabel=multilabel, dtype=dtype)
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
            "num_outputs": batch.num_outputs, "loss_full": ref.loss, "tol": tol,
            "passed": passed, "verdict": "PASS" if passed else "FAIL", "results": results}
