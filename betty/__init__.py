"""betty: exact micro-batch training for GNN batches that do not fit in memory."""

import os as _os

# PyTorch and DGL each bring their own OpenMP runtime; with the default spinning wait
# policy the idle threads of one starve the other's workers (10x slower epochs measured
# on a 2-core machine). PASSIVE only takes effect if set before torch/dgl are imported,
# so import betty first (the CLI and MLflow entry points do).
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
