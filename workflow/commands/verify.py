"""``betty verify SPEC --k 2,4,8``: is K-way accumulation exact on this machine?

Prints PASS/FAIL per K (K=1 included) against the independent full-batch reference and
exits 1 when any K fails the tolerance, 2 on a usage error. The tolerance is ``--tol``
or by default 1e-10 in float64 and, in float32, scaled to the float32 rounding measured
on the spec's model and batch (:func:`betty.verify.exactness_tolerance`); the output
(and ``tol``/``tol_basis``/``rounding_scale`` in ``--json``) says which and why."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from workflow.commands._common import JsonOpt, SetOpt, SpecArg, check_k_fits, emit_json, fail, load


def parse_ks(text: str) -> list[int]:
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise fail(f"--k must be a comma-separated list of integers, got {text!r}", 2) from None
    if not ks or any(k < 1 for k in ks):
        raise fail(f"--k values must be integers >= 1, got {text!r}", 2)
    return ks


def verify(spec: SpecArg,
           k: Annotated[str, typer.Option("--k", help="Comma-separated K values, e.g. 2,4,8.")] = "2,4,8",
           method: Annotated[Optional[str], typer.Option("--method", help="Partition method (default: the spec's).")] = None,
           dtype: Annotated[Optional[str], typer.Option("--dtype", help="float32 or float64 (default: the spec's).")] = None,
           tol: Annotated[Optional[float], typer.Option(
               "--tol", help="Relative tolerance of the PASS/FAIL verdict (> 0; default 1e-10 "
                             "for float64; for float32 4 x the float32-vs-float64 rounding "
                             "measured on this model and batch, within [1e-5, 1e-3]).")] = None,
           set_: SetOpt = None, json_: JsonOpt = False,
           nproc: Annotated[Optional[int], typer.Option(
               "--nproc", min=1, help="Compare the update of N ranks (torch.distributed, K-way) and the "
                                      "gradients of its step with the single-process full-batch ones; "
                                      "exit 1 beyond --tol.")] = None) -> None:
    """Compare the K-way accumulated gradient (K=1 and each --k) with an independent
    full-batch reference on the spec's first sampled batch (betty.verify.verify_exactness);
    exit 1 when any K differs by more than --tol. With ``--nproc N``: the N-rank optimizer
    update of the first epoch and the gradients of its step against the single-process
    full-batch ones, at the same tolerance."""
    from betty.verify import measured_tolerance, verify_exactness

    from workflow.components import (load_data, make_trainer, resolve_device, spec_precision, torch_dtype,
                                     uses_revgnn)

    ks = parse_ks(k)
    if tol is not None and not tol > 0:
        raise fail(f"--tol must be > 0, got {tol}", 2)
    rspec = load(spec, set_, {"partition.method": method, "train.dtype": dtype})
    if uses_revgnn(rspec):
        raise fail("betty verify checks K-way micro-batch training on a sampled batch (sage, gat, gcn); "
                   "model.arch revgnn trains on cluster parts whose dropped edges change the "
                   "model, so K parts equal the full graph only when no edge crosses parts "
                   "(checked by tests/test_rev_engine.py)", 2)
    ds = load_data(rspec)
    device = resolve_device(rspec.spec.train.device)
    trainer, model, _ = make_trainer(rspec, ds, device)
    check_k_fits(trainer, max(ks), f"--k {k}")
    batch = trainer.sample(0, 0)
    if nproc is not None:
        if tol is None:  # the single-process rule, measured on this model and batch
            tol = measured_tolerance(model, batch, ds.feat, ds.label, torch_dtype(rspec), spec_precision(rspec),
                                     device=device, multilabel=ds.multilabel)[0]
        _verify_ranks(rspec, ds, ks, nproc, json_, tol)
        return
    result = verify_exactness(model, batch, ds.feat, ds.label, ks, method=rspec.spec.partition.method,
                              seed=rspec.spec.sampling.seed, device=device, dtype=torch_dtype(rspec),
                              multilabel=ds.multilabel, graph=ds.graph, tol=tol,
                              precision=spec_precision(rspec))
    if json_:
        emit_json(result)
    else:
        typer.echo(f"{rspec.name}: method {result['method']}, precision {result['precision']}, "
                   f"{result['num_outputs']} outputs, reference full-batch loss "
                   f"{result['loss_full']:.6g}, tolerance {result['tol']:.1e} ({result['tol_basis']})")
        for row in result["results"]:
            typer.echo(f"  K={row['k']:<4} {row['verdict']}  max relative gradient difference "
                       f"{row['max_rel_grad_diff']:.3e}  relative loss difference "
                       f"{row['loss_rel_diff']:.3e}")
        typer.echo(result["verdict"])
    if not result["passed"]:
        failed = [row["k"] for row in result["results"] if not row["passed"]]
        raise fail(f"K-way gradients differ from the full-batch reference by more than "
                   f"{result['tol']:.1e} for K in {failed}", 1)


def fresh_trainer(rspec, shared) -> tuple:
    """``(trainer, model)`` of the spec on the CPU over the launcher's ``shared`` dataset
    (mapped, not loaded again), the same seeds at every call (each rank of
    :func:`betty.distributed.verify.verify_ranks` builds one per K)."""
    import torch

    from workflow.components import configure_threads, make_trainer

    dataset = shared.attach()
    configure_threads(rspec, dataset.num_edges)
    trainer, model, _ = make_trainer(rspec, dataset, torch.device("cpu"))
    return trainer, model


def _verify_ranks(rspec, dataset, ks: list[int], nproc: int, json_: bool, tol: float) -> None:
    from functools import partial

    from betty.distributed.shared import share_dataset
    from betty.distributed.verify import verify_ranks

    from workflow.components import spec_threads

    with share_dataset(dataset) as shared:  # loaded once, here: the ranks map its tensors
        threads = spec_threads(rspec, dataset.num_edges, ranks=nproc) or 1
        result = {"dtype": rspec.spec.train.dtype, "precision": rspec.spec.train.precision,
                  **verify_ranks(partial(fresh_trainer, rspec, shared), ks, nproc, tol=tol, threads=threads)}
    if json_:
        emit_json(result)
    else:
        typer.echo(f"{rspec.name}: {nproc} ranks against one process, {result['dtype']}, "
                   f"tolerance {result['tolerance']:.0e}")
        for row in result["results"]:
            typer.echo(f"  K={row['k']:<4} {'PASS' if row['ok'] else 'FAIL'}  max relative update difference "
                       f"{row['max_rel_update_diff']:.3e}  gradient difference {row['max_rel_grad_diff']:.3e}"
                       f"{'' if row['ok'] else '  BEYOND TOLERANCE'}")
        typer.echo("PASS" if result["ok"] else "FAIL")
    if not result["ok"]:
        raise typer.Exit(1)
