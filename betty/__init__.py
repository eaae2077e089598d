"""betty: exact micro-batch training for GNN batches that do not fit in memory.

Importing betty sets two process defaults, where the user has not set them; both take
effect only if set before torch (or dgl) is imported, so import betty first (the CLI
and MLflow entry points do):

* ``OMP_WAIT_POLICY=PASSIVE``: PyTorch and DGL each bring their own OpenMP runtime;
  with the default spinning wait policy the idle threads of one starve the other's
  workers (10x slower epochs measured on a 2-core machine).
* ``THP_MEM_ALLOC_ENABLE=1``: PyTorch's CPU allocator backs each allocation of 2 MiB or
  more with transparent huge pages (``madvise``), so the gigabytes an epoch allocates
  and frees (sampled blocks, carved micro-batches, gathered features, activations)
  fault in 2 MiB pages, not 4 KiB ones. On the full-size synthetic-products epoch a
  reused serial epoch took 20.6-22.0 CPU-seconds with it and 31.5-35.1 without, peak
  RSS 3.6% higher (docs/benchmarks.md). Where the kernel's THP is ``never`` it changes
  nothing.
"""

import os as _os

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
