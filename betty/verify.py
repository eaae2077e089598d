"""Self-check: does K-way accumulation reproduce the full-batch gradient here?

Runs one sampled batch through the model at K=1 and at each requested K (same weights,
same dropout key) and reports, per K, the largest relative gradient difference over the
parameters and the loss difference. On a correct installation they are at rounding
level (about 1e-7 in float32, 1e-16 in float64).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from betty.batch import SampledBatch
from betty.models.dropout import dropout_key
from betty.partition import partition_batch
from betty.train import accumulate_gradients, gradients, max_relative_difference

__all__ = ["verify_exactness"]


def verify_exactness(model: torch.nn.Module, batch: SampledBatch, feat: torch.Tensor,
                     label: torch.Tensor, ks: Sequence[int], *, method: str = "random",
                     seed: int = 0, device="cpu", dtype: torch.dtype | None = None,
                     multilabel: bool = False, graph=None) -> dict:
    """Compare K-way against K=1 gradients on one batch.

    Returns:
        ``{"method", "dtype", "num_outputs", "loss_full", "results": [{"k",
        "max_rel_grad_diff", "loss_diff"}, ...]}``; the model's gradients are left
        zeroed.
    """
    bad = [k for k in ks if not 1 <= int(k) <= batch.num_outputs]
    if bad:
        raise ValueError(f"--k values must be between 1 and {batch.num_outputs} "
                         f"(the batch's output nodes), got {bad}")
    was_training = model.training
    model.train()
    key = dropout_key(seed, 0)

    def run(k: int):
        model.zero_grad(set_to_none=True)
        groups = partition_batch(batch, k, method, seed=seed, graph=graph).groups
        res = accumulate_gradients(model, batch, groups, feat, label, k=k, device=device,
                                   dropout_key=key, multilabel=multilabel, dtype=dtype)
        return res.loss, gradients(model)

    loss_1, grad_1 = run(1)
    results = []
    for k in ks:
        loss_k, grad_k = run(int(k))
        results.append({"k": int(k), "max_rel_grad_diff": max_relative_difference(grad_k, grad_1),
                        "loss_diff": abs(loss_k - loss_1)})
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    param_dtype = next(model.parameters()).dtype
    return {"method": method, "dtype": str(dtype or param_dtype).replace("torch.", ""),
            "num_outputs": batch.num_outputs, "loss_full": loss_1, "results": results}
