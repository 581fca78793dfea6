"""Sections of the decode-step grid (issue 5's targets): machine, grid, roofline, float16, tiny contexts,
whole generation, first step, disturbed timings."""
from __future__ import annotations

from .results import (DISTURBED_CORES, GRID_IMPLS, LABELS, TARGET_BW, TARGET_COMPUTE, TARGET_FIRST_S, TARGET_FP16,
                      TARGET_TINY_S, TINY_IMPLS, Results, first_of, fmt_bytes, fmt_time, mark, pct, ratio, shape_key,
                      split_label, table, verdict)


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


def first_step_section(res: Results) -> tuple[str, list, dict]:
    r = first_of(res.by_impl("engine_first_step"))
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
