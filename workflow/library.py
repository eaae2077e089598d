"""Library features the schema accepts but a given version of betty may lack.

``partition.k: auto`` and ``partition.balance: memory`` need the memory model
(``betty.memory.ksearch``; for ``revgnn`` the reversible one, ``betty.rev.memory``),
``model.arch: revgnn`` needs ``"revgnn"`` in ``betty.models.ARCHS``. The spec schema validates them regardless; at run time
:func:`preflight` checks the library before any work and raises
:class:`NotAvailableYet` with a clear message (a FAILED run) instead of silently doing
something else. The trainer builds the K search and the memory estimator itself
(``betty.engine.Trainer``); this module only checks that they exist.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["NotAvailableYet", "find_feature", "require_arch", "missing_features", "preflight"]

K_SEARCH = ("betty.memory.ksearch", "make_k_chooser")
MEMORY_BALANCE = ("betty.memory.ksearch", "memory_balance_weights")
REV_K_SEARCH = ("betty.rev.memory", "search_k_rev")


class NotAvailableYet(RuntimeError):
    """The spec asks for a library feature this version of betty does not have."""


def find_feature(module: str, attr: str) -> Any | None:
    """``module.attr`` if the module exists and defines it, else ``None`` (errors raised
    *inside* an existing module propagate)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and module.startswith(err.name):
            return None
        raise
    return getattr(mod, attr, None)


def _arch_message(arch: str) -> str | None:
    from betty.models import ARCHS

    if arch in ARCHS:
        return None
    return (f"model.arch {arch!r} is not available yet in this version of betty "
            f"(available: {', '.join(ARCHS)})")


def require_arch(arch: str) -> None:
    """Raise :class:`NotAvailableYet` unless ``betty.models`` can build ``arch``."""
    message = _arch_message(arch)
    if message:
        raise NotAvailableYet(message)


def missing_features(spec) -> list[str]:
    """What ``spec`` (a :class:`workflow.spec.Spec`) asks for that this version of the
    library lacks, one message per feature (empty when everything is available)."""
    out = []
    message = _arch_message(spec.model.arch)
    if message:
        out.append(message)
    p = spec.partition
    search = REV_K_SEARCH if spec.model.arch == "revgnn" else K_SEARCH
    if p.k == "auto" and find_feature(*search) is None:
        out.append(f"partition.k: auto needs {'.'.join(search)} (memory estimator and K search), "
                   "not available yet in this version of betty")
    if p.balance == "memory" and find_feature(*MEMORY_BALANCE) is None:
        out.append(f"partition.balance: memory needs {'.'.join(MEMORY_BALANCE)}, not available yet "
                   "in this version of betty")
    return out


def preflight(spec) -> None:
    """Raise :class:`NotAvailableYet` listing :func:`missing_features`, before any work."""
    missing = missing_features(spec)
    if missing:
        raise NotAvailableYet("; ".join(missing))
