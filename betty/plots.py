"""Figures of training and partitioning results: the epochs of :func:`betty.fit.fit`
(:func:`curves_figure`), one epoch's memory per micro-batch (:func:`memory_figure`) and a
partition sweep (:func:`sweep_figure`, ``Trainer.sweep``).

Each returns a ``matplotlib.figure.Figure`` made without pyplot: no display, no global
figure state and no backend chosen for the caller. Save it with ``fig.savefig(path)``
(or ``mlflow.log_figure``); a notebook shows it as the cell's value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from betty.sizes import binary_unit

__all__ = ["curves_figure", "memory_figure", "sweep_figure"]


def _figure(width: float, height: float = 3.5):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def curves_figure(history: Sequence[Mapping[str, float]], title: str = ""):
    """Loss (left) and accuracy-like metrics (right) against epoch.

    Args:
        history: one mapping per epoch with ``epoch`` and any of ``loss``,
            ``train_acc``, ``valid_acc``, ``train_rocauc``... (missing values skipped).
    """
    fig = _figure(9)
    ax_loss, ax_acc = fig.subplots(1, 2)
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
    fig = _figure(6)
    ax = fig.subplots()
    idx = [r[index_key] for r in rows]
    estimated = [r.get("estimated_bytes") for r in rows]
    largest = max([r.get("peak_bytes") or 0 for r in rows] + [e or 0 for e in estimated])
    unit, scale = binary_unit(largest)
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
    fig = _figure(4.5 * len(panels))
    axes = fig.subplots(1, len(panels), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for ax, (key, label) in zip(axes[0], panels):
        unit, scale = binary_unit(max([r.get(key) or 0 for r in rows])) if key.endswith("_bytes") else ("", 1)
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
