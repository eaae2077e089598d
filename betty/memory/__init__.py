"""Memory: measure it (:class:`MemoryMeter`), estimate it before running
(:func:`estimate_micro_batch`, :func:`estimate_micro_batches`), choose K from it
(:func:`search_k`), calibrate the backend constants (:func:`calibrate`) and enforce a
budget on CUDA (:func:`apply_budget`, :func:`oom_guard`); record what real code
allocates and frees (:class:`~betty.memory.trace.AllocationTrace`, the replays'
oracle). Reversible GNNs' estimator and K search build on this package from above:
:mod:`betty.rev.memory`."""

from betty.memory.meter import MemoryMeter, MemoryReading, module_bytes, optimizer_state_bytes, tensor_bytes
from betty.memory.constants import BACKENDS, BackendConstants, default_backend, load_constants
from betty.memory.spec import ModelSpec, OptimizerSpec
from betty.memory.sizes import MicroBatchSizes, micro_batch_sizes, split_sizes
from betty.memory.estimator import MemoryEstimate, estimate_micro_batch, estimate_micro_batches, estimate_sizes
from betty.memory.ksearch import (
    DEFAULT_SAFETY_MARGIN,
    KSearchError,
    KSearchResult,
    make_estimator,
    make_k_chooser,
    memory_balance_weights,
    search_k,
)
from betty.memory.calibrate import calibrate
from betty.memory.cuda import EstimatedOOMError, apply_budget, oom_guard
from betty.memory.report import estimate_report, split_report
from betty.memory.trace import AllocationTrace, TraceEvent

__all__ = [
    "MemoryMeter", "MemoryReading", "module_bytes", "optimizer_state_bytes", "tensor_bytes",
    "BACKENDS", "BackendConstants", "default_backend", "load_constants",
    "ModelSpec", "OptimizerSpec", "MicroBatchSizes", "micro_batch_sizes", "split_sizes",
    "MemoryEstimate", "estimate_micro_batch", "estimate_micro_batches", "estimate_sizes",
    "DEFAULT_SAFETY_MARGIN", "KSearchError", "KSearchResult", "make_estimator", "make_k_chooser",
    "memory_balance_weights", "search_k", "calibrate",
    "EstimatedOOMError", "apply_budget", "oom_guard", "estimate_report", "split_report",
    "AllocationTrace", "TraceEvent",
]
