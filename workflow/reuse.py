"""When a finished stage run may stand in for running the stage again: the newest
``FINISHED`` stage run whose ``stage``, ``stage_sha``, ``upstream_run_id`` and
``code_version`` tags match (:func:`stage_key`). The pipeline then checks its artifacts
(:func:`workflow.pipeline.run_pipeline`).

Rules: docs/workflow.md, *Reuse* and *Content hashes*.
"""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from workflow.provenance import backend_version, code_version, partitioner_versions
from workflow.specfile import ResolvedSpec, content_hash

__all__ = ["DEVICE_DEPENDENT", "SPLIT_DEPENDENT", "device_identity", "stage_runtime", "stage_key", "find_reusable"]

DEVICE_DEPENDENT = ("partition", "train", "evaluate")  # the memory model's constants, the results
SPLIT_DEPENDENT = ("partition", "train")  # the split: its K search and cut, the model trained on it


def device_identity(device: str) -> str:
    """What of ``device`` a result depends on: ``cpu``, or the kind of GPU (``cuda (NVIDIA
    H100 80GB HBM3)``), whichever index names it (``cuda`` and ``cuda:0`` are one device;
    two GPUs of one kind give the same results, two kinds may not); ``cuda`` where this
    machine has no CUDA to ask."""
    import torch

    where = torch.device(device)
    if where.type != "cuda" or not torch.cuda.is_available():
        return where.type
    index = where.index if where.index is not None else torch.cuda.current_device()
    return f"cuda ({torch.cuda.get_device_name(index)})"


def stage_runtime(stage: str, device: str, rspec: ResolvedSpec) -> dict[str, str]:
    """The runtime facts that enter ``stage``'s ``stage_sha``: for every stage after
    ``download``, the digest of the dataset's content
    (:func:`workflow.components.dataset_digest`: its source files' sizes and times; a file
    replaced under the same spec is new data, and no stage run made from the old data
    stands in for one, also where a stage is given its upstream run or looks it up; the
    download stage is keyed before it fetches the files, which would change its key);
    for ``sample`` with ``sampling.device`` on a GPU, that GPU's kind and torch's version
    (the CUDA generator's numbers for a seed may differ between them); the device
    (:func:`device_identity`) and the GNN framework with its and torch's versions
    (:func:`workflow.provenance.backend_version`: ``model.backend: auto`` is DGL where it
    imports, else PyG, and the two give other estimates, K and floats), for
    :data:`DEVICE_DEPENDENT` stages; and for :data:`SPLIT_DEPENDENT` stages, which size
    the split with the memory model or train on it, a hash of its constants in effect
    there (shipped, or as ``betty calibrate`` left them) and the versions of the
    libraries that cut the split (:func:`workflow.provenance.partitioner_versions`). The
    train stage holds them itself, not only through its upstream partition run: its
    trainer cuts the split it trains on (a revgnn model depends on it), and ``betty
    stage evaluate`` looks up a train run whatever its upstream."""
    if stage == "download":
        return {}
    from workflow.components import dataset_digest

    runtime = {"dataset": dataset_digest(rspec)}
    on = rspec.spec.sampling.device
    if stage == "sample" and on.startswith("cuda"):  # another GPU or torch may draw other numbers
        import torch

        runtime["sampling_device"] = f"{device_identity(on)}, torch {torch.__version__}"
    if stage not in DEVICE_DEPENDENT:
        return runtime
    runtime.update(device=device_identity(device), backend=backend_version(rspec.spec.model.backend))
    if stage not in SPLIT_DEPENDENT:
        return runtime
    from betty.memory.constants import default_backend, load_constants

    return {**runtime, "memory_constants": content_hash(load_constants(default_backend(device)).to_dict()),
            "partitioners": partitioner_versions()}


def stage_key(rspec: ResolvedSpec, stage: str, upstream_run_id: str | None, device: str) -> dict[str, str]:
    """The tags that identify a stage's result (set on its run, matched on reuse)."""
    return {
        "stage": stage,
        "stage_sha": rspec.stage_sha(stage, stage_runtime(stage, device, rspec)),
        "upstream_run_id": upstream_run_id or "none",
        "code_version": code_version(),
    }


def find_reusable(experiment_id: str, key: dict[str, str]) -> str | None:
    """The newest FINISHED stage run in ``experiment_id`` whose tags match ``key``."""
    clauses = [f"tags.{name} = '{value}'" for name, value in key.items()]
    clauses += ["tags.run_kind = 'stage'", "attributes.status = 'FINISHED'"]
    runs = MlflowClient().search_runs([experiment_id], " and ".join(clauses), max_results=1,
                                      order_by=["attributes.start_time DESC"])
    return runs[0].info.run_id if runs else None
