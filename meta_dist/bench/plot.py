"""``bench train --plot FILE``: each level's memory per rank as stacked bars, the peak beside.

matplotlib comes with the ``bench`` extra only (pip install -e '.[bench]'); nothing else in
meta_dist needs it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

PARTS = (("params", "#4c72b0"), ("grads", "#dd8452"), ("optimizer", "#55a868"),
         ("buffers", "#c44e52"))
MIB = 2**20


def check_plotting(path: str) -> str | None:
    """Return why a plot cannot be written to ``path`` (no matplotlib, no folder), or None.

    Asked before the benchmark runs: a missing folder found only at the end lost the run.
    """
    folder = Path(path).parent
    if not folder.is_dir():
        return (f"--plot: the folder of {path} does not exist ({folder}); create it or "
                "choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"--plot: {folder} is not writable here; choose another path"
    if importlib.util.find_spec("matplotlib") is None:
        return ("--plot needs matplotlib, which comes with the bench extra: "
                "pip install -e '.[bench]'")
    return None


def plot_memory(bars: dict[str, dict[str, float]], path: str, title: str) -> None:
    """Draw ``bars`` as stacked bars and write the figure to ``path``.

    ``bars``: variant -> MiB of params, grads, optimizer, buffers, and the measured ``peak``
    growth, drawn as a marker on its bar.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    names = list(bars)
    figure, axes = plt.subplots(figsize=(1.6 * len(names) + 4.0, 4.2))
    bottoms = [0.0] * len(names)
    for part, colour in PARTS:
        heights = [bars[name][part] for name in names]
        axes.bar(names, heights, bottom=bottoms, color=colour, label=part, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x in range(len(names)):
        axes.text(x, bottoms[x] * 0.98, f"{bottoms[x]:.0f}", ha="center", va="top", fontsize=8,
                  color="white")
    axes.scatter(names, [bars[name]["peak"] for name in names], marker="_", s=900,
                 color="black", zorder=3, label="peak RSS growth (measured)")
    axes.set_ylabel("MiB per rank")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
