"""Quality of a split, computed without carving any block.

With ``|I_k^l|`` the number of layer-``l`` sources micro-batch ``k`` holds (its
``n_src[l]`` in :func:`betty.memory.sizes.split_sizes`, the same numbers the memory
estimate reads) and ``n_src[l]`` the full batch's,

    redundancy_per_layer[l] = Σ_k |I_k^l| / n_src[l]   (>= 1; 1 when no source is shared).
"""

from __future__ import annotations

import numpy as np
import torch

from betty.batch import SampledBatch

__all__ = ["split_metrics"]


def split_metrics(batch: SampledBatch, groups, k: int) -> dict:
    """Redundancy and balance of splitting ``batch`` by ``groups``.

    Args:
        batch: the full sampled batch.
        groups: ``(n_out,)`` micro-batch index of each output, in ``[0, k)``, no empty micro-batch.
        k: number of micro-batches.

    Returns:
        A dict with
        ``redundancy_per_layer`` (list of L floats, layer 0 = input layer):
        ``Σ_k |sources of micro-batch k at layer l| / |sources of the full batch at layer l|``;
        ``redundancy``: the layer-0 value;
        ``imbalance``: ``max / mean`` of the micro-batches' layer-0 input counts;
        ``input_nodes_per_micro_batch``: list of K ints;
        ``outputs_per_micro_batch``: list of K ints.
    """
    from betty.memory.sizes import split_sizes  # lazy: betty.memory imports betty.partition

    sizes = split_sizes(batch, groups, k)
    per_layer = [float(n.sum()) / layer.num_src for n, layer in zip(sizes.n_src, batch.layers)]
    inputs = sizes.n_src[0].astype(np.int64)
    outputs = torch.bincount(torch.as_tensor(groups, dtype=torch.int64), minlength=k)
    return {
        "redundancy_per_layer": per_layer,
        "redundancy": per_layer[0],
        "imbalance": float(inputs.max() / inputs.mean()),
        "input_nodes_per_micro_batch": inputs.tolist(),
        "outputs_per_micro_batch": outputs.tolist(),
    }
