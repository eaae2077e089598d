"""Shared-memory names of DistDGL's servers, made distinct per machine.

A DistDGL server puts the tensors of its partition (features, labels, edge data) in
POSIX shared memory so that the trainers on its machine read them without a request.
DGL 2.1 names those objects after the tensor alone (``node~_N~feat-kvdata-``), without
the partition, and opens them without ``O_EXCL``: two servers on one host, which is
how a multi-machine run is tried on one machine, share one object, and a trainer reads
one partition's rows where it asked for the other's, with no error.

:func:`install` prefixes every such name with :func:`prefix`, ``p<machine>_<cluster>_``:
``machine`` is a server's own partition (:func:`set_machine`, before it starts) or a
trainer's DGL machine ID (the first line of the IP configuration whose address is
local: the partition whose tensors it reads from shared memory; on one host every
trainer is machine 0, and reaches the other partitions through requests, as on
separate machines); ``cluster`` (:func:`cluster_tag`) names the IP configuration, so
two clusters on one host (two jobs, which listen on different ports) never share an
object, while every server and trainer of one cluster, whichever launcher started it,
finds the same names. It patches ``dgl.distributed.kvstore.empty_shared_mem``, a DGL
2.1 internal: :func:`install` refuses another DGL version rather than guess.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["install", "set_machine", "prefix", "cluster_tag"]

_STATE: dict = {"machine": None, "ip_config": None, "installed": False}
SUPPORTED = "2.1."


def set_machine(machine: int, ip_config: str | Path) -> None:
    """This process is the server of partition ``machine`` of the cluster that the IP
    configuration file ``ip_config`` describes."""
    _STATE["machine"], _STATE["ip_config"] = int(machine), str(ip_config)


def cluster_tag(ip_config: str | Path) -> str:
    """Eight hex digits of the SHA-256 of the IP configuration ``ip_config``'s lines
    (addresses and ports; blank lines and spacing aside)."""
    lines = (" ".join(line.split()) for line in Path(ip_config).read_text().splitlines())
    return hashlib.sha256("\n".join(line for line in lines if line).encode()).hexdigest()[:8]


def prefix(machine: int, ip_config: str | Path) -> str:
    """``p<machine>_<cluster_tag(ip_config)>_``: what the shared-memory names of
    partition ``machine``'s tensors start with."""
    return f"p{int(machine)}_{cluster_tag(ip_config)}_"


def _prefix() -> str:
    if _STATE["machine"] is None:  # a trainer: its machine and cluster as DGL sees them
        from dgl.distributed import rpc

        return prefix(rpc.get_machine_id(), os.environ["DGL_IP_CONFIG"])
    return prefix(_STATE["machine"], _STATE["ip_config"])


def install() -> None:
    """Prefix DGL's shared-memory tensor names with this process's machine (idempotent).

    Raises:
        RuntimeError: a DGL other than 2.1.x.
    """
    if _STATE["installed"]:
        return
    import dgl
    import dgl.distributed.kvstore as kvstore

    if not dgl.__version__.startswith(SUPPORTED):
        raise RuntimeError(f"betty's DistDGL store is written against DGL {SUPPORTED}x, found "
                           f"{dgl.__version__}: check dgl.distributed.kvstore's shared-memory names "
                           "(betty/backends/distdgl/shm.py) before using it")
    named = kvstore.empty_shared_mem

    def empty_shared_mem(name, is_create, shape, dtype):
        return named(_prefix() + name, is_create, shape, dtype)

    kvstore.empty_shared_mem = empty_shared_mem
    _STATE["installed"] = True
