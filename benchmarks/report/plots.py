"""The plots of docs/benchmarks.md (docs/img/*.png) and the memory table."""
from __future__ import annotations

from pathlib import Path

from .results import GRID_IMPLS, IMG, LABELS, TARGET_BW, TARGET_COMPUTE, Results, fmt_bytes, shape_key, split_label, table


def plots(res: Results, gens: dict, memory_rows, IMG: Path = IMG) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    made = []
    steps = res.steps("step ")
    styles = {"engine_step": ("C0", "o", "-"), "engine_kernel": ("C0", "x", ":"), "numpy_contiguous": ("C1", "s", "-"),
              "torch_sdpa": ("C2", "^", "-"), "naive_concat": ("C3", "v", "-")}

    # 1. latency vs context, one panel per (kv heads, dtype)
    panels = sorted({(split_label(s)["attention"], split_label(s)["heads"], split_label(s)["dtype"]) for s, _ in steps},
                    key=lambda p: ({"MHA": 0, "GQA": 1, "MQA": 2}[p[0]], p[2] != "fp32"))
    if panels:
        fig, axes = plt.subplots(len(panels) // 2 or 1, 2, figsize=(11, 3.4 * max(1, len(panels) // 2)), squeeze=False)
        for ax, (att, heads, dt) in zip(axes.flat, panels):
            for impl in GRID_IMPLS:
                pts = sorted((split_label(s)["context"], r["median"]) for (s, i), r in steps.items()
                             if i == impl and s.startswith(f"{att}-{heads}-") and s.endswith(dt) and r["median"])
                if pts:
                    c, mk, ls = styles[impl]
                    ax.loglog(*zip(*pts), marker=mk, color=c, linestyle=ls, label=LABELS[impl])
            roof = sorted((split_label(s)["context"], res.metrics(r)["roof"] * r["median"]) for (s, i), r in steps.items()
                          if i == "engine_step" and s.startswith(f"{att}-{heads}-") and s.endswith(dt) and r["median"])
            if roof:
                ax.loglog(*zip(*roof), color="k", linestyle="--", linewidth=1, label="roofline bound")
            ax.set_title(f"{att} {heads} {dt}")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("time per step and layer (s)")
            ax.grid(True, which="both", alpha=0.3)
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(IMG / "step_latency.png", dpi=110)
        plt.close(fig)
        made.append("step_latency.png")

    # 2. fraction of bandwidth / FLOP rate / roofline per shape (engine step)
    shapes = sorted({s for s, i in steps if i == "engine_step" and steps[(s, i)]["median"]}, key=shape_key)
    if shapes:
        ms = [res.metrics(steps[(s, "engine_step")]) for s in shapes]
        mk = [res.metrics(steps[(s, "engine_kernel")]) if (s, "engine_kernel") in steps else {} for s in shapes]
        fig, ax = plt.subplots(figsize=(12, 4.2))
        x = range(len(shapes))
        w = 0.27
        ax.bar([i - w for i in x], [m["frac_bw"] for m in ms], w, label="fraction of read bandwidth")
        ax.bar(list(x), [m["frac_mm"] for m in ms], w, label="fraction of matmul FLOP rate")
        ax.bar([i + w for i in x], [m["roof"] for m in ms], w, label="fraction of roofline (step)")
        ax.scatter(list(x), [m.get("roof", float("nan")) for m in mk], color="k", marker="x", zorder=3,
                   label="fraction of roofline (kernel alone)")
        ax.axhline(TARGET_BW, color="C2", linestyle="--", linewidth=1, label="90% target (bandwidth-bound)")
        ax.axhline(TARGET_COMPUTE, color="C3", linestyle=":", linewidth=1, label="50% target (compute-bound)")
        ax.set_xticks(list(x))
        ax.set_xticklabels([s.replace("-q32", "\nq32").replace("-n", "\nn") for s in shapes], fontsize=6)
        ax.set_ylabel("fraction of the ceiling probed before the shape")
        ax.legend(fontsize=7, ncol=3)
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(IMG / "roofline_fractions.png", dpi=110)
        plt.close(fig)
        made.append("roofline_fractions.png")

    # 3. generation: total time, peak memory, per-window copies
    if gens:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        names = [k for k in ("naive", "engine") if k in gens]
        axes[0].bar(names, [gens[k]["extra"]["total_s"] for k in names], color=["C3", "C0"][:len(names)])
        axes[0].set_ylabel("seconds for the whole generation")
        axes[0].set_title(f"{gens[names[0]]['extra']['tokens']} tokens, one step each")
        axes[1].bar(names, [gens[k]["extra"]["peak_rss_growth_bytes"] / 2**20 for k in names],
                    color=["C3", "C0"][:len(names)], label="peak RSS - RSS before")
        axes[1].axhline(gens[names[0]]["extra"]["final_cache_bytes"] / 2**20, color="k", linestyle="--",
                        label="final K/V bytes")
        axes[1].set_ylabel("MiB")
        axes[1].set_title("peak memory growth")
        axes[1].legend(fontsize=7)
        for k in names:
            wins = gens[k]["extra"]["windows"]
            axes[2].plot([w["end_token"] for w in wins], [w["seconds"] for w in wins], marker="o",
                         color="C3" if k == "naive" else "C0", label=f"{k}: time per window")
        if "naive" in gens:
            ax2 = axes[2].twinx()
            wins = gens["naive"]["extra"]["windows"]
            ax2.plot([w["end_token"] for w in wins], [w["bytes_copied"] / 2**30 for w in wins], color="C3",
                     linestyle="--", label="naive: GiB copied per window")
            ax2.set_ylabel("GiB copied per window")
            ax2.legend(fontsize=7, loc="center left")
        axes[2].set_xlabel("tokens generated")
        axes[2].set_ylabel("seconds per window")
        axes[2].legend(fontsize=7, loc="upper left")
        axes[2].set_title("O(T²) copying of the naive cache")
        fig.tight_layout()
        fig.savefig(IMG / "generation.png", dpi=110)
        plt.close(fig)
        made.append("generation.png")

    # 4. memory: formula vs measured
    if memory_rows:
        labels, series = memory_series(memory_rows)
        if labels and series:
            fig, ax = plt.subplots(figsize=(8, 3.8))
            w = 0.8 / len(series)
            for j, (name, vals) in enumerate(series.items()):
                ax.bar([i + (j - (len(series) - 1) / 2) * w for i in range(len(labels))],
                       [v / 2**30 if v is not None else 0 for v in vals], w, label=name)
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, fontsize=8)
            ax.set_ylabel("GiB")
            ax.set_title("KV cache memory: formula vs measured")
            ax.legend(fontsize=7)
            ax.grid(True, axis="y", alpha=0.3)
            fig.tight_layout()
            fig.savefig(IMG / "memory.png", dpi=110)
            plt.close(fig)
            made.append("memory.png")
    made += walk_plot(res, plt, IMG) + int8_plot(res, plt, IMG)
    return made


def walk_plot(res: Results, plt, IMG: Path) -> list[str]:
    """Decode step as a fraction of the page-walk ceiling measured in alternation, page 16 and 64."""
    rows = {(r["extra"]["shape"], r["extra"]["page_size"]): r for r in res.rows if r["group"].startswith("walk step ")}
    shapes = sorted({s for s, _ in rows}, key=shape_key)
    if not shapes:
        return []
    fig, ax = plt.subplots(figsize=(10, 3.8))
    w = 0.38
    for j, page in enumerate((16, 64)):
        vals = [(rows.get((s, page)) or {}).get("extra", {}).get("frac_walk", 0) for s in shapes]
        ax.bar([i + (j - 0.5) * w for i in range(len(shapes))], vals, w, label=f"page {page}")
    ax.axhline(0.90, color="k", linestyle="--", linewidth=1, label="target 90%")
    ticks = [s.replace("-q32", "\nq32").replace("-n", "\nn") for s in shapes]
    return _finish_bars(plt, fig, ax, ticks, "fraction of the page-walk ceiling", IMG / "walk_fractions.png")


def int8_plot(res: Results, plt, IMG: Path) -> list[str]:
    """int8 step speed-up over float16 and float32 per shape and page size, with the issue's targets."""
    rows = [r for r in res.rows if r["group"].startswith("int8 ") and "median_s_int8" in r["extra"]]
    if not rows:
        return []
    labels = [f"{r['extra']['attention']} {r['extra']['context']}\nP{r['extra']['page_size']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    w = 0.38
    x = range(len(rows))
    ax.bar([i - w / 2 for i in x], [r["extra"]["speedup_vs_float16"] for r in rows], w, label="vs float16")
    ax.bar([i + w / 2 for i in x], [r["extra"]["speedup_vs_float32"] for r in rows], w, label="vs float32")
    targets = {"MHA": 1.7, "GQA": 1.35, "MQA": 1 / 1.1}
    ax.scatter([i - w / 2 for i in x], [targets.get(r["extra"]["attention"], 0) for r in rows], color="k", marker="_",
               s=200, zorder=3, label="target vs float16")
    return _finish_bars(plt, fig, ax, labels, "int8 speed-up (median step)", IMG / "int8_speedup.png")


def _finish_bars(plt, fig, ax, ticks: list, ylabel: str, path: Path) -> list[str]:
    """Tick labels, axis label, legend and grid of a bar chart; saved to ``path`` and closed."""
    ax.set_xticks(range(len(ticks)))
    ax.set_xticklabels(ticks, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path.name]


def memory_series(rows) -> tuple[list, dict]:
    """Rows of `kvengine memory --json` (a list of dicts, or {"rows": [...]}) -> labels and the byte columns."""
    if isinstance(rows, dict):
        rows = rows.get("rows") or next((v for v in rows.values() if isinstance(v, list)), [])
    rows = [r for r in rows if isinstance(r, dict)]
    if not rows:
        return [], {}
    label_keys = [k for k in ("config", "attention", "name", "kind", "label") if k in rows[0]]
    labels = []
    for r in rows:
        lab = str(r[label_keys[0]]) if label_keys else ""
        if "kv_heads" in r:
            lab += f" ({r['kv_heads']} kv)" if lab else f"{r['kv_heads']} kv heads"
        if len({x.get("dtype") for x in rows}) > 1:          # several storage dtypes (float16 and int8 rows)
            lab += f" {r.get('dtype')}"
        labels.append(lab)
    preferred = ["formula_bytes", "allocated_bytes", "rss_touched_bytes", "pool_resident_bytes", "naive_peak_bytes"]
    cols = [k for k in preferred if k in rows[0]]
    if len(cols) < 2:
        cols = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                and ("bytes" in k) and any(w in k for w in ("formula", "measured", "allocated", "used", "rss", "peak"))]
    return labels, {c: [r.get(c) for r in rows] for c in cols}


def memory_table(memory_rows) -> str:
    labels, series = memory_series(memory_rows)
    if not labels:
        return ""
    rows = [[lab, *(fmt_bytes(series[c][i]) for c in series)] for i, lab in enumerate(labels)]
    return table(["config", *series], rows)

