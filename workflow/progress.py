"""Progress reporting for stages, which talk to a :class:`Reporter` and never print:
silent, plain flushed log lines (:class:`LogReporter`) or a live rich display
(:class:`RichReporter`), chosen by :func:`make_reporter`; numbers by :func:`format_number`.

What is shown: docs/workflow.md, *Progress and numbers*.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

__all__ = ["Reporter", "LogReporter", "RichReporter", "make_reporter", "format_number",
           "format_metrics"]

Advance = Callable[..., None]
"""``advance(n=1, **fields)``: move a progress bar on; ``fields`` (e.g. ``loss=0.3``)
are shown next to it."""


def format_number(value) -> str:
    """A number for a log line: ``10000`` and ``10000.0`` -> ``10,000``; ``12345.678`` ->
    ``12,345.7``; ``0.41234`` -> ``0.4123``; ``2.5e-06`` stays scientific; other
    values as ``str``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (math.isfinite(value) and value.is_integer() and abs(value) < 1e18):
        return f"{int(value):,}"
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.1f}"
    if abs(value) < 1e-4:
        return f"{value:.3g}"
    return f"{value:.4g}" if abs(value) >= 1e-3 else f"{value:.6f}".rstrip("0")


def format_metrics(metrics: dict) -> str:
    """``loss=0.4123 train_acc=0.812 num_nodes=10,000`` (``None`` values left out)."""
    return " ".join(f"{key}={format_number(value)}" for key, value in metrics.items() if value is not None)


def _seconds(s: float) -> str:
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.1f}min"


class Reporter:
    """Interface (and no-op implementation); a context manager around the pipeline."""

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def stage_started(self, stage: str, detail: str = "") -> None:
        """A stage begins (``detail``: e.g. its run ID)."""

    def stage_finished(self, stage: str, status: str, detail: str = "") -> None:
        """A stage ended with ``status`` (FINISHED, FAILED, KILLED, REUSED)."""

    def steps(self, description: str, total: int | None) -> Advance:
        """Start a counted loop (epochs, sweep entries); returns its ``advance``."""
        return lambda n=1, **fields: None

    def note(self, text: str) -> None:
        """A one-line message (e.g. a skipped sweep entry)."""


class LogReporter(Reporter):
    """Plain lines on a stream (stderr by default)."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self._start: dict[str, float] = {}

    def _say(self, text: str) -> None:
        print(f"[betty] {text}", file=self.stream, flush=True)

    def stage_started(self, stage: str, detail: str = "") -> None:
        self._start[stage] = time.perf_counter()
        self._say(f"{stage}: started {detail}".rstrip())

    def stage_finished(self, stage: str, status: str, detail: str = "") -> None:
        start = self._start.pop(stage, None)
        took = f" after {time.perf_counter() - start:.1f}s" if start is not None else ""
        self._say(f"{stage}: {status.lower()}{took} {detail}".rstrip())

    def steps(self, description: str, total: int | None) -> Advance:
        """One line per step: ``description i/total elapsed ... eta ... fields``."""
        state = {"done": 0, "start": time.perf_counter()}

        def advance(n: int = 1, **fields) -> None:
            state["done"] += n
            elapsed = time.perf_counter() - state["start"]
            timing = f"elapsed {_seconds(elapsed)}"
            if total:
                timing += f" eta {_seconds(elapsed / state['done'] * max(total - state['done'], 0))}"
            of = f"/{total}" if total else ""
            self._say(f"{description} {state['done']}{of} {timing} {format_metrics(fields)}".rstrip())

        return advance

    def note(self, text: str) -> None:
        self._say(text)


class RichReporter(Reporter):
    """A live ``rich`` display: a spinner line per stage and a bar per loop.

    Use as a context manager around the pipeline.
    """

    def __init__(self, console=None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.console = console or Console(stderr=True)
        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
            MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
            console=self.console, transient=False,
        )
        self._stage_tasks: dict[str, int] = {}

    def __enter__(self) -> RichReporter:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def stage_started(self, stage: str, detail: str = "") -> None:
        self._stage_tasks[stage] = self.progress.add_task(f"[bold]{stage}[/]", total=None, info=detail)

    def stage_finished(self, stage: str, status: str, detail: str = "") -> None:
        task = self._stage_tasks.get(stage)
        if task is None:
            task = self._stage_tasks[stage] = self.progress.add_task(f"[bold]{stage}[/]", total=None, info="")
        colour = {"FINISHED": "green", "REUSED": "cyan"}.get(status, "red")
        self.progress.update(task, total=1, completed=1, info=f"[{colour}]{status.lower()}[/] {detail}")

    def steps(self, description: str, total: int | None) -> Advance:
        task = self.progress.add_task(f"  {description}", total=total, info="")

        def advance(n: int = 1, **fields) -> None:
            self.progress.update(task, advance=n, info=format_metrics(fields))

        return advance

    def note(self, text: str) -> None:
        self.progress.console.print(f"  {text}")


def make_reporter() -> Reporter:
    """:class:`RichReporter` when stderr is a terminal, else :class:`LogReporter` (plain
    flushed lines). Both are context managers."""
    isatty = getattr(sys.stderr, "isatty", None)
    if isatty is not None and isatty():
        return RichReporter()
    return LogReporter(sys.stderr)
