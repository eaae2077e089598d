"""A trainer's view of a DistDGL-partitioned dataset, in the dataset's own IDs.

:func:`connect` joins the graph servers (DistDGL's ``initialize`` and ``DistGraph``)
and returns a :class:`DistributedDataset`, which a :class:`betty.engine.Trainer` takes in
place of a loaded dataset: same attributes, but the graph, the features and the labels
stay with the servers, one partition each, and only what a batch needs is fetched.

Everything is in the **original** node and edge IDs (those of the dataset before
partitioning), so a trainer samples the very batch one process with the whole graph
samples from the same seed: betty's sampler (:func:`betty.sampling.sample_full_batch`)
reads the graph through :class:`DistNeighbours`, which fetches each frontier node's
whole in-neighbourhood from the servers (``dgl.distributed.sample_neighbors`` with
fanout -1: no randomness on the servers), maps it back to original IDs, lays each node's
in-edges out in the canonical order (ascending source ID, then edge ID: the order of
:attr:`betty.graph.Graph.in_csr`) and lets the sampler's own seeded draws pick from
them (:func:`betty.sampling.sample_rows`). Features and labels are read by original ID
through :class:`DistRows`. Partitioning, the K search, carving, accumulation and the
all-reduce are betty's, unchanged, so the update equals the single-process update.

What a trainer holds: the two node maps (memory-mapped, 8 bytes per node each) and the
split; per batch, the fetched in-neighbourhoods of one layer's frontier at a time.

DistDGL's client sends a request and then takes the next response off one queue, so
two threads of a process must not ask at once (a pipelined Trainer samples on its
preparation thread while the step reads features): every request here holds
:data:`REQUESTS`, one lock per process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

import numpy as np
import torch

from betty.backends.distdgl.partition import GRAPH_NAME, PartitionLayout
from betty.sampling import sample_rows

__all__ = ["connect", "DistributedDataset", "DistNeighbours", "DistRows", "REQUESTS"]

#: held by every request to the servers (see the module docstring)
REQUESTS = threading.Lock()


def _new_ids(new_of_orig: np.ndarray, nodes: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.take(new_of_orig, nodes.numpy()))


class DistRows:
    """Rows of a DistDGL node tensor by original node ID: ``rows[ids]`` is ``(n, ...)``,
    ``ids`` an int64 CPU tensor. Shape, dtype and device (the CPU) are the whole
    tensor's, as for a loaded dataset's ``feat`` / ``label``."""

    def __init__(self, tensor, new_of_orig: np.ndarray) -> None:
        self._tensor, self._new_of_orig = tensor, new_of_orig
        self.shape = torch.Size(tensor.shape)
        self.dtype = tensor.dtype
        self.device = torch.device("cpu")

    def dim(self) -> int:
        return len(self.shape)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        new = _new_ids(self._new_of_orig, torch.as_tensor(ids, dtype=torch.int64))
        with REQUESTS:
            return self._tensor[new]


class DistNeighbours:
    """The :class:`betty.sampling.NeighbourSource` of a ``DistGraph`` (see the module
    docstring)."""

    def __init__(self, graph, new_of_orig: np.ndarray, orig_of_new: np.ndarray, num_edges: int) -> None:
        self._graph, self._new_of_orig, self._orig_of_new = graph, new_of_orig, orig_of_new
        self._eid = graph.edata["betty_eid"]
        self._num_edges = int(num_edges)

    def num_nodes(self) -> int:
        return int(self._orig_of_new.shape[0])

    def num_edges(self) -> int:
        return self._num_edges

    def in_rows(self, nodes: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(start, degree, src, eid)``: the in-edges of ``nodes`` (original IDs,
        distinct) as a CSR of their own, row ``r`` at ``start[r]:start[r] + degree[r]``,
        in canonical order, sources and edge IDs original."""
        import dgl

        new = np.take(self._new_of_orig, nodes.numpy())
        with REQUESTS:
            frontier = dgl.distributed.sample_neighbors(self._graph, torch.from_numpy(new), -1)
            eid = self._eid[frontier.edata[dgl.EID]].numpy()
        u, v = (t.numpy() for t in frontier.edges())
        order = np.argsort(new, kind="stable")
        row = order[np.searchsorted(new, v, sorter=order)]
        src = np.take(self._orig_of_new, u)
        canonical = np.lexsort((eid, src, row))
        degree = np.bincount(row, minlength=new.size).astype(np.int64)
        return np.cumsum(degree) - degree, degree, src[canonical], eid[canonical]

    def sample_in_edges(self, nodes: torch.Tensor, fanout: int, generator: torch.Generator):
        start, degree, src, eid = self.in_rows(nodes)
        row, pos = sample_rows(start, degree, fanout, generator)
        return (torch.from_numpy(row), torch.from_numpy(src[pos].astype(np.int64, copy=False)),
                torch.from_numpy(eid[pos].astype(np.int64, copy=False)))

    def out_degrees_of(self, nodes: torch.Tensor) -> torch.Tensor:
        if nodes.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        new = _new_ids(self._new_of_orig, nodes)
        with REQUESTS:
            return self._graph.out_degrees(new).to(torch.int64)


class DistributedDataset:
    """A partitioned dataset as a trainer reads it (:func:`connect`): the attributes of
    :class:`betty.data.GraphDataset` a :class:`~betty.engine.Trainer` uses, ``graph`` a
    :class:`DistNeighbours`, ``feat`` and ``label`` :class:`DistRows`. :meth:`close`
    leaves the servers (every trainer must, once done: the last to leave shuts them
    down)."""

    def __init__(self, layout: PartitionLayout, graph) -> None:
        new_of_orig, orig_of_new = layout.node_maps()
        self.layout = layout
        self.name = layout.dataset
        self.graph = DistNeighbours(graph, new_of_orig, orig_of_new, layout.num_edges)
        self.feat = DistRows(graph.ndata["feat"], new_of_orig)
        self.label = DistRows(graph.ndata["label"], new_of_orig)
        self.train_idx, self.valid_idx, self.test_idx = (layout.split(s) for s in
                                                        ("train_idx", "valid_idx", "test_idx"))
        self.num_classes, self.multilabel = layout.num_classes, layout.multilabel
        self.is_ogb, self.ogb_name = layout.is_ogb, layout.ogb_name
        self._open = True

    @property
    def num_nodes(self) -> int:
        return self.layout.num_nodes

    @property
    def num_edges(self) -> int:
        return self.layout.num_edges

    @property
    def num_features(self) -> int:
        return self.layout.num_features

    def close(self) -> None:
        """Leave the servers (DistDGL's ``exit_client``: waits for every trainer, then
        the first asks the servers to shut down). Idempotent."""
        if self._open:
            import dgl

            self._open = False
            with REQUESTS, contextlib.redirect_stdout(sys.stderr):  # DGL's notes: not the caller's output
                dgl.distributed.exit_client()


def connect(layout: PartitionLayout) -> DistributedDataset:
    """Join the graph servers of ``layout`` from a trainer process started by
    :func:`betty.backends.distdgl.cluster.launch` (which sets the environment DGL reads).

    A trainer that fails does not leave the servers (DistDGL's exit waits for every
    trainer, so it would wait for ever); the launcher stops them.

    Raises:
        RuntimeError: the process was not started as a DistDGL trainer.
    """
    if os.environ.get("DGL_ROLE") != "client" or "DGL_IP_CONFIG" not in os.environ:
        raise RuntimeError("not a DistDGL trainer: start the ranks with "
                           "betty.backends.distdgl.cluster.launch, which sets DGL's environment")
    import dgl
    from dgl.distributed import DistGraph, load_partition_book, rpc

    from betty.backends.distdgl import shm

    shm.install()
    with contextlib.redirect_stdout(sys.stderr):  # DGL's notes: not the caller's output
        dgl.distributed.initialize(os.environ["DGL_IP_CONFIG"])
    atexit.unregister(dgl.distributed.exit_client)  # left explicitly, by DistributedDataset.close
    book = load_partition_book(str(layout.config), rpc.get_machine_id())[0]
    return DistributedDataset(layout, DistGraph(GRAPH_NAME, gpb=book))
