"""Progress reporting for stages: silent, plain log lines, or a live rich display.

Stages talk to a :class:`Reporter`; they never print. ``betty run`` uses
:class:`RichReporter` (one line per stage, a bar per epoch loop), MLproject entry points
use :class:`LogReporter` (lines on stderr, readable in ``mlflow run`` output and CI logs).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

__all__ = ["Reporter", "NullReporter", "LogReporter", "RichReporter", "format_metrics"]

Advance = Callable[..., None]
"""``advance(n=1, **fields)``: move a progress bar on; ``fields`` (e.g. ``loss=0.3``)
are shown next to it."""


def format_metrics(metrics: dict, keys: tuple[str, ...] | None = None) -> str:
    """``loss=0.4123 train_acc=0.8120`` (the given keys, those present)."""
    items = metrics.items() if keys is None else ((k, metrics[k]) for k in keys if k in metrics)
    parts = []
    for key, value in items:
        if value is None:
            continue
        parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)


class Reporter:
    """Interface (and no-op implementation)."""

    def stage_started(self, stage: str, detail: str = "") -> None:
        """A stage begins (``detail``: e.g. its run ID)."""

    def stage_finished(self, stage: str, status: str, detail: str = "") -> None:
        """A stage ended with ``status`` (FINISHED, FAILED, KILLED, REUSED)."""

    def steps(self, description: str, total: int | None) -> Advance:
        """Start a counted loop (epochs, sweep entries); returns its ``advance``."""
        return lambda n=1, **fields: None

    def note(self, text: str) -> None:
        """A one-line message (e.g. a skipped sweep entry)."""


NullReporter = Reporter


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
        """Prints after each step when there are few (epochs), else about every 10%."""
        state = {"done": 0}
        every = 1 if not total or total <= 20 else max(1, total // 10)

        def advance(n: int = 1, **fields) -> None:
            before = state["done"]
            state["done"] += n
            if state["done"] // every == before // every and state["done"] != total:
                return
            of = f"/{total}" if total else ""
            self._say(f"{description} {state['done']}{of} {format_metrics(fields)}".rstrip())

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
