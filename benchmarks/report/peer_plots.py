"""docs/img/vllm_peer_decode.png and vllm_peer_prefill.png: peer time ÷ engine time per shape and dtype (log
axis), the parity band shaded, from the merged rows of `peer_sections.merged`."""
from __future__ import annotations

from pathlib import Path

from .peer_sections import DTYPES, IMAGES, PARITY, cell, sorted_cells

COLORS = {"float32": "C0", "float16": "C1", "bfloat16": "C2"}
TICKS = (0.1, 0.2, 0.3, 0.5, 0.8, 1, 1.25, 2, 3, 5, 8, 10, 20, 30, 50)


def ratio_panel(ax, rows: list[dict], key: str, title: str) -> None:
    """One marker per (cell, dtype) at ``key`` (a ratio), cells along x, the parity band and 1 drawn."""
    from matplotlib import ticker

    labels = list(dict.fromkeys(cell(r) for r in rows))
    ax.set_ylim(min(0.5, *(0.9 * r[key] for r in rows if key in r)), max(2.0, *(1.1 * r[key] for r in rows if key in r)))
    for j, d in enumerate(DTYPES):
        pts = [(labels.index(cell(r)) + (j - 1) * 0.18, r[key]) for r in rows if r["dtype"] == d and key in r]
        if pts:
            ax.scatter(*zip(*pts), color=COLORS[d], label=d, zorder=3, s=28)
    ax.axhspan(*PARITY, color="0.85", zorder=0, label=f"parity {PARITY[0]}-{PARITY[1]}")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ax.set_yticks([t for t in TICKS if lo <= t <= hi])
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("peer ÷ engine time (> 1: engine faster)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)


def peer_plots(rows: list[dict], img: Path) -> list[str]:
    """Write the two images where their rows exist; returns the names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    made = []
    decode = sorted_cells(rows, "decode") + sorted_cells(rows, "batch")
    if decode:
        fig, ax = plt.subplots(figsize=(12, 4.4))
        ratio_panel(ax, decode, "vllm_over_engine", "decode step and batched decode: vLLM CPU ÷ engine (median)")
        made += save(plt, fig, img / IMAGES["decode"])
    prefill = sorted_cells(rows, "prefill")
    if prefill:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
        ratio_panel(axes[0], prefill, "vllm_over_engine", "prefill / extend: vLLM CPU ÷ engine")
        ratio_panel(axes[1], prefill, "sdpa_over_engine", "prefill / extend: torch SDPA ÷ engine")
        made += save(plt, fig, img / IMAGES["prefill"])
    return made


def save(plt, fig, path: Path) -> list[str]:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path.name]
