"""Backend boundary: everything framework specific (DGL or PyTorch Geometric).

betty's core works on framework-neutral index tensors (:class:`betty.batch.LayerEdges`);
a *backend* turns those into its own block object and supplies the message-passing
primitives and convolution layers the models use. Two backends exist:

* ``dgl``: DGL blocks (``dgl.create_block``), DGL's ``SAGEConv``, ``dgl.ops``.
* ``pyg``: :class:`betty.backends.pyg_backend.PygBlock` (an ``edge_index`` plus sizes),
  PyG's scatter/softmax, and a SAGE layer with DGL's math and parameter names.

Neither framework is imported until a backend is used. ``"auto"`` picks ``dgl`` where
it imports, else ``pyg``.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import lru_cache

from betty.backends.base import Backend

__all__ = ["Backend", "BACKENDS", "BACKEND_CHOICES", "INSTALL", "BackendUnavailable", "library_versions",
           "available", "resolve_backend", "get_backend", "backend_of", "backend_of_graph"]

BACKENDS = ("dgl", "pyg")
BACKEND_CHOICES = ("auto",) + BACKENDS
INSTALL = {"dgl": "pip install 'betty[dgl]'", "pyg": "pip install 'betty[pyg]'"}
_FRAMEWORK = {"dgl": "dgl", "pyg": "torch_geometric"}
_MODULE = {"dgl": "betty.backends.dgl_backend", "pyg": "betty.backends.pyg_backend"}


class BackendUnavailable(ImportError):
    """The requested backend's framework does not import in this environment."""


@lru_cache(maxsize=None)
def available(name: str, import_check: bool = True) -> bool:
    """Whether backend ``name``'s framework imports here (the import is attempted once);
    ``import_check=False``: whether it is installed (found, not imported: a spec check
    that must stay light; a broken install shows when a run imports it)."""
    _check_name(name)
    if importlib.util.find_spec(_FRAMEWORK[name]) is None:
        return False
    if not import_check:
        return True
    try:
        importlib.import_module(_FRAMEWORK[name])
    except Exception:  # a broken install (e.g. DGL against the wrong torch) counts as missing
        return False
    return True


def _check_name(name: str) -> None:
    if name not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {name!r}")


def resolve_backend(name: str = "auto", *, import_check: bool = True) -> str:
    """``"auto"`` -> ``"dgl"`` if DGL imports, else ``"pyg"``; an explicit name must be
    available (``import_check``: see :func:`available`). Raises
    :class:`BackendUnavailable` naming the install command."""
    _check_name(name)
    if name == "auto":
        for candidate in BACKENDS:
            if available(candidate, import_check):
                return candidate
        raise BackendUnavailable(
            "no GNN backend imports (neither dgl nor torch_geometric); install one: "
            + " or ".join(INSTALL.values()))
    if not available(name, import_check):
        raise BackendUnavailable(
            f"backend {name!r} is not installed ({_FRAMEWORK[name]} does not import); "
            f"install it with: {INSTALL[name]}")
    return name


def library_versions(name: str) -> str:
    """Backend ``name``'s framework and torch with their installed versions, e.g.
    ``"dgl 2.1.0, torch 2.2.1"`` (read from the package metadata, nothing imported)."""
    from importlib import metadata

    _check_name(name)
    return ", ".join(f"{dist} {metadata.version(dist)}" for dist in (_FRAMEWORK[name], "torch"))


@lru_cache(maxsize=None)
def get_backend(name: str = "auto") -> Backend:
    """The backend object for ``name`` (``"auto"`` resolved first)."""
    name = resolve_backend(name)
    return importlib.import_module(_MODULE[name]).BACKEND


def backend_of(model) -> Backend:
    """The backend a model was built for (``model.backend_name``; ``auto`` for a model
    without one, or ``None``)."""
    return get_backend(getattr(model, "backend_name", "auto"))


def backend_of_graph(graph) -> Backend:
    """The backend whose graph or block object ``graph`` is (a ``dgl.DGLGraph`` ->
    ``dgl``; a :class:`~betty.backends.pyg_backend.PygBlock` / ``PygGraph`` -> ``pyg``),
    told apart by the defining module so neither framework is imported to ask."""
    module = type(graph).__module__
    if module == "dgl" or module.startswith("dgl."):
        return get_backend("dgl")
    if module == _MODULE["pyg"]:
        return get_backend("pyg")
    raise TypeError(f"expected a DGL graph or a betty PyG graph/block, got {type(graph).__name__} "
                    "(turn a betty.graph.Graph into one with get_backend(name).full_graph(graph))")
