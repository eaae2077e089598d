"""DistDGL as betty's graph store: graphs held by graph servers, one partition per machine.

* :mod:`~betty.backends.distdgl.partition`: a dataset written as DistDGL partitions,
  with betty's maps back to the original IDs (:func:`write_partitions`);
* :mod:`~betty.backends.distdgl.server`: one graph server process;
* :mod:`~betty.backends.distdgl.cluster`: a machine's servers, supervised, and the
  ranks launched beside them (:func:`launch`);
* :mod:`~betty.backends.distdgl.store`: a trainer's view of the partitioned dataset
  (:func:`connect`), which a :class:`betty.engine.Trainer` trains on as on a loaded one,
  sampling the same batches;
* :mod:`~betty.backends.distdgl.shm`: DistDGL's shared-memory names made distinct per
  machine, so that several machines' servers can share one host.

DGL only (``dgl.distributed``); imports DGL on use, not on import.
"""

from betty.backends.distdgl.cluster import GraphServerError, GraphServers, launch, read_ip_config
from betty.backends.distdgl.partition import PartitionLayout, ensure_partitions, read_layout, write_partitions
from betty.backends.distdgl.store import DistributedDataset, connect

__all__ = ["write_partitions", "ensure_partitions", "read_layout", "PartitionLayout", "GraphServers", "GraphServerError",
           "launch", "read_ip_config", "connect", "DistributedDataset"]
