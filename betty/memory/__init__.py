"""Memory: measure it (:class:`MemoryMeter`), estimate it before running
(:func:`estimate_micro_batch`, :func:`estimate_pieces`; reversible GNNs:
:func:`estimate_rev`, :func:`estimate_rev_parts`), choose K from it (:func:`search_k`,
:func:`search_k_rev`), calibrate the backend constants (:func:`calibrate`) and enforce a
budget on CUDA (:func:`apply_budget`, :func:`oom_guard`)."""

from betty.memory.meter import MemoryMeter, MemoryReading, module_bytes, optimizer_state_bytes, tensor_bytes
from betty.memory.constants import BACKENDS, BackendConstants, default_backend, load_constants
from betty.memory.spec import ModelSpec, OptimizerSpec
from betty.memory.sizes import PieceSizes, micro_batch_sizes, piece_sizes
from betty.memory.estimator import MemoryEstimate, estimate_micro_batch, estimate_pieces, estimate_sizes
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
from betty.memory.report import estimate_report

# RevGNN's estimator lives in betty.rev.memory, which builds on this package; its names
# are re-exported lazily so that importing either package first works (an eager import
# here made `import betty.rev.memory` fail on a cycle when it came first).
_REV_NAMES = ("RevKSearchError", "RevKSearchResult", "RevModelShape", "estimate_rev",
              "estimate_rev_parts", "estimate_rev_sizes", "rev_persistent_bytes", "search_k_rev")


def __getattr__(name: str):
    if name in _REV_NAMES:
        from betty.rev import memory as rev_memory

        return getattr(rev_memory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MemoryMeter", "MemoryReading", "module_bytes", "optimizer_state_bytes", "tensor_bytes",
    "BACKENDS", "BackendConstants", "default_backend", "load_constants",
    "ModelSpec", "OptimizerSpec", "PieceSizes", "micro_batch_sizes", "piece_sizes",
    "MemoryEstimate", "estimate_micro_batch", "estimate_pieces", "estimate_sizes",
    "DEFAULT_SAFETY_MARGIN", "KSearchError", "KSearchResult", "make_estimator", "make_k_chooser",
    "memory_balance_weights", "search_k", "calibrate",
    "EstimatedOOMError", "apply_budget", "oom_guard", "estimate_report", *_REV_NAMES,
]
