"""Find, read, override, validate and hash a spec (:func:`load_spec`).

Overrides are applied to the raw YAML mapping before validation, so an override is
checked exactly like a key written in the file. Hashes are taken over the *resolved*
spec (:attr:`ResolvedSpec.sha`; :meth:`ResolvedSpec.stage_sha` over only the sections a
stage depends on, so editing ``train.epochs`` does not invalidate the sampled batch).

Rules: docs/workflow.md, *Specs* (references, overrides, content hashes) and
*Validation beyond the schema*.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from workflow.spec import (STORE_KEYS, Problem, Spec, SpecError, changed_keys, check_spec, short_repr, short_text,
                           with_arch_defaults)

__all__ = [
    "STAGES",
    "STAGE_SECTIONS",
    "STAGE_KEYS",
    "MAX_SPEC_BYTES",
    "SpecLoader",
    "parse_yaml",
    "ResolvedSpec",
    "specs_dir",
    "shipped_specs",
    "find_spec",
    "parse_overrides",
    "apply_overrides",
    "resolve_spec",
    "load_spec",
    "content_hash",
    "flatten",
]

STAGES = ("download", "sample", "partition", "train", "evaluate")

STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "download": ("dataset",),
    "sample": ("dataset", "sampling"),
    "partition": ("dataset", "sampling", "model", "partition"),
    "train": ("dataset", "sampling", "model", "partition", "train", "evaluate"),
    "evaluate": ("dataset", "sampling", "model", "partition", "train", "evaluate"),
}
"""Spec sections each stage's output depends on (its reuse key)."""

STAGE_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "sample": {"model": ("arch",)},  # revgnn samples nothing; gcn's blocks carry degrees
    "partition": {"train": ("optimizer", "dtype", "precision", "world_size")},  # estimates, K >= N
}
"""Keys of further sections a stage's output depends on too (in its reuse key)."""

#: keys added after specs were hashed, left out of a resolved spec's content (and so of
#: its hashes and stage keys) while at their defaults: the preparation threads (which
#: never change a result), the sampler's device (``host``) and the DEQ's solver settings.
_UNHASHED_DEFAULTS = (("train", "prep_workers"), ("sampling", "device"), ("model", "deq_max_iter"),
                      ("model", "deq_tol"))

_STORE_PATHS = tuple(f"dataset.{key}" for key in STORE_KEYS)

_SWEEP_ONLY = {"partition": ("sweep",)}  # affects the partition stage's report only

_SPEC_SUFFIXES = (".yaml", ".yml")
MAX_SPEC_BYTES = 1 << 20
"""Largest spec file read (1 MiB; the shipped specs are under 2 KB)."""

_INT = re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+)$")
_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
                        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                        |[-+]?\.(?:inf|Inf|INF)
                        |\.(?:nan|NaN|NAN))$""", re.VERBOSE)


class SpecLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the rules a spec needs:

    * numbers as YAML 1.2 writes them: ``1e-3`` is a float (YAML 1.1 wants ``1.0e-3``),
      ``1:30`` stays a string (YAML 1.1 reads base 60: 90) and so does ``010`` (octal 8);
    * a key given twice in one mapping is an error naming the key and both lines (YAML
      lets the last one win silently);
    * aliases (``*name``) are refused: a few hundred bytes of nested aliases expand to
      billions of nodes.
    """

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers
                if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def compose_node(self, parent, index):  # noqa: ANN001, ANN201 (PyYAML's signature)
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in a spec; write the value out", mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):  # noqa: ANN001, ANN201
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # SafeConstructor reports unhashable keys itself
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {short_repr(key)} (lines {first_line[key]} and {line}); "
                    "give each key once", key_node.start_mark)
            first_line[key] = line
        return super().construct_mapping(node, deep)


SpecLoader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
SpecLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def parse_yaml(text: str):
    """``text`` read with :class:`SpecLoader` (raises ``yaml.YAMLError``)."""
    return yaml.load(text, Loader=SpecLoader)  # noqa: S506 (a SafeLoader subclass)


def specs_dir() -> Path:
    """The shipped specs folder (``$BETTY_SPECS_DIR`` or ``<project>/specs``)."""
    env = os.environ.get("BETTY_SPECS_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "specs"


def shipped_specs() -> list[Path]:
    """The ``*.yaml`` files of :func:`specs_dir`, sorted by name."""
    folder = specs_dir()
    return sorted(p for p in folder.glob("*.yaml") if p.is_file()) if folder.is_dir() else []


def find_spec(ref: str | os.PathLike) -> Path:
    """The spec file ``ref`` names: a path, else a file name or stem in ``./specs``, else
    in :func:`specs_dir`. Only ``.yaml``/``.yml`` files are specs: any other file is
    refused without being read."""
    ref = str(ref)
    if not ref.strip():
        raise SpecError([Problem("spec", ref, "empty spec reference; give a path or a shipped spec name")])
    direct = Path(ref).expanduser()
    if direct.is_file() and _is_spec_file(direct):
        return direct.resolve()
    names = [ref] if ref.endswith(_SPEC_SUFFIXES) else [f"{ref}{suffix}" for suffix in _SPEC_SUFFIXES]
    for folder in (Path.cwd() / "specs", specs_dir()):
        for name in names:
            candidate = folder / name
            if candidate.is_file() and _is_spec_file(candidate):
                return candidate.resolve()
    if direct.is_file():
        raise SpecError([Problem("spec", ref, "is not a spec file; a spec is a .yaml or .yml file "
                                 "(or the name of a shipped spec)")])
    shipped = ", ".join(p.stem for p in shipped_specs()) or "none found"
    raise SpecError([Problem("spec", ref, f"no such spec file; give a path or one of the shipped specs: {shipped}")])


def _is_spec_file(path: Path) -> bool:
    """Whether ``path`` and, for a link, the file it points to end in ``.yaml``/``.yml``."""
    return all(p.suffix.lower() in _SPEC_SUFFIXES for p in (path, path.resolve()))


def _spec_text(path: Path) -> str:
    """The spec file's text: at most :data:`MAX_SPEC_BYTES`, UTF-8, no NUL bytes (errors
    name the file, never its content)."""
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_SPEC_BYTES + 1)
    except OSError as err:
        raise SpecError([Problem("spec", str(path), f"cannot be read: {err.strerror}")]) from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError([Problem("spec", str(path), f"is larger than {MAX_SPEC_BYTES // 2**20} MiB; "
                                 "a spec is a short YAML text file")])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        raise SpecError([Problem("spec", str(path), "is not UTF-8 text; a spec is a YAML text file "
                                 "in UTF-8")])
    return text


def _yaml_problem(err: yaml.YAMLError, where: str) -> Problem:
    """A YAML error as a Problem at ``where`` (plus line and column where known)."""
    mark = getattr(err, "problem_mark", None)
    if mark is not None:
        where = f"{where}:{mark.line + 1}:{mark.column + 1}"
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    detail = f"{context}, {what}" if context else what
    return Problem("spec", where, f"is not valid YAML: {detail}")


def _read_yaml(path: Path) -> dict:
    """The spec file's mapping (read with :class:`SpecLoader`). Errors name the file
    (and for YAML errors the line and column) but never echo its content: an empty file,
    one that is not a mapping, and a mapping without any spec key each get one message."""
    text = _spec_text(path)
    if not text.strip() or all(not line.strip() or line.lstrip().startswith("#") for line in text.splitlines()):
        raise SpecError([Problem("spec", str(path), "spec file is empty")])
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as err:
        raise SpecError([_yaml_problem(err, str(path))]) from None
    except RecursionError:
        raise SpecError([Problem("spec", str(path), "is not valid YAML: nested too deeply")]) from None
    if raw is None:
        raise SpecError([Problem("spec", str(path), "spec file is empty")])
    if not isinstance(raw, dict):
        raise SpecError([Problem("spec", str(path), f"must be a YAML mapping, got {type(raw).__name__}")])
    if not any(key in Spec.model_fields for key in raw):
        raise SpecError([Problem("spec", str(path), "is not a betty spec: none of its top-level keys "
                                 f"is a spec key ({', '.join(Spec.model_fields)})")])
    return raw


_NEXT_ASSIGNMENT = re.compile(r";(?=[\s;]*(?:[A-Za-z_][\w-]*\.)*[A-Za-z_][\w-]*\s*=|[\s;]*$)")
"""A ``;`` that separates assignments: one followed by ``key.path=`` or by nothing."""


def parse_overrides(items: Iterable[str]) -> list[tuple[list[str], Any]]:
    """``["a.b=1", ...]`` as ``[(["a", "b"], 1), ...]``; values parsed as YAML.

    Items may also hold several assignments separated by ``;`` (the form the MLproject
    ``set`` parameter uses): a ``;`` separates only where ``key.path=`` or the end follows
    it, so ``dataset.root=/data/a;b`` keeps its ``;``. Empty items are ignored.
    """
    out = []
    for item in items:
        for part in _NEXT_ASSIGNMENT.split(str(item)):
            part = part.strip()
            if not part:
                continue
            key, sep, text = part.partition("=")
            key = key.strip()
            if not sep or not key:
                raise SpecError([Problem("--set", part, "must look like key.path=value, e.g. train.epochs=3")])
            segments = key.split(".")
            if any(not s for s in segments):
                raise SpecError([Problem("--set", part, f"key path {key!r} has an empty segment")])
            try:
                value = parse_yaml(text) if text.strip() else None
            except yaml.YAMLError as err:
                raise SpecError([Problem(key, text, f"override value is not valid YAML: {err}")]) from None
            except RecursionError:
                raise SpecError([Problem(key, text, "override value is not valid YAML: nested too deeply")]) from None
            out.append((segments, value))
    return out


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """A deep copy of ``raw`` with every override applied in order."""
    data = json.loads(json.dumps(raw, default=str)) if raw else {}
    for segments, value in parse_overrides(overrides):
        node = data
        for depth, seg in enumerate(segments[:-1]):
            child = node.get(seg)
            if child is None:
                child = node[seg] = {}
            if not isinstance(child, dict):
                path = ".".join(segments[: depth + 1])
                raise SpecError([Problem(path, child, f"is not a mapping, so {'.'.join(segments)} cannot be set")])
            node = child
        node[segments[-1]] = value
    return data


def _allowed_keys(loc: Sequence[Any]) -> list[str] | None:
    """Field names of the model at ``loc`` (a pydantic error location), if any."""
    model: type[BaseModel] = Spec
    for part in loc:
        info = model.model_fields.get(part) if isinstance(part, str) else None
        ann = getattr(info, "annotation", None)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return None
    return list(model.model_fields)


def _path(loc: Sequence[Any]) -> str:
    """A pydantic location as a key path (``model.hidden``, ``sampling.fanouts[1]``);
    long keys are cut (:func:`short_repr`)."""
    out = ""
    for part in loc:
        if part == "[key]":  # pydantic's mark of a mapping's key: the path names the key already
            continue
        name = short_text(str(part))
        out += f"[{part}]" if isinstance(part, int) else (f".{name}" if out else name)
    return out


def _problems_from(err: ValidationError) -> list[Problem]:
    out = []
    for e in err.errors():
        loc = e["loc"]
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            out.append(Problem(_path(loc), None, "required key is missing", missing=True))
            continue
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc[:-1])
            msg = "unknown key" + (f"; allowed keys here: {', '.join(allowed)}" if allowed else "")
            out.append(Problem(_path(loc), None, msg, hide_value=True))
            continue
        elif e["type"] == "model_type":
            allowed = _allowed_keys(loc)
            msg = "must be a mapping" + (f" with keys: {', '.join(allowed)}" if allowed else "")
        out.append(Problem(_path(loc), e.get("input"), msg))
    return out


def content_hash(obj: Any) -> str:
    """First 16 hex digits of SHA-256 over ``obj`` as sorted-key compact JSON."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    else:
        out[prefix] = obj
    return out


@dataclass(frozen=True)
class ResolvedSpec:
    """A validated spec.

    Attributes:
        spec: the pydantic model (typed access: ``spec.train.epochs``).
        data: the resolved spec as plain JSON-able data (what ``spec.yaml`` holds).
        source: the file it was read from (``None`` if built from a mapping).
        overrides: the ``key.path=value`` overrides applied.
    """

    spec: Spec
    data: dict
    source: str | None = None
    overrides: tuple[str, ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def content(self) -> dict:
        """``data`` without ``name``, ``description`` and ``experiment`` (labels that do
        not change any result)."""
        return {k: v for k, v in self.data.items() if k not in ("name", "description", "experiment")}

    @property
    def sha(self) -> str:
        """Content hash of the whole resolved spec (``spec_sha``)."""
        return content_hash(self.content)

    @property
    def dataset_options(self) -> dict:
        """The dataset's options, defaults filled in by the data layer (with
        ``feature_dtype`` when it is not float32, see :func:`resolve_spec`)."""
        return {k: v for k, v in self.data["dataset"].items() if k not in ("name", "root", *STORE_KEYS)}

    def stage_content(self, stage: str) -> dict:
        """The parts of the resolved spec ``stage``'s output depends on."""
        if stage not in STAGE_SECTIONS:
            raise ValueError(f"stage must be one of {', '.join(STAGE_SECTIONS)}, got {stage!r}")
        out = {"stage": stage}
        for section in STAGE_SECTIONS[stage]:
            value = self.data[section]
            if stage != "partition" and section in _SWEEP_ONLY:
                value = {k: v for k, v in value.items() if k not in _SWEEP_ONLY[section]}
            out[section] = value
        for section, keys in STAGE_KEYS.get(stage, {}).items():
            out[section] = {k: self.data[section][k] for k in keys if k in self.data[section]}
        return {section: value if section == "stage" else
                {k: v for k, v in value.items() if self.stage_reads(stage, f"{section}.{k}", v)}
                for section, value in out.items()}

    def stage_reads(self, stage: str, path: str, value: Any) -> bool:
        """Whether ``stage``'s output depends on the key ``path`` (``section.key``) being
        ``value``; the keys it does not are left out of its stage key and of the
        ``--upstream`` check of its runs. It does not on ``sampling.fanouts`` for revgnn
        (which samples nothing), nor on how ``train.device`` is spelled (the device it
        resolves to is in the stage's runtime facts, :func:`workflow.reuse.stage_runtime`:
        ``auto`` on a CPU machine is ``cpu``, ``cuda`` is ``cuda:0``), and before ``train``
        not on the ``dataset.store*`` keys (only the trainers hold the graph there) nor on
        ``sampling.device: cpu`` or ``cpu:0`` (the torch-op path on the CPU gives the
        host's batches bit for bit)."""
        if path == "train.device" or (path == "sampling.fanouts" and self.spec.model.arch == "revgnn"):
            return False
        if STAGES.index(stage) >= STAGES.index("train"):
            return True
        return path not in _STORE_PATHS and not (path == "sampling.device" and value in ("cpu", "cpu:0"))

    def stage_sha(self, stage: str, runtime: dict | None = None) -> str:
        """Content hash of :meth:`stage_content` plus ``runtime`` facts that change the
        result (e.g. the resolved device)."""
        return content_hash({**self.stage_content(stage), "runtime": runtime or {}})

    def yaml(self) -> str:
        """The resolved spec as YAML (keys in schema order)."""
        return yaml.safe_dump(self.data, sort_keys=False, default_flow_style=None)

    def params(self) -> dict[str, str]:
        """The flattened resolved spec with a ``spec.`` prefix (MLflow params)."""
        return {f"spec.{k}": json.dumps(v) if isinstance(v, (list, dict)) else str(v)
                for k, v in flatten(self.data).items()}


def resolve_spec(raw: dict, *, source: str | None = None, overrides: Sequence[str] = (),
                 default_name: str | None = None) -> ResolvedSpec:
    """Validate a raw mapping (overrides already applied) into a :class:`ResolvedSpec`.

    Raises:
        SpecError: every problem found, each naming its key path.
    """
    if default_name and "name" not in raw:
        raw = {"name": default_name, **raw}
    try:
        spec = Spec.model_validate(raw)
    except ValidationError as err:
        raise SpecError(_problems_from(err), source) from None
    problems = check_spec(spec)
    if problems:
        raise SpecError(problems, source)
    spec = with_arch_defaults(spec)
    from betty.data.registry import keyed_options, resolve_options

    data = spec.model_dump(mode="json")
    options = resolve_options(spec.dataset.name, {**spec.dataset.options, "feature_dtype": spec.dataset.feature_dtype})
    if "feature_dtype" not in keyed_options(options):  # float32: the hashes specs had before the key
        del options["feature_dtype"]
    data["dataset"] = {"name": spec.dataset.name, "root": spec.dataset.root, **options}
    for key in STORE_KEYS:  # where the graph is held: in the content (and stage keys) once set
        if key in changed_keys(spec.dataset):
            data["dataset"][key] = getattr(spec.dataset, key)
    for section, key in _UNHASHED_DEFAULTS:  # at their defaults: the hashes specs had before the keys
        if data[section][key] == getattr(type(getattr(spec, section)), "model_fields")[key].default:
            del data[section][key]
    data = json.loads(json.dumps(data))  # plain JSON types throughout
    return ResolvedSpec(spec=spec, data=data, source=source, overrides=tuple(overrides))


def load_spec(ref: str | os.PathLike, overrides: Sequence[str] = ()) -> ResolvedSpec:
    """Find (:func:`find_spec`), read, override and validate a spec.

    Raises:
        SpecError: unknown file, invalid YAML, bad override or invalid content.
    """
    path = find_spec(ref)
    raw = apply_overrides(_read_yaml(path), overrides)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", path.stem)[:100]  # a name: letters, digits, _ . -
    return resolve_spec(raw, source=str(path), overrides=overrides,
                        default_name=stem if stem[:1].isalnum() else "spec")
