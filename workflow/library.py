"""Library features a spec names that a given build of betty may lack.

``model.arch`` must be one of :data:`betty.catalog.ARCHS` (the architectures
:func:`betty.models.build_model` builds). The spec schema validates the key regardless;
at run time :func:`preflight` checks it before any work and raises
:class:`NotAvailableYet` with a clear message (a FAILED run) instead of silently doing
something else. Reads only the catalog, so ``betty validate`` imports no framework.
"""

from __future__ import annotations

__all__ = ["NotAvailableYet", "require_arch", "missing_features", "preflight"]


class NotAvailableYet(RuntimeError):
    """The spec asks for a library feature this version of betty does not have."""


def _arch_message(arch: str) -> str | None:
    from betty import catalog

    if arch in catalog.ARCHS:
        return None
    return (f"model.arch {arch!r} is not available yet in this version of betty "
            f"(available: {', '.join(catalog.ARCHS)})")


def require_arch(arch: str) -> None:
    """Raise :class:`NotAvailableYet` unless ``arch`` is in :data:`betty.catalog.ARCHS`."""
    message = _arch_message(arch)
    if message:
        raise NotAvailableYet(message)


def missing_features(spec) -> list[str]:
    """What ``spec`` (a :class:`workflow.spec.Spec`) asks for that this version of the
    library lacks, one message per feature (empty when everything is available)."""
    message = _arch_message(spec.model.arch)
    return [message] if message else []


def preflight(spec) -> None:
    """Raise :class:`NotAvailableYet` listing :func:`missing_features`, before any work."""
    missing = missing_features(spec)
    if missing:
        raise NotAvailableYet("; ".join(missing))
