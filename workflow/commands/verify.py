"""``betty verify SPEC --k 2,4,8``: is K-way accumulation exact on this machine?"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from workflow.commands._common import JsonOpt, SetOpt, SpecArg, cli_errors, emit_json, fail, load


def parse_ks(text: str) -> list[int]:
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise fail(f"--k must be a comma-separated list of integers, got {text!r}", 2) from None
    if not ks or any(k < 1 for k in ks):
        raise fail(f"--k values must be integers >= 1, got {text!r}", 2)
    return ks


@cli_errors
def verify(spec: SpecArg,
           k: Annotated[str, typer.Option("--k", help="Comma-separated K values, e.g. 2,4,8.")] = "2,4,8",
           method: Annotated[Optional[str], typer.Option("--method", help="Partition method (default: the spec's).")] = None,
           dtype: Annotated[Optional[str], typer.Option("--dtype", help="float32 or float64 (default: the spec's).")] = None,
           set_: SetOpt = None, json_: JsonOpt = False,
           nproc: Annotated[Optional[int], typer.Option(
               "--nproc", min=1, help="Compare the update of N ranks (torch.distributed, K-way) with "
                                      "the single-process full-batch update; exit 1 beyond tolerance.")] = None) -> None:
    """Compare the K-way accumulated gradient with the full-batch one on the spec's
    first sampled batch (betty.verify.verify_exactness); with ``--nproc N``, the N-rank
    optimizer update of the first epoch with the single-process full-batch one."""
    from betty.verify import verify_exactness

    from workflow.components import load_data, make_trainer, resolve_device, torch_dtype

    ks = parse_ks(k)
    overrides = list(set_ or [])
    if method:
        overrides.append(f"partition.method={method}")
    if dtype:
        overrides.append(f"train.dtype={dtype}")
    rspec = load(spec, overrides)
    if rspec.spec.model.arch == "revgnn":
        raise fail("betty verify checks K-way micro-batch training on a sampled batch (sage, gat); "
                   "model.arch revgnn trains on cluster parts whose dropped edges change the "
                   "model, so K parts equal the full graph only when no edge crosses parts "
                   "(checked by tests/test_rev_engine.py)", 2)
    if nproc is not None:
        _verify_ranks(rspec, ks, nproc, json_)
        return
    ds = load_data(rspec)
    device = resolve_device(rspec.spec.train.device)
    trainer, model, _ = make_trainer(rspec, ds, device)
    batch = trainer.sample(0, 0)
    result = verify_exactness(model, batch, ds.feat, ds.label, ks, method=rspec.spec.partition.method,
                              seed=rspec.spec.sampling.seed, device=device, dtype=torch_dtype(rspec),
                              multilabel=ds.multilabel, graph=ds.graph)
    if json_:
        emit_json(result)
        return
    typer.echo(f"{rspec.name}: method {result['method']}, {result['dtype']}, "
               f"{result['num_outputs']} outputs, full-batch loss {result['loss_full']:.6g}")
    for row in result["results"]:
        typer.echo(f"  K={row['k']:<4} max relative gradient difference {row['max_rel_grad_diff']:.3e}  "
                   f"loss difference {row['loss_diff']:.3e}")


def _verify_ranks(rspec, ks: list[int], nproc: int, json_: bool) -> None:
    from workflow.distributed import verify_distributed

    result = verify_distributed(rspec, ks, nproc)
    if json_:
        emit_json(result)
    else:
        typer.echo(f"{rspec.name}: {nproc} ranks against one process, {result['dtype']}, "
                   f"tolerance {result['tolerance']:.0e}")
        for row in result["results"]:
            typer.echo(f"  K={row['k']:<4} max relative update difference "
                       f"{row['max_rel_update_diff']:.3e}  {'ok' if row['ok'] else 'BEYOND TOLERANCE'}")
    if not result["ok"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
