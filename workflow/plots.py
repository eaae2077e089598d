"""Figures logged as run artifacts (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["curves_figure", "memory_figure", "sweep_figure"]


def _unit(largest: float) -> tuple[str, float]:
    """The binary unit that shows ``largest`` bytes as a number below 1024."""
    for unit, scale in (("GiB", 1024.0**3), ("MiB", 1024.0**2), ("KiB", 1024.0)):
        if largest >= scale:
            return unit, scale
    return "bytes", 1.0


def curves_figure(history: Sequence[Mapping[str, float]], title: str = ""):
    """Loss (left) and accuracy-like metrics (right) against epoch.

    Args:
        history: one mapping per epoch with ``epoch`` and any of ``loss``,
            ``train_acc``, ``valid_acc``, ``train_rocauc``... (missing values skipped).
    """
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.5))
    epochs = [h["epoch"] for h in history]
    ax_loss.plot(epochs, [h.get("loss") for h in history], marker="o")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("training loss")
    names = sorted({k for h in history for k in h if k.endswith(("_acc", "_rocauc"))})
    for name in names:
        points = [(h["epoch"], h[name]) for h in history if h.get(name) is not None]
        if points:
            xs, ys = zip(*points)
            ax_acc.plot(xs, ys, marker="o", label=name)
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("score")
    if names:
        ax_acc.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def memory_figure(rows: Sequence[Mapping[str, float]], title: str = "", *,
                  index_key: str = "micro", xlabel: str = "micro-batch"):
    """Measured (and, when present, estimated) peak memory per micro-batch (or per
    ``revgnn`` part: ``index_key="part"``).

    Args:
        rows: one mapping per micro-batch with ``index_key`` (index), ``peak_bytes`` and
            optionally ``estimated_bytes``; one epoch's micro-batches.
    """
    fig, ax = plt.subplots(figsize=(6, 3.5))
    idx = [r[index_key] for r in rows]
    estimated = [r.get("estimated_bytes") for r in rows]
    largest = max([r.get("peak_bytes") or 0 for r in rows] + [e or 0 for e in estimated])
    unit, scale = _unit(largest)
    ax.bar(idx, [(r.get("peak_bytes") or 0) / scale for r in rows], label="measured", color="tab:blue")
    if any(e is not None for e in estimated):
        ax.plot(idx, [(e or 0) / scale for e in estimated], "o-", color="tab:orange", label="estimated")
    ax.set_xticks(idx)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"peak memory ({unit})")
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    return fig


def sweep_figure(rows: Sequence[Mapping], panels: Sequence[tuple[str, str]], title: str = ""):
    """A partition sweep against K (log scale), one line per method, one panel per
    ``(key, label)`` of ``panels``: e.g. the redundancy of sampled-batch splits, or the
    share of edges RevGNN's cluster parts keep and their largest estimated peak (a key
    ending in ``_bytes`` is drawn in the binary unit that suits it). Rows without a
    panel's value (failed entries) are skipped there."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for ax, (key, label) in zip(axes[0], panels):
        unit, scale = _unit(max([r.get(key) or 0 for r in rows])) if key.endswith("_bytes") else ("", 1.0)
        for method in methods:
            pts = sorted((r["k"], r[key] / scale) for r in rows if r["method"] == method and r.get(key) is not None)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("K")
        ax.set_ylabel(f"{label} ({unit})" if unit else label)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
