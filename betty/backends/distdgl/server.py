"""One DistDGL graph server: it holds partition ``machine`` and answers the trainers.

Run as a process of its own (:class:`betty.backends.distdgl.cluster.GraphServers`
starts it)::

    python -m betty.backends.distdgl.server --config FOLDER/graph.json --machine M \\
        --ip-config IP_CONFIG --clients N

It serves partition ``M`` from the partition folder on the address of line ``M`` of
``IP_CONFIG`` (``HOST PORT``, one line per machine) until the trainers' DGL client 0
asks it to shut down, after all ``N`` trainers (every machine's) have connected and
finished. Its shared-memory tensors carry the machine's prefix
(:mod:`betty.backends.distdgl.shm`). It keeps the graph in both ``csc`` (sampling
in-edges) and ``coo`` (out-degrees) forms, and reads nothing from shared memory itself
(``disable_shared_mem``): its graph never collides with another server's on one host.
"""

from __future__ import annotations

import argparse
import os

from betty.backends.distdgl.cluster import GRAPH_FORMATS

__all__ = ["serve"]


def serve(config: str, machine: int, ip_config: str, clients: int) -> None:
    """Serve partition ``machine`` of the partitioning at ``config`` (DGL's partition
    configuration) until shut down; see the module docstring."""
    os.environ.setdefault("DGLBACKEND", "pytorch")
    from dgl.distributed import DistGraphServer, rpc

    from betty.backends.distdgl import shm

    shm.set_machine(machine, ip_config)
    shm.install()
    rpc.reset()
    server = DistGraphServer(machine, ip_config, 1, clients, config, disable_shared_mem=True,
                             graph_format=list(GRAPH_FORMATS))
    server.start()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="DGL's partition configuration (FOLDER/graph.json)")
    ap.add_argument("--machine", type=int, required=True, help="this server's partition and ip_config line")
    ap.add_argument("--ip-config", required=True)
    ap.add_argument("--clients", type=int, required=True, help="trainers over all machines")
    args = ap.parse_args(argv)
    serve(args.config, args.machine, args.ip_config, args.clients)


if __name__ == "__main__":
    main()
