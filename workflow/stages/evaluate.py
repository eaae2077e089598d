"""Stage ``evaluate``: rebuild each model the ``train`` run lists in ``models.json`` and
score it on the validation and test splits (each repeat's as ``<metric>.repeat<r>``,
their mean and population std as ``<metric>``, ``<metric>_mean``, ``<metric>_std``) (:func:`workflow.evaluation.evaluate_model`: the
spec's options to :func:`betty.evaluation.evaluate_model`).

Metrics and repeats: docs/workflow.md, *Stages* and *Repeats*.
"""

from __future__ import annotations

import json
import pickle
import time

import torch

from betty.fit import summarize_repeats

from workflow.artifacts import write_json
from workflow.checksums import fetch, log_artifact
from workflow.components import build_model
from workflow.evaluation import evaluate_model
from workflow.runs import log_metrics
from workflow.stages.base import StageContext

__all__ = ["UnsafeModelFile", "load_state_dict", "run"]


def _model_file(ctx: StageContext, entry: dict) -> str:
    dst = ctx.workdir / f"model-{entry['repeat']}"
    dst.mkdir(parents=True, exist_ok=True)
    return str(fetch(entry["run_id"], entry["artifact"], dst))


class UnsafeModelFile(RuntimeError):
    """A train run's ``model.pt`` is not a plain state_dict (it would need unpickling
    arbitrary objects, which could run code)."""


def load_state_dict(path: str, run_id: str) -> dict:
    """The state_dict in ``path`` (a train run's ``model.pt``), loaded with
    ``weights_only=True``: tensors and containers only, never arbitrary objects.

    Raises:
        UnsafeModelFile: the file holds anything else (naming the run).
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[-1][:200] if str(err).strip() else ""
        raise UnsafeModelFile(f"model.pt of train run {run_id} is not a plain state_dict of tensors; "
                              f"refusing to load it ({first})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UnsafeModelFile(f"model.pt of train run {run_id} is not a state_dict of tensors")
    return state


def run(ctx: StageContext) -> dict[str, float]:
    models_json = ctx.upstream_file("train", "models.json", required=True)
    entries = json.loads(models_json.read_text())
    ds = ctx.dataset()
    device = ctx.device
    results = []
    advance = ctx.reporter.steps("models", len(entries))
    start = time.perf_counter()
    for entry in entries:
        model = build_model(ctx.rspec, ds, seed=entry.get("train_seed"))
        model.load_state_dict(load_state_dict(_model_file(ctx, entry), entry["run_id"]))
        model = model.to(device)
        scores = evaluate_model(model, ds, ctx.rspec, device, train_k=entry.get("k"))
        results.append({**entry, **scores})
        if len(entries) > 1:  # on this run: a repeat run holds its training, not every later scoring
            log_metrics({f"{key}.repeat{entry['repeat']}": value for key, value in scores.items()})
        advance(1, **scores)
    took = time.perf_counter() - start
    scores = [{k: v for k, v in r.items() if k.endswith(("_acc", "_rocauc"))} for r in results]
    summary = scores[0] if len(scores) == 1 else summarize_repeats(scores)
    log_metrics({**summary, "time_inference_s": took})
    log_artifact(write_json(ctx.workdir / "evaluation.json", {"models": results, "summary": summary}))
    ctx.reporter.note(" ".join(f"{k}={v:.4f}" for k, v in summary.items() if not k.endswith("_mean")))
    return summary
