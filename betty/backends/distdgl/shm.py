"""Shared-memory names of DistDGL's servers, made distinct per machine.

A DistDGL server puts the tensors of its partition (features, labels, edge data) in
POSIX shared memory so that the trainers on its machine read them without a request.
DGL 2.1 names those objects after the tensor alone (``node~_N~feat-kvdata-``), without
the partition, and opens them without ``O_EXCL``: two servers on one host, which is
how a multi-machine run is tried on one machine, share one object, and a trainer reads
one partition's rows where it asked for the other's, with no error.

:func:`install` prefixes every such name with ``p<machine>_``: a server with its own
partition (:func:`set_machine`, before it starts), a trainer with its DGL machine ID
(the first line of the IP configuration whose address is local: the partition whose
tensors it reads from shared memory; on one host every trainer is machine 0, and
reaches the other partitions through requests, as on separate machines). On separate
machines each machine's names differ from its neighbours' anyway, and the prefix
changes nothing. It patches ``dgl.distributed.kvstore.empty_shared_mem``, a DGL 2.1
internal: :func:`install` refuses another DGL version rather than guess.
"""

from __future__ import annotations

__all__ = ["install", "set_machine"]

_STATE: dict = {"machine": None, "installed": False}
SUPPORTED = "2.1."


def set_machine(machine: int) -> None:
    """This process is the server of partition ``machine``."""
    _STATE["machine"] = int(machine)


def _prefix() -> str:
    machine = _STATE["machine"]
    if machine is None:
        from dgl.distributed import rpc

        machine = rpc.get_machine_id()
    return f"p{machine}_"


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
