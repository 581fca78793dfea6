"""Loading a saved pytest-benchmark run (`Results`) and the formatting every section shares."""
from __future__ import annotations

import math
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
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
        self.read_bw = start.get("read_bw") or first_of(r["extra"].get("read_bw") for r in self.rows)
        self.matmul_rate = start.get("matmul_rate") or first_of(r["extra"].get("matmul_rate") for r in self.rows)

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


def first_of(it):
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

