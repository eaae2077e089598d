"""betty.plots: figures of epochs, memory per micro-batch and partition sweeps, made
without pyplot (no backend chosen for the caller)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from betty.plots import curves_figure, memory_figure, sweep_figure
from betty.sizes import binary_unit, format_bytes


def test_figures_draw_the_rows_in_their_binary_unit(tmp_path):
    history = [{"epoch": 0, "loss": 1.0, "train_acc": 0.5}, {"epoch": 1, "loss": 0.5, "valid_acc": 0.6}]
    fig = curves_figure(history, "run")
    loss, scores = fig.axes
    assert list(loss.lines[0].get_ydata()) == [1.0, 0.5]
    assert sorted(line.get_label() for line in scores.lines) == ["train_acc", "valid_acc"]
    assert list(scores.lines[1].get_xdata()) == [1]  # valid_acc only where it was scored

    rows = [{"part": 0, "peak_bytes": 3 * 2**20, "estimated_bytes": 2 * 2**20}, {"part": 1, "peak_bytes": 2**20}]
    ax = memory_figure(rows, "m", index_key="part", xlabel="part").axes[0]
    assert [bar.get_height() for bar in ax.patches] == [3.0, 1.0] and ax.get_ylabel() == "peak memory (MiB)"
    assert list(ax.lines[0].get_ydata()) == [2.0, 0.0]

    sweep = [{"method": "reg", "k": 4, "redundancy": 1.4, "peak_bytes": 5 * 2**30},
             {"method": "reg", "k": 2, "redundancy": 1.2, "peak_bytes": None},
             {"method": "random", "k": 2, "redundancy": 1.9, "peak_bytes": 6 * 2**30}]
    fig = sweep_figure(sweep, [("redundancy", "redundancy"), ("peak_bytes", "peak")], "s")
    left, right = fig.axes
    assert [list(line.get_xdata()) for line in left.lines] == [[2, 4], [2]]  # sorted by K, per method
    assert right.get_ylabel() == "peak (GiB)" and list(right.lines[0].get_ydata()) == [5.0]
    fig.savefig(tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_making_figures_leaves_pyplot_and_the_backend_alone(tmp_path):
    code = ("import sys; "
            "from betty.plots import curves_figure; "
            "curves_figure([{'epoch': 0, 'loss': 1.0}]).savefig(sys.argv[1]); "
            "print('matplotlib.pyplot' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "curves.png")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("n, unit, text", [(0, "B", "0 B"), (1023, "B", "1023 B"), (1024, "KiB", "1 KiB"),
                                           (1.5 * 2**30, "GiB", "1.5 GiB"), (3 * 2**40, "TiB", "3 TiB"),
                                           (5 * 2**50, "TiB", "5.12e+03 TiB"), (-2048, "KiB", "-2 KiB")])
def test_binary_unit_and_format_bytes_agree(n, unit, text):
    assert binary_unit(n)[0] == unit and format_bytes(n) == text
