"""Checks on ``--upstream`` runs before a stage uses them (:func:`check_upstream`); the
error names both sides. Rules: docs/workflow.md, *Upstream runs (--upstream)*.
"""

from __future__ import annotations

from collections.abc import Mapping

from workflow.spec import weight_pickers
from workflow.specfile import STAGE_KEYS, STAGE_SECTIONS, STAGES, ResolvedSpec

__all__ = ["UpstreamMismatch", "DIGEST_TAG", "check_upstream"]

DIGEST_TAG = "dataset_digest"
"""The tag of a stage run holding the digest of the data it was made from
(:func:`workflow.components.dataset_digest`)."""


class UpstreamMismatch(ValueError):
    """An ``--upstream`` run does not exist or was not produced by this spec's stage."""


def _describe(run) -> str:
    tags = run.data.tags
    source = tags.get("spec_source")
    return (f"run {run.info.run_id} (spec {tags.get('spec_name', '?')!r}"
            + (f" from {source}" if source else "") + ")")


NOT_COMPARED = ("spec.partition.sweep.", "spec.train.device", "spec.train.threads", "spec.train.prep_workers",
                "spec.train.pipeline", "spec.train.prefetch", "spec.train.measure_memory")
"""Params an upstream run may differ in: the partition sweep (a report), where it ran and
how fast (the device, threads, the preparation pipeline; the device may change an
``auto`` K, which the update does not depend on) and whether memory was measured: none
changes the trained model beyond floating-point rounding (the device and the thread
count may change the order of a sum; the pipeline and measuring change nothing). Nor are the keys the upstream stage does not read
(:meth:`workflow.specfile.ResolvedSpec.stage_reads`)."""


def _own_section_keys(rspec: ResolvedSpec, stage: str, params: Mapping[str, str]) -> set[str]:
    """Params of ``stage``'s own section that its upstream train run depended on too:
    ``evaluate.select`` (which weights the train run logged) and, when validation picks
    them (:func:`workflow.spec.weight_pickers`), every ``evaluate`` key (how validation
    was scored). ``params``: ``rspec.params()``."""
    if stage != "evaluate":
        return set()
    if weight_pickers(rspec.spec):
        return {k for k in params if k.startswith("spec.evaluate.")}
    return {"spec.evaluate.select"}


def _settings(params: Mapping[str, str], sections: list[str], keys: set[str]) -> dict[str, str]:
    """The ``spec.<section>.*`` params of ``sections`` and the params ``keys``, less
    :data:`NOT_COMPARED`."""
    prefixes = tuple(f"spec.{s}." for s in sections)
    return {k: v for k, v in params.items()
            if (k.startswith(prefixes) or k in keys) and not k.startswith(NOT_COMPARED)}


def check_upstream(rspec: ResolvedSpec, stage: str, upstream: Mapping[str, str]) -> None:
    """Raise :class:`UpstreamMismatch` unless every ``upstream`` run can feed ``stage``
    of ``rspec``: it exists, is a ``FINISHED`` stage run of an earlier stage, and its
    spec params equal ``rspec``'s on the sections and keys that stage depends on
    (:data:`STAGE_SECTIONS`, :data:`STAGE_KEYS`), less the section of ``stage`` itself but
    for the keys the upstream run read from it (:func:`_own_section_keys`) and less
    :data:`NOT_COMPARED` (a model trained on one device may be scored on another), and
    it was made from the dataset's present content (its :data:`DIGEST_TAG`, where it
    has one)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from workflow.components import dataset_digest

    client = MlflowClient()
    params = rspec.params()
    digest = dataset_digest(rspec) if upstream else None
    here = f"spec {rspec.name!r}" + (f" from {rspec.source}" if rspec.source else "")
    earlier = STAGES[: STAGES.index(stage)] if stage in STAGES else STAGES
    for ustage, run_id in upstream.items():
        if ustage not in earlier:
            raise UpstreamMismatch(
                f"--upstream {ustage}={run_id}: the {stage} stage takes runs of "
                f"{', '.join(earlier) or 'no stage'}, not {ustage!r}")
        try:
            run = client.get_run(run_id)
        except MlflowException:
            raise UpstreamMismatch(
                f"--upstream {ustage}={run_id}: no such run in {client.tracking_uri}") from None
        tags = run.data.tags
        what = f"--upstream {ustage}={run_id}: {_describe(run)}"
        if tags.get("run_kind") != "stage" or tags.get("stage") != ustage:
            raise UpstreamMismatch(
                f"{what} is not a {ustage} stage run (run_kind={tags.get('run_kind')!r}, "
                f"stage={tags.get('stage')!r})")
        if run.info.status != "FINISHED":
            raise UpstreamMismatch(f"{what} is {run.info.status}, not FINISHED")
        sections = [s for s in STAGE_SECTIONS[ustage] if s != stage]
        keys = {f"spec.{section}.{key}" for section, names in STAGE_KEYS.get(ustage, {}).items()
                if section != stage for key in names}
        if stage in STAGE_SECTIONS[ustage]:
            keys |= _own_section_keys(rspec, stage, params)
        want, have = _settings(params, sections, keys), _settings(run.data.params, sections, keys)
        read = [{k: v for k, v in side.items() if rspec.stage_reads(ustage, k.removeprefix("spec."), v)}
                for side in (want, have)]
        differ = sorted(k for k in read[0].keys() | read[1].keys() if read[0].get(k) != read[1].get(k))
        if differ:
            shown = "; ".join(f"{k} = {have.get(k, '(unset)')} there, {want.get(k, '(unset)')} here"
                              for k in differ[:3])
            more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
            raise UpstreamMismatch(
                f"{what} was computed from other {ustage} settings than {here}: {shown}{more}; "
                f"run the {ustage} stage for {rspec.name!r} or pass its run")
        if tags.get(DIGEST_TAG, digest) != digest:  # the same settings, other source files
            raise UpstreamMismatch(
                f"{what} was made from other data than {rspec.spec.dataset.name!r} holds now "
                f"(dataset digest {tags[DIGEST_TAG]} there, {digest} here: a source file changed); "
                f"run the {ustage} stage again or pass a run made from the present files")
