"""``betty calibrate [--device D]``: measure the memory model's backend constants here."""

from __future__ import annotations

from typing import Annotated

import typer

from workflow.commands._common import JsonOpt, emit_fields


def calibrate(device: Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:1, ... or auto.")] = "auto",
              write: Annotated[bool, typer.Option("--write/--no-write", help="Save the constants where the estimator reads them.")] = True,
              json_: JsonOpt = False) -> None:
    """Run small workloads under the memory meter on DEVICE and fit the constants the
    memory model cannot derive from shapes (LSTM kernel state, device graph formats)."""
    from betty.memory import calibrate as run_calibration

    from workflow.commands._common import fail
    from workflow.components import resolve_device

    from workflow.spec import check_device

    try:
        check_device(device)  # the rule of train.device: a torch device of a type betty models
        where = resolve_device(device)
    except (ValueError, RuntimeError) as err:  # not such a device, or not on this machine
        raise fail(f"--device {device!r}: {str(err).replace('train.device is', 'it is')}", 2) from None
    emit_fields(run_calibration(where, write=write), json_, width=28)
