"""One copy of a dataset's big tensors for all the ranks of a machine.

The launching process loads the dataset once and writes every large tensor (edge
endpoints, the in-neighbour CSR every sampler builds, features, labels, splits) as raw
bytes to a folder in ``/dev/shm`` (RAM-backed; the temp dir where there is none).
:func:`share_dataset` returns a small picklable :class:`SharedDataset` that travels to
the ranks instead of the data; each rank's :meth:`SharedDataset.attach` maps the files
with ``torch.from_file(..., shared=False)`` (a private copy-on-write mapping): pages a
rank only reads stay the one copy in the page cache, and a rank that writes into a
tensor gets its own page without changing the others' data.

Memory of one machine with R ranks and a dataset of D bytes: ``R·D`` when every rank
loads its own copy, ``D`` (the shared files) plus the launcher's copy when shared. A
rank's resident set (RSS) still counts the shared pages it touched; its proportional set
size (PSS, each shared page divided by the number of processes mapping it) does not:
:func:`memory_of_process` reads both.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch

from betty.owner import Owner, reclaim_stale_folders

__all__ = ["SharedTensor", "SharedDataset", "share_dataset", "shared_folder", "memory_of_process"]


def shared_folder() -> str:
    """``/dev/shm`` when it exists and is writable, else the temp dir."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


@dataclass(frozen=True)
class SharedTensor:
    """A tensor stored as raw bytes in ``path``: ``dtype``, ``shape``."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def write(cls, tensor: torch.Tensor, path: str) -> "SharedTensor":
        """Write ``tensor``'s bytes (C order) to ``path``."""
        t = tensor.detach().to("cpu").contiguous()
        t.reshape(-1).view(torch.uint8).numpy().tofile(path)
        return cls(path, t.dtype, tuple(t.shape))

    def open(self) -> torch.Tensor:
        """The tensor, mapped copy-on-write from the file (no copy is made)."""
        numel = 1
        for n in self.shape:
            numel *= n
        if numel == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.from_file(self.path, shared=False, size=numel, dtype=self.dtype).view(self.shape)


@dataclass(frozen=True)
class SharedDataset:
    """A :class:`betty.data.GraphDataset` whose tensors live in files of ``folder``.

    ``tensors`` maps field names (``graph.in_csr.<i>``, or ``graph.src``/``graph.dst``,
    ``feat``, ``label``, ``train_idx`` ...) to their files; ``scalars`` holds the other
    fields (name, num_classes, flags)."""

    folder: str
    num_nodes: int
    tensors: dict[str, SharedTensor] = field(default_factory=dict)
    scalars: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes in the shared files."""
        return sum(os.path.getsize(t.path) for t in self.tensors.values())

    def attach(self):
        """The dataset, its tensors mapped from the shared files (cheap: no data is
        read until used)."""
        from betty.data.types import GraphDataset
        from betty.graph import Graph

        t = {name: st.open() for name, st in self.tensors.items()}
        if "graph.in_csr.0" in t:  # the CSR alone, computed once by the launcher
            csr = [t.pop(f"graph.in_csr.{i}", None) for i in range(3)]
            graph = Graph.from_csr(*csr, self.num_nodes)
        else:
            graph = Graph(t.pop("graph.src"), t.pop("graph.dst"), self.num_nodes)
        return GraphDataset(graph=graph, **t, **self.scalars)


@contextlib.contextmanager
def share_dataset(dataset, folder: str | None = None, *, with_csr: bool = True) -> Iterator[SharedDataset]:
    """Write ``dataset``'s tensors to a fresh folder under ``folder`` (default
    :func:`shared_folder`), yield the :class:`SharedDataset`, and delete the folder on
    exit (after the ranks are done). ``with_csr``: also share ``graph.in_csr`` (built
    here once instead of in every rank).

    The folder's name states this process as its owner (:class:`Owner`), and the
    folders of ``folder`` whose owner is gone (a launcher killed by SIGKILL) are removed
    first (:func:`reclaim_stale_folders`)."""
    from betty.data.types import GraphDataset

    parent = folder or shared_folder()
    reclaim_stale_folders(parent)
    root = tempfile.mkdtemp(prefix=Owner.current().prefix(), dir=parent)
    try:
        tensors: dict[str, SharedTensor] = {}

        def put(name: str, tensor: torch.Tensor) -> None:
            tensors[name] = SharedTensor.write(tensor, os.path.join(root, name + ".bin"))

        graph = dataset.graph
        if with_csr:
            for i, part in enumerate(graph.in_csr):
                if part is not None:  # eid is None when edge IDs are CSR positions
                    put(f"graph.in_csr.{i}", part)
        else:
            put("graph.src", graph.src)
            put("graph.dst", graph.dst)
        scalars = {}
        for f in fields(GraphDataset):
            if f.name == "graph":
                continue
            value = getattr(dataset, f.name)
            if isinstance(value, torch.Tensor):
                put(f.name, value)
            else:
                scalars[f.name] = value
        yield SharedDataset(root, int(graph.num_nodes()), tensors, scalars)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def memory_of_process() -> dict[str, float]:
    """This process's memory now, from ``/proc/self/smaps_rollup`` (Linux):
    ``rss_bytes`` (resident, shared pages included), ``pss_bytes`` (proportional: each
    shared page divided by its sharers), ``shared_bytes`` (resident pages shared with
    another process), plus ``rss_peak_bytes`` (``getrusage``'s high-water mark).
    Fields the system does not report are left out."""
    import resource

    out = {"rss_peak_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}
    try:
        with open("/proc/self/smaps_rollup") as fh:
            rows = dict(line.split(":", 1) for line in fh if ":" in line and not line.startswith(" "))
    except OSError:
        return out

    def kib(key: str) -> float | None:
        value = rows.get(key)
        return None if value is None else float(value.split()[0]) * 1024

    for name, keys in (("rss_bytes", ["Rss"]), ("pss_bytes", ["Pss"]),
                       ("shared_bytes", ["Shared_Clean", "Shared_Dirty"])):
        values = [kib(k) for k in keys]
        if all(v is not None for v in values):
            out[name] = sum(values)
    return out
