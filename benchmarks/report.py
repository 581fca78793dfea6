"""Turn a saved pytest-benchmark JSON into docs/benchmarks.md (tables, target verdicts) and docs/img/*.png.

    python -m benchmarks.report --run                  # run the full suite (~10 min), save the JSON, render
    python -m benchmarks.report RESULTS.json           # render from a saved run
    python -m benchmarks.report RESULTS.json --memory-json MEM.json   # + formula vs measured memory plot
    python -m benchmarks.report --run --memory         # ... and run `python -m decode.cli memory --json` too
    python -m benchmarks.report --run -- -k MQA        # after --: extra pytest arguments

The JSON of the run the committed document shows is benchmarks/results/full-run.json. Hand-written notes in
docs/benchmarks.md between ``<!-- notes:begin -->`` and ``<!-- notes:end -->`` survive a re-render.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
RESULTS = ROOT / "benchmarks" / "results" / "full-run.json"
MEMORY = ROOT / "benchmarks" / "results" / "memory.json"

GRID_IMPLS = ["engine_step", "engine_kernel", "numpy_contiguous", "torch_sdpa", "naive_concat"]
TINY_IMPLS = ["engine_step", "engine_kernel", "numpy_contiguous", "torch_sdpa", "torch_sdpa_bare", "naive_concat"]
LABELS = {"engine_step": "engine Decoder.step", "engine_kernel": "engine kernel wrapper",
          "numpy_contiguous": "NumPy contiguous", "torch_sdpa": "torch SDPA", "torch_sdpa_bare": "torch SDPA (bare)",
          "naive_concat": "naive concat"}
DISTURBED_CORES = 0.2
TARGET_BW, TARGET_COMPUTE, TARGET_FP16, TARGET_TINY_S, TARGET_FIRST_S = 0.90, 0.50, 1.6, 15e-6, 0.5
NOTES_BEGIN, NOTES_END = "<!-- notes:begin -->", "<!-- notes:end -->"


# ----------------------------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------------------------
class Results:
    def __init__(self, raw: dict):
        self.raw = raw
        self.meta = raw.get("pagedkv", {})
        self.machine = raw.get("machine_info", {})
        self.rows = []
        for b in raw.get("benchmarks", []):
            stats = b.get("stats") or {}
            self.rows.append({"name": b.get("name"), "group": b.get("group") or "", "extra": b.get("extra_info", {}),
                              "median": stats.get("median"), "min": stats.get("min"), "rounds": stats.get("rounds"),
                              "iqr": stats.get("iqr")})
        start = self.meta.get("ceilings_start") or {}
        self.read_bw = start.get("read_bw") or _first(r["extra"].get("read_bw") for r in self.rows)
        self.matmul_rate = start.get("matmul_rate") or _first(r["extra"].get("matmul_rate") for r in self.rows)

    # grid and tiny: {(shape label, impl): row}
    def steps(self, prefix: str) -> dict:
        out = {}
        for r in self.rows:
            if r["group"].startswith(prefix) and "shape" in r["extra"]:
                out[(r["extra"]["shape"], r["extra"]["impl"])] = r
        return out

    def op_rows(self, op: str) -> list:
        return [r for r in self.rows if r["extra"].get("op") == op]

    def by_impl(self, impl: str) -> list:
        return [r for r in self.rows if r["extra"].get("impl") == impl]

    def metrics(self, row: dict, stat: str = "median") -> dict:
        """Rates and fractions of ``row``'s median (or min) against the ceilings probed for its group (the
        session's where the row has none)."""
        e = row["extra"]
        t = row[stat]
        if not t:
            return {}
        bw, mm = e.get("read_bw") or self.read_bw, e.get("matmul_rate") or self.matmul_rate
        bound = max(e["kv_bytes"] / bw, e["flops"] / mm)
        return {"t": t, "gbs": e["kv_bytes"] / t / 1e9, "gflops": e["flops"] / t / 1e9, "read_bw": bw,
                "matmul_rate": mm, "frac_bw": e["kv_bytes"] / t / bw, "frac_mm": e["flops"] / t / mm,
                "bound": "bandwidth" if e["kv_bytes"] / bw >= e["flops"] / mm else "compute", "roof": bound / t}


def _first(it):
    for x in it:
        if x:
            return x
    return None


def shape_key(label: str):
    """Sort MHA, GQA, MQA; then context; fp32 before fp16."""
    att, heads, n, dt = label.split("-")
    return ({"MHA": 0, "GQA": 1, "MQA": 2}.get(att, 3), int(n[1:]), dt != "fp32")


def split_label(label: str) -> dict:
    att, heads, n, dt = label.split("-")
    return {"attention": att, "heads": heads, "context": int(n[1:]), "dtype": dt}


# ----------------------------------------------------------------------------------------------------------------
# formatting
# ----------------------------------------------------------------------------------------------------------------
def fmt_time(t) -> str:
    if t is None or (isinstance(t, float) and math.isnan(t)):
        return "—"
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} µs"


def fmt_bytes(n) -> str:
    if n is None:
        return "—"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def pct(x) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def ratio(a, b) -> str:
    return "—" if not a or not b else f"{a / b:.2f}x"


def mark(row) -> str:
    """† after a time measured while other processes used > DISTURBED_CORES cores (even after the re-runs)."""
    return " †" if row and row["extra"].get("disturbed") else ""


def table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(ok) -> str:
    return "—" if ok is None else ("**met**" if ok else "**not met**")


# ----------------------------------------------------------------------------------------------------------------
# sections
# ----------------------------------------------------------------------------------------------------------------
def machine_section(res: Results) -> str:
    m, cpu, v = res.meta, res.meta.get("cpu", {}), res.meta.get("versions", {})
    start, end = m.get("ceilings_start", {}), m.get("ceilings_end", {})
    rows = [
        ("date", m.get("date", res.raw.get("datetime", "?"))),
        ("CPU", f"{cpu.get('model', res.machine.get('cpu', {}).get('brand_raw', '?'))}, {cpu.get('cpus', '?')} "
                f"logical CPUs, L2 {cpu.get('L2', '?')} (per core), L3 {cpu.get('L3', '?')}, "
                f"{cpu.get('memory_gib', '?')} GiB RAM"),
        ("software", ", ".join(f"{k} {val}" for k, val in v.items())),
        ("read bandwidth (numba prange sum, 1 GiB, 2 threads, median of 7)",
         f"{start.get('read_bw', 0) / 1e9:.1f} GB/s at the start" +
         (f", {end.get('read_bw', 0) / 1e9:.1f} GB/s at the end" if end else "")),
        ("float32 matmul (numpy 2048³, median of 5)",
         f"{start.get('matmul_rate', 0) / 1e9:.0f} GFLOP/s at the start" +
         (f", {end.get('matmul_rate', 0) / 1e9:.0f} GFLOP/s at the end" if end else "")),
        ("load average (1, 5, 15 min) at the start / end",
         ", ".join(f"{x:.2f}" for x in (start.get("loadavg") or [])) + " / " +
         ", ".join(f"{x:.2f}" for x in (m.get("loadavg_end") or []))),
        ("suite knobs", f"pages of {m.get('page_size', '?')} tokens; cold working set ≥ "
                        f"{fmt_bytes(m.get('cold_bytes'))} of K/V per shape; quick={m.get('quick')}"),
    ]
    return table(["", ""], rows)


def grid_section(res: Results) -> tuple[str, list]:
    steps = res.steps("step ")
    shapes = sorted({s for s, _ in steps}, key=shape_key)
    rows, verdicts = [], []
    for s in shapes:
        get = lambda impl: steps.get((s, impl))          # noqa: E731
        eng = get("engine_step")
        if eng is None:
            continue
        m = res.metrics(eng)
        mbest = res.metrics(eng, "min")
        t = {impl: (get(impl) or {}).get("median") for impl in GRID_IMPLS}
        kern = get("engine_kernel")
        mk = res.metrics(kern) if kern else {}
        rows.append([s, m["bound"], eng["extra"].get("layers"), f"{m['read_bw'] / 1e9:.0f} / {m['matmul_rate'] / 1e9:.0f}",
                     *(fmt_time(t[i]) + mark(get(i)) for i in GRID_IMPLS),
                     f"{m['gbs']:.1f}", pct(m["frac_bw"]), pct(m["frac_mm"]), pct(m["roof"]), pct(mbest["roof"]),
                     pct(mk.get("roof")),
                     ratio(t["numpy_contiguous"], t["engine_step"]), ratio(t["torch_sdpa"], t["engine_step"]),
                     ratio(t["naive_concat"], t["engine_step"])])
        verdicts.append((s, m, t))
    header = ["shape", "bound", "layers", "probe GB/s / GFLOP/s", *(LABELS[i] for i in GRID_IMPLS), "engine GB/s", "% read bw",
              "% matmul", "% roofline (step)", "% roofline (step, fastest round)", "% roofline (kernel)", "vs NumPy", "vs torch", "vs naive"]
    return table(header, rows), verdicts


def targets_section(res: Results, verdicts: list) -> tuple[str, list]:
    """The decode targets of issue 5, one verdict each."""
    lines, unmet = [], []
    # roofline
    roof_rows = []
    for s, m, _ in verdicts:
        info = split_label(s)
        if m["bound"] == "bandwidth":
            target = TARGET_BW
            in_scope = info["attention"] in ("MHA", "GQA") and info["context"] >= 4096
        else:
            target = TARGET_COMPUTE
            in_scope = True
        ok = m["roof"] >= target
        roof_rows.append([s, m["bound"], pct(target), pct(m["roof"]), verdict(ok) if in_scope else f"({verdict(ok)[2:-2]}, short context)"])
        if in_scope and not ok:
            unmet.append(f"roofline {s}: {pct(m['roof'])} < {pct(target)}")
    lines.append(table(["shape", "bound", "target", "engine step", "verdict"], roof_rows))

    faster = []
    for s, m, t in verdicts:
        for impl in ("numpy_contiguous", "torch_sdpa"):
            if t.get(impl) and t["engine_step"]:
                ok = t[impl] > t["engine_step"]
                faster.append([s, LABELS[impl], fmt_time(t[impl]), fmt_time(t["engine_step"]),
                               ratio(t[impl], t["engine_step"]), verdict(ok)])
                if not ok:
                    unmet.append(f"faster than {LABELS[impl]} at {s}: {ratio(t[impl], t['engine_step'])}")
    return "\n".join(lines), unmet, faster


def fp16_section(res: Results) -> tuple[str, list]:
    steps = res.steps("step ")
    rows, unmet = [], []
    labels = sorted({s for s, _ in steps if s.endswith("fp32")}, key=shape_key)
    for s32 in labels:
        s16 = s32[:-4] + "fp16"
        a, b = steps.get((s32, "engine_step")), steps.get((s16, "engine_step"))
        if not a or not b:
            continue
        r = a["median"] / b["median"]
        is_target = s32.startswith("MHA") and split_label(s32)["context"] >= 32768
        rows.append([s32[:-5], fmt_time(a["median"]), fmt_time(b["median"]), f"{r:.2f}x",
                     verdict(r >= TARGET_FP16) if is_target else ""])
        if is_target and r < TARGET_FP16:
            unmet.append(f"float16 vs float32 at {s32[:-5]}: {r:.2f}x < {TARGET_FP16}x")
    return table(["shape", "float32 step", "float16 step", "speed-up", "target ≥ 1.6x (32768 MHA)"], rows), unmet


def tiny_section(res: Results) -> tuple[str, list]:
    steps = res.steps("tiny ")
    shapes = sorted({s for s, _ in steps}, key=lambda s: split_label(s)["context"])
    rows, unmet = [], []
    for s in shapes:
        t = {impl: (steps.get((s, impl)) or {}).get("median") for impl in TINY_IMPLS}
        n = split_label(s)["context"]
        ok = None
        if n <= 16 and t["engine_step"]:
            ok = t["engine_step"] < TARGET_TINY_S and (t["torch_sdpa_bare"] is None or t["engine_step"] < t["torch_sdpa_bare"])
            if not ok:
                unmet.append(f"tiny step at {n} tokens: {fmt_time(t['engine_step'])} (torch bare "
                             f"{fmt_time(t['torch_sdpa_bare'])})")
        rows.append([n, *(fmt_time(t[i]) + mark(steps.get((s, i))) for i in TINY_IMPLS),
                     verdict(ok) if ok is not None else ""])
    header = ["tokens", *(LABELS[i] for i in TINY_IMPLS), "target: step < 15 µs and < bare torch (≤ 16 tokens)"]
    return table(header, rows), unmet


def generation_section(res: Results) -> tuple[str, str, dict]:
    gens = {r["extra"]["impl"].split("_")[0]: r for r in res.by_impl("naive_generation") + res.by_impl("engine_generation")}
    if not gens:
        return "(no generation benchmark in this run)", "", {}
    rows = []
    for impl in ("naive", "engine"):
        r = gens.get(impl)
        if not r:
            continue
        e = r["extra"]
        rows.append([impl, e["tokens"], f"{e['heads']} x {e['head_dim']} {e['dtype']}", fmt_time(e["total_s"]),
                     fmt_time(e["per_token_s"]), fmt_bytes(e["peak_rss_bytes"]), fmt_bytes(e["peak_rss_growth_bytes"]),
                     fmt_bytes(e["final_cache_bytes"]), fmt_bytes(e.get("bytes_copied", 0))])
    summary = table(["cache", "tokens", "heads x head_dim", "total", "per token", "peak RSS", "peak RSS - RSS before",
                     "final K/V", "bytes copied"], rows)
    win_rows = []
    naive, engine = gens.get("naive"), gens.get("engine")
    if naive:
        ew = {w["end_token"]: w for w in (engine["extra"]["windows"] if engine else [])}
        for w in naive["extra"]["windows"]:
            e = ew.get(w["end_token"])
            win_rows.append([f"{w['end_token'] - naive['extra']['window'] + 1}-{w['end_token']}",
                             fmt_bytes(w["bytes_copied"]), fmt_time(w["seconds"]),
                             f"{w['bytes_copied'] / w['seconds'] / 1e9:.1f}" if w["seconds"] else "—",
                             fmt_time(e["seconds"]) if e else "—"])
    windows = table(["tokens", "naive: bytes copied", "naive: time", "naive: copied GB/s", "engine: time"], win_rows)
    return summary, windows, gens


def ops_section(res: Results) -> str:
    rows = []
    for op in ("append", "extend", "truncate", "fork", "step_after_fork"):
        for r in res.op_rows(op):
            e = r["extra"]
            what = {"append": f"{e.get('tokens')} tokens", "extend": f"{e.get('tokens')} queries at length {e.get('context')}",
                    "truncate": f"drop {e.get('tokens')} tokens ({e.get('pages_freed')} pages)",
                    "fork": f"{e.get('tokens')} tokens ({e.get('pages_shared')} pages shared)",
                    "step_after_fork": f"copy-on-write of {fmt_bytes(e.get('cow_bytes'))} + step at {e.get('context')}"}[op]
            extra = ""
            if op == "append" and r["median"]:
                extra = f"{e['bytes_written'] / r['median'] / 1e9:.2f} GB/s written"
            if op == "extend" and r["median"]:
                extra = f"{pct(res.metrics(r)['roof'])} of roofline"
            rows.append([op, what, fmt_time(r["median"]), fmt_time(r["min"]), r["rounds"], extra])
    return table(["operation", "what", "median", "min", "rounds", ""], rows)


def batch_section(res: Results) -> str:
    rows = defaultdict(dict)
    for r in res.op_rows("batched_step"):
        rows[r["extra"]["batch"]][r["extra"]["impl"]] = r
    out = []
    for b in sorted(rows):
        bs, loop = rows[b].get("engine_batch_step"), rows[b].get("engine_step_loop")
        ref = bs or loop
        e = ref["extra"]
        out.append([b, f"{e['lengths_min']}-{e['lengths_max']}", fmt_bytes(e["kv_bytes"]),
                    fmt_time(bs and bs["median"]), fmt_time(loop and loop["median"]),
                    ratio(loop and loop["median"], bs and bs["median"]),
                    pct(res.metrics(bs)["roof"]) if bs else "—"])
    return table(["sequences", "lengths", "K/V read", "batch_step", "loop of Decoder.step", "batch speed-up",
                  "batch_step % roofline"], out)


def multiquery_section(res: Results) -> str:
    """Prefill / extend (benchmarks/test_multiquery.py): engine vs torch SDPA, and the alternated ratios."""
    rows = defaultdict(dict)
    for r in res.rows:
        if r["group"].startswith("multiquery"):
            rows[r["extra"]["shape"]][r["extra"]["impl"]] = r
    out = []
    for shape, impls in rows.items():
        eng, tor = impls.get("engine_extend"), impls.get("torch_sdpa")
        e = (eng or tor)["extra"]
        m = res.metrics(eng) if eng else {}
        alt = eng["extra"] if eng else {}
        out.append([shape, fmt_time(eng and eng["median"]), fmt_time(tor and tor["median"]),
                    ratio(tor and tor["median"], eng and eng["median"]),
                    f"{m['gflops']:.0f}" if m else "—", pct(m["frac_mm"]) if m else "—",
                    f"{alt['alt_speedup_vs_torch']:.2f}x" if "alt_speedup_vs_torch" in alt else "—",
                    pct(alt["alt_frac_matmul"]) if "alt_frac_matmul" in alt else "—", (tor or eng)["extra"].get("mask", "")])
    return table(["shape", "engine (Decoder.extend)", "torch SDPA", "speed-up", "engine GFLOP/s", "of matmul",
                  "alternated speed-up", "alternated of matmul", "torch mask"], out)


def page_section(res: Results) -> str:
    rows = []
    for r in res.rows:
        if r["group"].startswith("page size"):
            e = r["extra"]
            rows.append([e["shape"], e.get("page_size"), fmt_time(r["median"]), pct(res.metrics(r)["roof"])])
    rows.sort(key=lambda x: (shape_key(x[0]), x[1]))
    return table(["shape", "page size", "Decoder.step (cold)", "% roofline"], rows)


def first_step_section(res: Results) -> tuple[str, list, dict]:
    r = _first(res.by_impl("engine_first_step"))
    if not r:
        return "(no first-step benchmark in this run)", [], {}
    e = r["extra"]
    w = e.get("warming_process", {})
    rows = [["median of the timed processes", fmt_time(e["import_s"]), fmt_time(e["construct_s"]),
             fmt_time(e["first_step_s"]), fmt_time(e["second_step_s"]),
             fmt_time(e.get("process_start_to_first_step_s"))],
            ["the warming process (cache possibly cold)", fmt_time(w.get("import_s")), fmt_time(w.get("construct_s")),
             fmt_time(w.get("first_step_s")), fmt_time(w.get("second_step_s")),
             fmt_time(w.get("process_start_to_first_step_s"))]]
    unmet = []
    if not e["first_step_s"] < TARGET_FIRST_S:
        unmet.append(f"first step {fmt_time(e['first_step_s'])} >= 0.5 s")
    text = table(["process", "import decode", "build decoder + context", "first step", "second step",
                  "process start → first step done"], rows)
    text += (f"\n\nAll timed first steps: {', '.join(fmt_time(x) for x in e.get('first_step_s_all', []))}; "
             f"import + first step: {', '.join(fmt_time(x) for x in e.get('import_plus_first_step_s_all', []))}. "
             f"Target (first step of a fresh process with a warm compile cache < 0.5 s): "
             f"{verdict(e['first_step_s'] < TARGET_FIRST_S)}.")
    return text, unmet, e


# ----------------------------------------------------------------------------------------------------------------
# plots
# ----------------------------------------------------------------------------------------------------------------
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
    return made


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


# ----------------------------------------------------------------------------------------------------------------
# the document
# ----------------------------------------------------------------------------------------------------------------
def render(res: Results, memory_rows=None, results_path: Path | None = None, doc: Path = DOC) -> str:
    grid, verdicts = grid_section(res)
    roof_text, unmet, faster = targets_section(res, verdicts)
    fp16, unmet16 = fp16_section(res)
    tiny, unmet_tiny = tiny_section(res)
    gen_summary, gen_windows, gens = generation_section(res)
    first, unmet_first, first_e = first_step_section(res)
    made = plots(res, gens, memory_rows, doc.parent / "img")       # images beside the document
    unmet_all = unmet + unmet16 + unmet_tiny + unmet_first

    faster_unmet = [f for f in faster if "not met" in f[-1]]
    gen_line = ""
    if "naive" in gens and "engine" in gens:
        a, b = gens["naive"]["extra"], gens["engine"]["extra"]
        gen_line = (f"Generating {a['tokens']} tokens: naive {fmt_time(a['total_s'])}, engine {fmt_time(b['total_s'])} "
                    f"({a['total_s'] / b['total_s']:.1f}x); peak RSS growth {fmt_bytes(a['peak_rss_growth_bytes'])} vs "
                    f"{fmt_bytes(b['peak_rss_growth_bytes'])} for {fmt_bytes(a['final_cache_bytes'])} of K/V.")

    summary_rows = []
    n_roof = sum(1 for u in unmet if u.startswith("roofline"))
    summary_rows.append(["≥ 90% of roofline where bandwidth-bound (MHA/GQA, ≥ 4096 tokens); ≥ 50% where compute-bound (MQA)",
                         verdict(n_roof == 0) + (f" ({n_roof} shapes below)" if n_roof else "")])
    summary_rows.append(["faster than torch SDPA and NumPy-on-contiguous on every shape",
                         verdict(not faster_unmet) + (f" ({len(faster_unmet)} of {len(faster)} comparisons lost)" if faster_unmet else "")])
    summary_rows.append(["float16 storage ≥ 1.6x faster than float32 at 32768 MHA", verdict(not unmet16) if fp16.count("\n") > 1 else "—"])
    summary_rows.append(["tiny-context `Decoder.step` (≤ 16 tokens) < 15 µs and below a bare torch SDPA call",
                         verdict(not unmet_tiny) if tiny.count("\n") > 1 else "—"])
    summary_rows.append(["first step of a fresh process with a warm compile cache < 0.5 s",
                         verdict(not unmet_first) if first_e else "—"])

    notes = ""
    if doc.exists():
        old = doc.read_text()
        if NOTES_BEGIN in old and NOTES_END in old:
            notes = old[old.index(NOTES_BEGIN) + len(NOTES_BEGIN):old.index(NOTES_END)].strip("\n")
    if not notes:
        notes = "(Observations on this run go here; `benchmarks/report.py` keeps this block when it re-renders.)"

    rel = os.path.relpath(results_path, ROOT) if results_path else "?"
    img = lambda name, alt: f"![{alt}](img/{name})" if name in made else ""  # noqa: E731
    parts = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python -m benchmarks.report` from " + rel + "; edit the notes block only. -->",
        "",
        "Every number below comes from one run of `pytest benchmarks --benchmark-only` on the machine described "
        "next, with the ceilings (read bandwidth, matmul rate) measured inside the same session; fractions are "
        "relative to those ceilings. Times are pytest-benchmark medians per step and layer.",
        "",
        "## Reproduce",
        "",
        "```sh",
        "python -m benchmarks.report --run --wait-quiet 900 --memory-json benchmarks/results/memory.json",
        "    # waits (<= 15 min) for a quiet machine, runs the full suite (~6-8 min) into benchmarks/results/full-run.json,",
        "    # re-runs any benchmark that other processes disturbed, then writes this file and docs/img/*.png",
        "python -m decode.cli memory --json > benchmarks/results/memory.json        # the memory table's input",
        "python -m benchmarks.report benchmarks/results/full-run.json --memory-json benchmarks/results/memory.json",
        "pytest benchmarks --benchmark-only -k 'MQA and n32768'       # any subset",
        "pytest benchmarks --benchmark-disable --quick                # what CI runs: every benchmark once, small shapes",
        "```",
        "",
        "## Machine and session",
        "",
        machine_section(res),
        "",
        "## Targets (issue 5)",
        "",
        table(["target", "verdict"], summary_rows),
        "",
        ("Not met: " + "; ".join(unmet_all + [f"{f[1]} at {f[0]} ({f[4]})" for f in faster_unmet if
                                             f"faster than {f[1]} at {f[0]}" not in " ".join(unmet_all)]) + "."
         if unmet_all or faster_unmet else "All targets met in this run."),
        "",
        NOTES_BEGIN,
        notes,
        NOTES_END,
        "",
        "## Disturbed timings",
        "",
        disturbance_section(res),
        "",
        "## How the step is measured",
        "",
        "* **Cold, as a model runs.** One cache per layer and enough layers that their K/V together is ≥ 1 GiB "
        "(at most 1024 layers; 2 where one layer is already ≥ 512 MiB); each timed round is one step of the next "
        "layer in rotation, so the step's K/V comes from DRAM, not from the last-level cache. A setup outside the "
        "timing truncates that layer back to N - 1 tokens where the step appends.",
        "* **Same data everywhere.** Every implementation holds the same bytes (storage dtype) and gets the same "
        "query and new token; layer 0's output of each is checked against a float64 reference before timing.",
        "* **engine step** = `Decoder.step` (checks, slot reservation, write, kernel); **kernel wrapper** = "
        "`decode.attention.paged_decode_attention` alone over the same pages; **NumPy contiguous** = a preallocated "
        "`[kv_heads, N, head_dim]` cache, token written in place, batched matmul or einsum (the faster in an "
        "untimed trial; float16 upcast per kv head); **torch SDPA** = `scaled_dot_product_attention(..., "
        "enable_gqa=True)` over the same memory (`torch.from_numpy`), 2 threads, float16 storage computed in "
        "float16; **naive concat** = the source document's cache (`np.concatenate` of the whole history every "
        "step, NumPy attention).",
        "* **Roofline bound** per step = max(K/V bytes / read bandwidth, 4·q_heads·N·head_dim / matmul rate); "
        "fraction of roofline = bound / measured median.",
        "",
        "## Decode step, cold (32 query heads, head_dim 128)",
        "",
        grid,
        "",
        img("step_latency.png", "step latency vs context"),
        "",
        img("roofline_fractions.png", "fractions of bandwidth, FLOP rate and roofline"),
        "",
        "### Roofline targets",
        "",
        roof_text,
        "",
        "### Faster than torch SDPA and NumPy on every shape",
        "",
        table(["shape", "baseline", "baseline step", "engine step", "engine speed-up", "verdict"], faster),
        "",
        "### float16 vs float32 storage",
        "",
        fp16,
        "",
        "## Per-call overhead: tiny contexts (8 query heads, 2 kv heads, head_dim 64, hot)",
        "",
        tiny,
        "",
        "## Whole generation (fresh process each)",
        "",
        gen_line,
        "",
        gen_summary,
        "",
        "Per window (the naive cache copies its whole history at every token, so the bytes copied per window grow "
        "linearly and the total quadratically):",
        "",
        gen_windows,
        "",
        img("generation.png", "generation time, peak memory and copies per window"),
        "",
        "## First step of a fresh process",
        "",
        first,
        "",
        "## Cache operations (32 q heads, 8 kv heads, head_dim 128, float16, context 4096)",
        "",
        ops_section(res),
        "",
        "### Batched step: B sequences of mixed lengths in one pool",
        "",
        batch_section(res),
        "",
        "### Page size",
        "",
        page_section(res),
        "",
        "## Prefill and extend (tiled multi-query kernel) vs torch SDPA",
        "",
        multiquery_section(res),
        "",
    ]
    if memory_rows:
        parts += ["## KV memory: formula vs measured (`python -m decode.cli memory --json`)", "",
                  memory_table(memory_rows), "", img("memory.png", "memory formula vs measured"), ""]
    return "\n".join(p for p in parts) .replace("\n\n\n", "\n\n")


def wait_for_quiet(limit_s: float, threshold: float = 0.6) -> None:
    """Wait (at most ``limit_s``) until the 1-minute load average drops below ``threshold``: the parallel kernel
    and the bandwidth probe use both cores, and another busy process doubles or quadruples their times."""
    import time

    t0 = time.time()
    while os.getloadavg()[0] >= threshold and time.time() - t0 < limit_s:
        print(f"load average {os.getloadavg()[0]:.2f} >= {threshold}: waiting for a quiet machine "
              f"({time.time() - t0:.0f} s of {limit_s:.0f})", flush=True)
        time.sleep(20)


def disturbance_section(res: Results) -> str:
    """Which timings other processes disturbed, and what the re-runs changed."""
    reruns = res.meta.get("reruns", [])
    rows = []
    for r in res.rows:
        e = r["extra"]
        first = e.get("first_run")
        if e.get("disturbed") or first:
            rows.append([r["name"].replace("test_", "", 1), f"{e.get('other_cpu_cores', 0):.2f}",
                         fmt_time(r["median"]), "yes" if e.get("disturbed") else "no",
                         f"{fmt_time(first['median'])} ({(first.get('other_cpu_cores') or 0):.2f} cores)" if first else ""])
    if not rows:
        return "No timing was disturbed: other processes used < %.1f cores during every benchmark." % DISTURBED_CORES
    head = (f"Other processes' CPU use is measured during every timing (/proc/stat minus this process). "
            f"{sum(len(x['benchmarks']) for x in reruns)} disturbed benchmarks were re-run in {len(reruns)} later "
            f"session(s) ({', '.join(str(x.get('date')) for x in reruns) or '—'}); the tables use the re-run. "
            f"Rows still marked † were disturbed in their last run too.\n\n")
    return head + table(["benchmark", "others' CPU (cores) during the timing used", "median used", "still disturbed",
                         "first run (others' CPU)"], rows)


def run_suite(out: Path, extra_args=(), targets=None, fatal=True) -> bool:
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", *(targets or [str(ROOT / "benchmarks")]), "--benchmark-only",
           "-p", "no:cacheprovider", f"--benchmark-json={out}", *extra_args]
    print("+", " ".join(cmd), flush=True)
    code = subprocess.call(cmd, cwd=ROOT)
    if code != 0 and fatal:
        sys.exit(f"benchmark run failed ({code})")
    return code == 0 and out.exists()


def compact(path: Path) -> None:
    """Drop the per-round timings (stats.data: up to 20000 numbers per benchmark, ~25 MB per run) from a saved
    run; every statistic the report uses stays."""
    raw = json.loads(path.read_text())
    for b in raw.get("benchmarks", []):
        (b.get("stats") or {}).pop("data", None)
    path.write_text(json.dumps(raw, indent=1))


def disturbed(raw: dict) -> list[str]:
    """Node ids of the benchmarks during whose timing other processes used > DISTURBED_CORES cores."""
    return [b["fullname"] for b in raw.get("benchmarks", []) if (b.get("extra_info") or {}).get("disturbed")]


def merge_rerun(raw: dict, rerun: dict) -> dict:
    """Replace the disturbed benchmarks of ``raw`` by their re-runs (each keeps its first timing in
    extra_info["first_run"]) and note the re-run session's ceilings."""
    new = {b["fullname"]: b for b in rerun.get("benchmarks", [])}
    out = []
    for b in raw["benchmarks"]:
        nb = new.get(b["fullname"])
        if nb is not None:
            first = b["extra_info"].get("first_run") or {
                "median": b["stats"]["median"], "min": b["stats"]["min"],
                "other_cpu_cores": b["extra_info"].get("other_cpu_cores")}
            nb["extra_info"]["first_run"] = first
            b = nb
        out.append(b)
    raw["benchmarks"] = out
    meta = raw.setdefault("pagedkv", {})
    meta.setdefault("reruns", []).append({"benchmarks": sorted(new), "date": rerun.get("pagedkv", {}).get("date"),
                                          "ceilings_start": rerun.get("pagedkv", {}).get("ceilings_start")})
    return raw


def run_memory(out: Path) -> None:
    cmd = [sys.executable, "-m", "decode.cli", "memory", "--json"]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"memory report failed ({proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
        return
    out.write_text(proc.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="?", default=None, help=f"pytest-benchmark JSON (default {RESULTS.relative_to(ROOT)})")
    p.add_argument("--run", action="store_true", help="run the full suite first (saves the JSON)")
    p.add_argument("--quick", action="store_true", help="with --run: the --quick shapes")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                   help="with --run: first wait up to SECONDS for the 1-min load average to drop below 0.6")
    p.add_argument("--reruns", type=int, default=2,
                   help="with --run: re-run the benchmarks disturbed by other processes up to this many times")
    p.add_argument("--memory", action="store_true", help="also run `python -m decode.cli memory --json`")
    p.add_argument("--memory-json", default=None, help="a saved `kvengine memory --json` output")
    p.add_argument("--doc", default=str(DOC), help="where to write the markdown (default docs/benchmarks.md)")
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    args = p.parse_args(argv)

    results = Path(args.results) if args.results else RESULTS
    if args.run:
        extra = pytest_args + (["--quick"] if args.quick else [])
        if args.wait_quiet and hasattr(os, "getloadavg"):
            wait_for_quiet(args.wait_quiet)
        run_suite(results, extra)
        compact(results)
        for attempt in range(args.reruns):
            raw = json.loads(results.read_text())
            names = disturbed(raw)
            if not names:
                break
            print(f"re-running {len(names)} disturbed benchmarks (other processes used > "
                  f"{DISTURBED_CORES} cores during their timing)", flush=True)
            if hasattr(os, "getloadavg"):
                wait_for_quiet(max(args.wait_quiet, 300))
            tmp = results.with_suffix(f".rerun{attempt + 1}.json")
            if not run_suite(tmp, extra, targets=names, fatal=False):
                print("the re-run failed; keeping the first timings", file=sys.stderr)
                break
            compact(tmp)
            results.write_text(json.dumps(merge_rerun(raw, json.loads(tmp.read_text())), indent=1))
            tmp.unlink()
    memory_path = Path(args.memory_json) if args.memory_json else (MEMORY if MEMORY.exists() else None)
    if args.memory:
        memory_path = Path(args.memory_json) if args.memory_json else MEMORY
        run_memory(memory_path)
    memory_rows = json.loads(memory_path.read_text()) if memory_path and memory_path.exists() else None
    res = Results(json.loads(results.read_text()))
    doc = Path(args.doc)
    text = render(res, memory_rows, results, doc)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    print(f"wrote {doc} and {doc.parent / 'img'}/*.png from {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
