"""Training loss per round, the layout of the FedProx paper's Figure 1: one panel per straggler
share, one line per strategy. Drawn on a bare matplotlib `Figure` (no pyplot, no display, no
global backend state; PNG goes through Agg)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

_LINE_STYLES = ("-", "--", ":", "-.")


def plot_losses(
    losses: Mapping[float, Mapping[str, Sequence[float]]], path: str | Path, title: str
) -> None:
    """Write a figure of ``losses[straggler_share][strategy]`` (training loss after rounds
    0..R, nats per sample) to `path`; the file type follows the suffix (png, pdf, svg)."""
    if not losses:
        raise ValueError("nothing to plot")
    figure = Figure(figsize=(4.2 * len(losses), 3.6), layout="constrained")
    axes = figure.subplots(1, len(losses), squeeze=False)[0]
    for ax, (share, by_strategy) in zip(axes, sorted(losses.items()), strict=True):
        for i, (name, values) in enumerate(by_strategy.items()):
            # distinct dashes keep identical curves (FedAvg = FedProx mu=0 at 0 %) both visible
            style = _LINE_STYLES[i % len(_LINE_STYLES)]
            ax.plot(range(len(values)), values, style, label=name, linewidth=1.4)
        ax.set_title(f"{title}, {share:.0%} stragglers")
        ax.set_xlabel("# rounds")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
    axes[0].legend()
    figure.savefig(path, dpi=120)
