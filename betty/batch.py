"""Framework-neutral containers for a sampled batch and its micro-batches.

A *sampled batch* of an L-layer GNN is a chain of L bipartite blocks. Layer 0 is the
input layer (it reads raw node features), layer L-1 produces the outputs. Every block
follows DGL's convention that the destination nodes are the first ``num_dst`` of its
source nodes, and consecutive blocks chain::

    layers[l].src_nid == layers[l - 1].dst_nid     (for l = 1..L-1)

so the local index space of layer l's sources *is* the local index space of layer
l-1's destinations. Edges are stored in local indices, sorted by (destination local
index, source global ID): that is the *canonical neighbour order* every aggregator sees
(see :mod:`betty.microbatch`), independent of how the batch is later split.

Everything here is plain ``torch.int64`` CPU tensors; a backend's blocks (DGL or PyG,
:mod:`betty.backends`) are built only at the last moment by :meth:`MicroBatch.to_blocks`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LayerEdges", "SampledBatch", "MicroBatch"]


@dataclass
class LayerEdges:
    """One bipartite block in local indices.

    Attributes:
        src_nid: ``(n_src,)`` global IDs of the source nodes; the first ``num_dst`` are
            the destination nodes, in destination order.
        num_dst: number of destination nodes.
        edge_src: ``(E,)`` local source index of each sampled edge, in ``[0, n_src)``.
        edge_dst: ``(E,)`` local destination index of each edge, in ``[0, num_dst)``.
        edge_id: ``(E,)`` global (raw-graph) edge ID of each edge; used to key
            per-edge randomness such as attention dropout.
        src_out_degree: ``(n_src,)`` out-degree *in the whole graph* of each source
            node (``None`` where unknown). The sampler records it; carving keeps each
            node's value, so a node's normalisation in the symmetric GCN
            (:mod:`betty.models.gcn`) is the same in every micro-batch.
    """

    src_nid: torch.Tensor
    num_dst: int
    edge_src: torch.Tensor
    edge_dst: torch.Tensor
    edge_id: torch.Tensor
    src_out_degree: torch.Tensor | None = None

    @property
    def num_src(self) -> int:
        return int(self.src_nid.numel())

    @property
    def num_edges(self) -> int:
        return int(self.edge_src.numel())

    @property
    def dst_nid(self) -> torch.Tensor:
        """``(num_dst,)`` global IDs of the destination nodes."""
        return self.src_nid[: self.num_dst]

    def in_degrees(self) -> torch.Tensor:
        """``(num_dst,)`` number of sampled in-edges of each destination node."""
        return torch.bincount(self.edge_dst, minlength=self.num_dst)

    def to(self, device: torch.device | str) -> "LayerEdges":
        """This block with every tensor on ``device`` (itself when they are there)."""
        device = torch.device(device)
        if self.src_nid.device == device:
            return self
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return LayerEdges(src_nid=move(self.src_nid), num_dst=self.num_dst,
                          edge_src=move(self.edge_src), edge_dst=move(self.edge_dst),
                          edge_id=move(self.edge_id), src_out_degree=move(self.src_out_degree))

    def nbytes(self) -> int:
        """Bytes held by this block's index tensors."""
        return sum(
            t.element_size() * t.numel()
            for t in (self.src_nid, self.edge_src, self.edge_dst, self.edge_id, self.src_out_degree)
            if t is not None
        )


def _check_chain(layers: list[LayerEdges]) -> None:
    for l in range(1, len(layers)):
        if layers[l].num_src != layers[l - 1].num_dst:
            raise ValueError(
                f"layer {l} has {layers[l].num_src} source nodes but layer {l - 1} "
                f"has {layers[l - 1].num_dst} destination nodes; blocks must chain"
            )


class _BlockChain:
    """Accessors shared by full batches and micro-batches (``self.layers``)."""

    layers: list[LayerEdges]

    def __post_init__(self) -> None:
        _check_chain(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def output_nid(self) -> torch.Tensor:
        """``(n_out,)`` global IDs of the output nodes."""
        return self.layers[-1].dst_nid

    @property
    def input_nid(self) -> torch.Tensor:
        """``(n_in,)`` global IDs of the layer-0 input nodes (features to load)."""
        return self.layers[0].src_nid

    @property
    def num_outputs(self) -> int:
        return self.layers[-1].num_dst


@dataclass
class SampledBatch(_BlockChain):
    """The full batch: all output nodes and their sampled L-hop neighbourhood.

    Attributes:
        layers: the L blocks, ``layers[0]`` reads the input features.
        fanouts: per-layer fanouts used to sample it (same order as ``layers``).
    """

    layers: list[LayerEdges]
    fanouts: list[int] = field(default_factory=list)
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _slots: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def to(self, device: torch.device | str) -> "SampledBatch":
        """The batch with its blocks on ``device`` (itself when they are there; a moved
        batch starts with nothing derived)."""
        layers = [layer.to(device) for layer in self.layers]
        if all(a is b for a, b in zip(layers, self.layers)):
            return self
        return SampledBatch(layers=layers, fanouts=list(self.fanouts))

    def derived(self, key: tuple, compute: Callable[[], Any], *, slot: str | None = None) -> Any:
        """``compute()``, computed once per ``key`` for this batch and kept while the
        batch lives, so that what partitioning, the memory estimate and the split
        metrics derive from one batch (layer incidences, the REG, a split's micro-batch
        membership) is built once, not once per caller or per K tried. ``slot``: keep
        only the latest key of that slot (values that depend on a split, or are large).
        A batch's layers never change after sampling; ``key`` must name everything else
        the value depends on."""
        if key not in self._derived:
            if slot is not None:
                self._derived.pop(self._slots.get(slot), None)
                self._slots[slot] = key
            self._derived[key] = compute()
        return self._derived[key]

    def forget(self, names: Iterable[str]) -> None:
        """Drop what :meth:`derived` keeps under keys whose first element is one of
        ``names`` (e.g. the structures a partition was cut from, once it is cut: a REG
        holds about an edge list per output pair); they are built again if asked for."""
        names = set(names)
        for key in [key for key in self._derived if key and key[0] in names]:
            del self._derived[key]
        self._slots = {slot: key for slot, key in self._slots.items() if key in self._derived}


@dataclass
class MicroBatch(_BlockChain):
    """One micro-batch of a split batch, carved from the full batch (no re-sampling).

    Attributes:
        layers: the micro-batch's own L blocks (local indices, same conventions as
            :class:`SampledBatch`). ``layers[l].src_nid`` holds global IDs.
        output_index: ``(n_out_k,)`` positions of this micro-batch's outputs in the full
            batch's ``output_nid`` (so labels and predictions can be scattered back).
        full_src_index: per layer, ``(n_src,)`` positions of this block's source nodes
            among the full batch's layer-l source nodes: the explicit micro-batch-local
            -> full-batch map (``full.layers[l].src_nid[full_src_index[l]] ==
            layers[l].src_nid``).
        input_features: ``(n_src_0, F)`` the features of ``input_nid`` gathered ahead
            into host memory (pinned for a CUDA device) while an earlier step computed,
            or ``None``: the step gathers them itself.
    """

    layers: list[LayerEdges]
    output_index: torch.Tensor
    full_src_index: list[torch.Tensor]
    input_features: torch.Tensor | None = None

    def to_blocks(self, device: torch.device | str = "cpu", backend: str = "auto") -> list:
        """Build ``backend``'s blocks on ``device`` (see :func:`layer_to_block`)."""
        return [layer_to_block(layer, device, backend) for layer in self.layers]


def layer_to_block(layer: LayerEdges, device: torch.device | str = "cpu", backend: str = "auto",
                   *, degrees: bool = False):
    """One :class:`LayerEdges` as a block of ``backend`` (edge order preserved; explicit
    node counts, so destinations without in-edges are kept and the source order is
    exactly ``src_nid``); ``degrees`` carries ``src_out_degree`` along (the GCN's)."""
    from betty.backends import get_backend

    return get_backend(backend).make_block(layer, device, degrees=degrees)
