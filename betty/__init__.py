"""betty: exact micro-batch training for GNN batches that do not fit in memory."""

__version__ = "0.1.0"
