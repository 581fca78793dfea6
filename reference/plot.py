"""Heatmaps of the document's example: scaled scores, masked scores and attention weights.

    python -m reference.plot --out DIR

Writes ``scores.png``, ``masked_scores.png``, ``weights.png`` and ``attention_heatmaps.png`` (all three
side by side).  matplotlib is imported only here, inside :func:`plot_heatmaps`, so the rest of the
reference lab (the audit included) works without it (``pip install .[plot]``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from . import dense
from .example import example_qkv

__all__ = ["plot_heatmaps", "main"]

PANELS = (("scores", "Scaled scores  QK^T / sqrt(d_k)"),
          ("masked_scores", "After causal masking (grey = -inf)"),
          ("weights", "Attention weights (softmax over keys)"))


def _load_matplotlib():
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - exercised only where matplotlib is missing
        raise RuntimeError("reference.plot needs matplotlib: pip install '.[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _draw(ax, matrix: np.ndarray, title: str, decimals: int) -> object:
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")
    image = ax.imshow(np.ma.masked_invalid(matrix), cmap=cmap)
    n_rows, n_cols = matrix.shape
    for i in range(n_rows):
        for j in range(n_cols):
            value = matrix[i, j]
            if np.isneginf(value):
                text, color = "-inf", "black"
            else:  # dark text on the bright end of viridis, white elsewhere
                text, color = f"{value:.{decimals}f}", ("black" if image.norm(value) > 0.6 else "white")
            ax.text(j, i, text, ha="center", va="center", fontsize=10, color=color)
    ax.set_xticks(range(n_cols), [f"key {j}" for j in range(n_cols)])
    ax.set_yticks(range(n_rows), [f"query {i}" for i in range(n_rows)])
    ax.set_title(title, fontsize=10)
    return image


def plot_heatmaps(out_dir) -> list[Path]:
    """Draw the three heatmaps of the example and return the PNG paths written.

    Parameters
    ----------
    out_dir : str or Path
        Created if missing.
    """
    plt = _load_matplotlib()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res = dense.attention(*example_qkv())
    matrices = {"scores": (res.scores, 3), "masked_scores": (res.masked_scores, 3), "weights": (res.weights, 6)}
    written = []
    for name, title in PANELS:
        matrix, decimals = matrices[name]
        fig, ax = plt.subplots(figsize=(4.6, 3.8))
        fig.colorbar(_draw(ax, matrix, title, decimals), ax=ax)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 4.0))
    for ax, (name, title) in zip(axes, PANELS):
        matrix, decimals = matrices[name]
        fig.colorbar(_draw(ax, matrix, title, decimals), ax=ax, shrink=0.8)
    fig.suptitle("3-token causal attention example (rows: queries, columns: keys)")
    fig.tight_layout()
    path = out / "attention_heatmaps.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written


def main(argv=None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m reference.plot", description="Heatmaps of the example.")
    parser.add_argument("--out", default="audit-out/plots", help="directory for the PNG files")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        paths = plot_heatmaps(args.out)
    except RuntimeError as exc:
        print(f"plot: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
