"""Dataset names, their options, and the single entry point :func:`load_dataset`."""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from betty.data.names import DGL_BUILTIN_NAMES, FEATURE_DTYPES, OGB_NAMES, PLANETOID_NAMES, DatasetNotFoundError
from betty.data.synthetic_config import SYNTHETIC_PRESETS, SyntheticConfig

if TYPE_CHECKING:
    from betty.data.types import GraphDataset


def _module(name: str):
    """``betty.data.<name>``, imported when first used: the loaders and the cache need
    numpy and torch, the names, options and their checks here do not."""
    return importlib.import_module(f"betty.data.{name}")

__all__ = ["DatasetSpec", "DATASETS", "COMMON_OPTIONS", "FEATURE_DTYPES", "allowed_options", "keyed_options", "dataset_names", "resolve_options", "check_available", "cache_path", "dataset_digest", "load_dataset"]


@dataclass(frozen=True)
class DatasetSpec:
    """How one dataset name is loaded.

    Attributes:
        name: the name given to :func:`load_dataset`.
        defaults: every allowed option and its default.
        build: ``(name, root, options) -> GraphDataset``.
        normalize: checks option values and returns them in canonical form (so equal
            settings give equal cache keys); raises ``ValueError`` on bad values.
        fingerprint: ``(name, root, options) -> JSON-able`` identity of the source files
            (sizes and modification times): part of the cache key and of
            :func:`dataset_digest`, so a replaced file is seen.
        cached: whether betty caches the loaded dataset (``False``: cheap to load, or
            already cached by its library).
        description: one line for listings.
        writes_store: ``(name, root, options, folder, feature_dtype) -> None`` for a
            dataset generated straight into its cache folder (never held in memory),
            its features written in ``feature_dtype`` (a torch dtype) chunk by chunk;
            ``build`` is then unused.
        check_files: ``(name, root, options) -> None`` raising
            :class:`DatasetNotFoundError` when the files ``build`` reads are not on
            disk, without reading them; ``None``: nothing to read (generated).
    """

    name: str
    defaults: Mapping[str, Any]
    build: Callable[[str, Path, dict], GraphDataset]
    normalize: Callable[[dict], dict] = dict
    fingerprint: Callable[[str, Path, dict], Any] | None = None
    cached: bool = True
    description: str = ""
    writes_store: Callable[[str, Path, dict, Path, Any], None] | None = None
    check_files: Callable[[str, Path, dict], None] | None = None


def _synthetic_normalize(preset: str) -> Callable[[dict], dict]:
    float_fields = {
        k for k, v in SYNTHETIC_PRESETS[preset].to_dict().items() if isinstance(v, float)
    } | {"max_degree"}

    def normalize(opts: dict) -> dict:
        out = {
            k: float(v)
            if k in float_fields and isinstance(v, int) and not isinstance(v, bool)
            else v
            for k, v in opts.items()
        }
        return SyntheticConfig(**out).to_dict()  # validates

    return normalize


def _synthetic_build(name: str, root: Path, opts: dict) -> GraphDataset:
    # looked up at call time, so tests can observe whether the generator ran
    return _module("synthetic").generate_synthetic(SyntheticConfig(**opts), name=name)


def _no_source(name: str, root: Path, opts: dict) -> list:
    return []


def _ogb_build(name: str, root: Path, opts: dict) -> GraphDataset:
    return _module("ogb_loader").load_ogb(name, root)


def _ogb_fingerprint(name: str, root: Path, opts: dict) -> list:
    return _module("ogb_loader").ogb_source_fingerprint(name, root)


def _ogb_check(name: str, root: Path, opts: dict) -> None:
    _module("ogb_loader").check_ogb_files(name, root)


def _dgl_builtin_check(name: str, root: Path, opts: dict) -> None:
    _module("dgl_builtin").check_files(name, root)


def _dgl_builtin_fingerprint(name: str, root: Path, opts: dict) -> list:
    """The raw files DGL reads, or where they are absent its processed ones (not both:
    DGL writes its processed file beside the raw ones on the first load)."""
    builtin, files_fingerprint = _module("dgl_builtin"), _module("cache").files_fingerprint
    folder, spec = builtin.dgl_raw_path(name, root), builtin.DGL_BUILTINS[name]
    raw = files_fingerprint([folder / f for f in spec.raw_files], folder)
    return raw if len(raw) == len(spec.raw_files) else files_fingerprint(
        [folder / f for f in spec.processed_files], folder)


def _dgl_file_fingerprint(name: str, root: Path, opts: dict) -> list:
    return _module("cache").files_fingerprint([Path(opts["path"])])


def _dgl_file_check(name: str, root: Path, opts: dict) -> None:
    if not Path(opts["path"]).is_file():
        raise DatasetNotFoundError(f"dgl-file: path={str(opts['path'])!r} does not exist")


def _dgl_builtin_build(name: str, root: Path, opts: dict) -> GraphDataset:
    if name in PLANETOID_NAMES:
        return _module("planetoid").load_planetoid_dataset(name, root)
    return _module("dgl_builtin").load_dgl_builtin(name, root)


def _dgl_file_normalize(opts: dict) -> dict:
    nc = opts["num_classes"]
    if nc is not None and (not isinstance(nc, int) or isinstance(nc, bool) or nc < 1):
        raise ValueError(f"num_classes={nc!r} (allowed: None or integer >= 1)")
    if opts["path"] is None:
        raise ValueError("dataset 'dgl-file' needs option path=<file written by dgl.save_graphs>")
    return {"path": str(opts["path"]), "num_classes": nc}


def _dgl_file_build(name: str, root: Path, opts: dict) -> GraphDataset:
    return _module("dgl_file").load_dgl_file(opts["path"], name=name, num_classes=opts["num_classes"])


def _papers_normalize(opts: dict) -> dict:
    return _module("synthetic_papers").normalize_papers_options(opts)


def _papers_write(name: str, root: Path, opts: dict, folder: Path, feature_dtype) -> None:
    papers = _module("synthetic_papers")
    scalars = _module("cache").entry_scalars(folder, name, papers.papers_counts(opts["scale"])["num_nodes"],
                                             papers.PAPERS_SHAPE["num_classes"])
    papers.write_synthetic_papers(folder, opts, name=name, scalars=scalars, feature_dtype=feature_dtype)


def _build_registry() -> dict[str, DatasetSpec]:
    specs: list[DatasetSpec] = []
    for preset, config in SYNTHETIC_PRESETS.items():
        specs.append(
            DatasetSpec(
                name=preset,
                defaults=config.to_dict(),
                build=_synthetic_build,
                normalize=_synthetic_normalize(preset),
                fingerprint=_no_source,
                description=f"generated ({config.scaled_num_nodes:,} nodes at scale 1)",
            )
        )
    specs.append(
        DatasetSpec(
            name="synthetic-papers",
            defaults={"scale": 1.0, "seed": 0, "feature_snr": 0.5, "chunk_edges": 1 << 23},
            build=_no_source,
            normalize=_papers_normalize,
            fingerprint=_no_source,
            writes_store=_papers_write,
            description="generated straight to disk, ogbn-papers100M's shape at scale 1 (111,059,956 nodes)",
        )
    )
    for ogb_name in OGB_NAMES:
        specs.append(
            DatasetSpec(
                name=ogb_name,
                defaults={},
                build=_ogb_build,
                fingerprint=_ogb_fingerprint,
                check_files=_ogb_check,
                description="OGB, raw files read offline with ogb's raw readers",
            )
        )
    for dgl_name in DGL_BUILTIN_NAMES:
        specs.append(
            DatasetSpec(
                name=dgl_name,
                defaults={},
                build=_dgl_builtin_build,
                fingerprint=_dgl_builtin_fingerprint,
                cached=False,
                check_files=_dgl_builtin_check,
                description=("Planetoid raw files in DGL's folder layout, read by betty"
                             if dgl_name in PLANETOID_NAMES
                             else "DGL built-in dataset class, offline"),
            )
        )
    specs.append(
        DatasetSpec(
            name="dgl-file",
            defaults={"path": None, "num_classes": None},
            build=_dgl_file_build,
            normalize=_dgl_file_normalize,
            fingerprint=_dgl_file_fingerprint,
            cached=False,
            check_files=_dgl_file_check,
            description="a dgl.save_graphs file with feat/label/train_mask/val_mask/test_mask",
        )
    )
    return {s.name: s for s in specs}


DATASETS: dict[str, DatasetSpec] = _build_registry()


def dataset_names() -> list[str]:
    """All names :func:`load_dataset` accepts."""
    return list(DATASETS)


def _spec(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset name={name!r}; allowed: {', '.join(DATASETS)}")
    return DATASETS[name]


#: options every dataset takes, with their defaults. ``self_loops``: add an edge
#: ``v -> v`` to every node that has none, once, after loading and before any sampling
#: (:meth:`betty.graph.Graph.with_self_loops`; idempotent, existing loops are kept).
#: ``feature_dtype``: the dtype of ``GraphDataset.feat``, one of :data:`FEATURE_DTYPES`
#: (a name or the torch dtype), ``None`` = as the dataset's loader gives them (float32
#: for every cached dataset); a cached dataset stores its features in that dtype, so
#: they are memory-mapped as such (cast once, when the entry is written).
COMMON_OPTIONS: dict[str, Any] = {"self_loops": False, "feature_dtype": None}


#: option values that leave a cache key as it was before the option existed: each
#: common option at its default, and float32 features (what every cached dataset's
#: loader gives, so ``feature_dtype=float32`` names the entry ``None`` names).
_KEY_NEUTRAL: dict[str, tuple] = {"self_loops": (False,), "feature_dtype": (None, "float32")}


def allowed_options(name: str) -> list[str]:
    """Every option dataset ``name`` takes: its own, then :data:`COMMON_OPTIONS`."""
    return [*_spec(name).defaults, *COMMON_OPTIONS]


def resolve_options(name: str, options: Mapping[str, Any]) -> dict:
    """Defaults of ``name`` overridden by ``options``, validated and normalized (the
    dataset's own options, then :data:`COMMON_OPTIONS`).

    Raises:
        ValueError: unknown dataset, unknown option (naming it and listing the allowed
            ones) or a bad option value.
    """
    spec = _spec(name)
    allowed = allowed_options(name)
    unknown = [k for k in options if k not in allowed]
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for dataset {name!r}; "
            f"allowed options: {', '.join(allowed)}"
        )
    own = {k: v for k, v in options.items() if k not in COMMON_OPTIONS}
    common = {**COMMON_OPTIONS, **{k: v for k, v in options.items() if k in COMMON_OPTIONS}}
    if not isinstance(common["self_loops"], bool):
        raise ValueError(f"self_loops={common['self_loops']!r} (allowed: true or false)")
    if common["self_loops"] and spec.writes_store is not None:
        raise ValueError(f"self_loops=True is not supported for dataset {name!r} "
                         f"(allowed: false); the model adds the self term")
    common["feature_dtype"] = _feature_dtype_name(common["feature_dtype"])
    return {**spec.normalize({**spec.defaults, **own}), **common}


def _feature_dtype_name(value: Any) -> str | None:
    """``feature_dtype`` in canonical form: ``None`` or a name in :data:`FEATURE_DTYPES`
    (a torch dtype is given by its name, ``torch.bfloat16`` -> ``"bfloat16"``)."""
    if value is None:
        return None
    name = value if isinstance(value, str) else str(value).removeprefix("torch.")
    if name not in FEATURE_DTYPES or not (isinstance(value, str) or type(value).__name__ == "dtype"):
        raise ValueError(f"feature_dtype={value!r} (allowed: None, {', '.join(FEATURE_DTYPES)} "
                         f"or the torch dtype)")
    return name


def keyed_options(opts: Mapping[str, Any]) -> dict:
    """Resolved options without those at a value that leaves the cache key unchanged
    (:data:`_KEY_NEUTRAL`: ``self_loops=False``, ``feature_dtype`` ``None`` or
    ``float32``): what a cache key and a spec's hashed dataset section hold."""
    return {k: v for k, v in opts.items() if k not in _KEY_NEUTRAL or v not in _KEY_NEUTRAL[k]}


def _own_options(opts: Mapping[str, Any]) -> dict:
    """Resolved options without :data:`COMMON_OPTIONS` (what a loader reads)."""
    return {k: v for k, v in opts.items() if k not in COMMON_OPTIONS}


def _identity(name: str, root: str | Path, options: Mapping[str, Any]) -> dict:
    """What identifies a dataset's content: name, resolved options and, where the
    dataset has one, the fingerprint of its source files (sizes and mtimes).
    A common option at a key-neutral value is left out (:func:`keyed_options`), so
    adding one keeps existing keys."""
    spec = _spec(name)
    opts = resolve_options(name, options)
    payload: dict = {"name": name, "options": keyed_options(opts)}
    if spec.fingerprint is not None:
        payload["source"] = spec.fingerprint(name, Path(root), _own_options(opts))
    return payload


def _apply_common(ds: GraphDataset, opts: Mapping[str, Any]) -> GraphDataset:
    """``ds`` with the common options applied (self-loops)."""
    if opts["self_loops"]:
        ds = dataclasses.replace(ds, graph=ds.graph.with_self_loops())
    return ds


def _feature_torch_dtype(opts: Mapping[str, Any]):
    """The resolved ``feature_dtype`` as a torch dtype (``None`` stays ``None``)."""
    import torch

    return None if opts["feature_dtype"] is None else getattr(torch, opts["feature_dtype"])


def _with_feature_dtype(ds: GraphDataset, dtype) -> GraphDataset:
    """``ds`` with its features in ``dtype`` (``ds`` itself when they are, or ``dtype``
    is ``None``): the cast of a dataset that is not cached, and the fallback for a
    cached entry whose features are in another dtype."""
    if dtype is None or ds.feat.dtype == dtype:
        return ds
    return dataclasses.replace(ds, feat=ds.feat.to(dtype))


def check_available(name: str, root: str | Path = "data", **options) -> None:
    """Raise :class:`DatasetNotFoundError` (naming each missing file and where it goes)
    when the files dataset ``name`` reads are not under ``root``, without loading
    anything; return quietly when they are there or the dataset is generated.

    Raises:
        DatasetNotFoundError: a real dataset's files are missing.
        ValueError: unknown dataset or option, or a bad option value
            (:func:`resolve_options`).
    """
    spec = _spec(name)
    opts = resolve_options(name, options)
    if spec.check_files is not None:
        spec.check_files(name, Path(root), opts)


def cache_path(name: str, root: str | Path = "data", **options) -> Path | None:
    """The cache folder :func:`load_dataset` uses for these arguments (``None`` for
    datasets betty does not cache)."""
    spec = _spec(name)
    if spec.fingerprint is None or not spec.cached:
        return None
    return _module("cache").cache_file(Path(root), name, _identity(name, root, options))


def dataset_digest(name: str, root: str | Path = "data", **options) -> str:
    """16 hex digits identifying the dataset's content: :func:`betty.data.cache.cache_key`
    over name, resolved options and the source-file fingerprint (the cache file's key
    for cached datasets). Reads no data; raises like :func:`resolve_options`."""
    return _module("cache").cache_key(_identity(name, root, options))


def _load_written_store(spec: DatasetSpec, name: str, root: Path, opts: dict, path: Path | None,
                        verify: bool | str):
    """Load (or first generate) a dataset whose generator writes its cache folder."""
    if path is None:
        raise ValueError(f"dataset {name!r} is generated straight into betty's cache folder "
                         f"under root: cache=False is not allowed (allowed: cache=True)")
    cache = _module("cache")
    hit = cache.load_cached(path, verify=verify)
    if hit is None:
        import torch

        try:
            spec.writes_store(name, root, _own_options(opts), path, _feature_torch_dtype(opts) or torch.float32)
        except OSError as err:  # a read-only root, a full disk, a quota: there is nowhere else to put it
            raise OSError(err.errno, f"dataset {name!r} is generated straight into betty's cache and could "
                          f"not be written at {path} ({err}); give a root that can be written") from err
        hit = cache.load_cached(path, verify=False)
    if hit is None:
        raise RuntimeError(f"dataset {name!r}: the folder just written at {path} does not load")
    return _with_feature_dtype(hit, _feature_torch_dtype(opts))


def load_dataset(
    name: str, root: str | Path = "data", *, cache: bool = True, verify: bool | str = True,
    **options
) -> GraphDataset:
    """Load a node-classification dataset by name.

    Args:
        name: one of :func:`dataset_names`: ``synthetic``, ``synthetic-products``,
            ``ogbn-arxiv``, ``ogbn-products``, ``ogbn-proteins``, ``ogbn-papers100M``,
            ``cora``, ``citeseer``, ``pubmed``, ``reddit``, ``dgl-file``.
        root: data folder: OGB folders (``ogbn_products/``), DGL folders
            (``cora_v2_d697a464/``) and betty's cache (``betty-cache/``) live here.
        cache: read/write betty's processed-dataset cache (synthetic and OGB datasets).
        verify: how a cache entry found on disk is checked
            (:func:`betty.data.store.open_store`): ``True`` hashes the files changed
            since they were last verified, ``"full"`` every file, ``False`` none (the
            manifest and every file's size are always checked). An entry just written
            is not hashed again.
        **options: dataset options (see :class:`betty.data.synthetic.SyntheticConfig`;
            ``dgl-file`` takes ``path`` and ``num_classes``; the others take none of
            their own) and :data:`COMMON_OPTIONS` (``self_loops``, ``feature_dtype``),
            which every dataset takes. With ``feature_dtype`` bfloat16 or float16 a
            cached dataset has its own entry (the float32 entry's key is the one
            without the option), written with the features cast once, row chunk by
            row chunk, and loaded memory-mapped in that dtype: no float32 copy is
            read or made. A dataset not cached is cast after loading.

    Returns:
        A :class:`GraphDataset`.

    Raises:
        ValueError: unknown name or option, bad option value, malformed data.
        betty.data.DatasetNotFoundError: a real dataset's files are not under ``root``
            (raised immediately; nothing is ever downloaded).
    """
    spec = _spec(name)
    opts = resolve_options(name, options)
    root = Path(root)
    _module("store").verify_mode(verify)
    path = cache_path(name, root, **opts) if cache else None
    if spec.writes_store is not None:
        return _load_written_store(spec, name, root, opts, path, verify)
    dtype = _feature_torch_dtype(opts)
    if path is not None:
        hit = _module("cache").load_cached(path, verify=verify)
        if hit is not None:
            return _with_feature_dtype(hit, dtype)
    ds = _apply_common(spec.build(name, root, _own_options(opts)), opts)
    if path is not None:
        cache = _module("cache")
        lineage = cache.cache_key({k: v for k, v in _identity(name, root, opts).items() if k != "source"})
        try:
            cache.save_cached(ds, path, feature_dtype=dtype, lineage=lineage)
            cache.remove_superseded(path, lineage)  # this dataset's entries of older source files
        except OSError as err:  # a full disk, a quota, a read-only root: the dataset is built all the same
            warnings.warn(f"dataset {name!r}: could not write betty's cache at {path} ({err}); using the "
                          "dataset as loaded (load_dataset(..., cache=False), or a dataset.root that can be "
                          "written, avoids the attempt)", stacklevel=2)
            return _with_feature_dtype(ds, dtype)
        stored = _module("cache").load_cached(path, verify=False)  # just written: the lean, mapped form
        if stored is not None:
            return _with_feature_dtype(stored, dtype)
    return _with_feature_dtype(ds, dtype)
