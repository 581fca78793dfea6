"""Reproduce every figure of the source document and check each one.

    python -m reference.audit --out DIR [--reference DIR | --no-reference]

Writes into ``DIR`` one CSV per table (values ``%.17g``), ``checks.csv`` and ``audit.json`` (sha256 of
every ``reference/*.py`` source, Python/NumPy versions, every check with its measured figure, the
document's figure, the tolerance and the verdict).  The fresh CSVs are then compared with the committed
reference copy (``reference/results/`` unless ``--reference`` says otherwise) under a tolerance
(``|fresh - committed| <= 1e-12 + 1e-12 * |committed|``), never bit for bit.

Prints a short summary; the last line is ``ATTENTION_AUDIT_OK`` (exit 0) when every check and the
comparison pass, otherwise the failing checks are named and the exit status is 1.  Writing into the
committed reference copy is refused (exit 2).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .audit_checks import CHECK_HEADER, TOL_2, TOL_3, TOL_6, TOL_HAND, TOL_ROUNDOFF, Check
from .audit_document import section_bugs, section_cache, section_example, section_memory, section_oracle
from .audit_invariants import section_append_failure, section_batch, section_rejections, section_visibility
from .records import compare_csv, write_csv, write_json

__all__ = ["Check", "REFERENCE_DIR", "AuditResult", "run_checks", "main"]

PACKAGE_DIR = Path(__file__).resolve().parent
REFERENCE_DIR = PACKAGE_DIR / "results"
OK_LINE = "ATTENTION_AUDIT_OK"
COMPARE_ATOL = 1e-12
COMPARE_RTOL = 1e-12

SECTIONS = (section_example, section_oracle, section_batch, section_cache, section_visibility, section_bugs,
            section_append_failure, section_rejections, section_memory)


# ----------------------------------------------------------------------------------------------
# running, writing, comparing
# ----------------------------------------------------------------------------------------------

@dataclass
class AuditResult:
    """All tables (file name -> (header, rows)), checks and per-section details."""

    tables: dict
    checks: list
    details: dict

    @property
    def failed(self) -> list:
        return [c for c in self.checks if not c.passed]


def run_checks() -> AuditResult:
    """Compute every section (no files written)."""
    tables, checks, details = {}, [], {}
    for make in SECTIONS:
        section = make()
        tables.update(section.tables)
        checks.extend(section.checks)
        details[make.__name__.removeprefix("section_")] = section.details
    return AuditResult(tables, checks, details)


def source_hashes() -> dict:
    """sha256 of every ``reference/*.py`` file, keyed ``reference/<name>``."""
    return {f"reference/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(PACKAGE_DIR.glob("*.py"))}


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def compare_with_reference(out: Path, reference: Path) -> dict:
    """Compare every CSV in ``out`` with the same file in ``reference`` under the tolerance."""
    problems = []
    fresh = sorted(p.name for p in out.glob("*.csv"))
    committed = sorted(p.name for p in reference.glob("*.csv")) if reference.is_dir() else []
    if not committed:
        problems.append(f"no committed reference CSV files in {reference}")
    for name in sorted(set(committed) - set(fresh)):
        problems.append(f"{name}: in the reference copy but not produced")
    for name in sorted(set(fresh) - set(committed)):
        if committed:
            problems.append(f"{name}: produced but missing from the reference copy")
    compared = sorted(set(fresh) & set(committed))
    for name in compared:
        problems.extend(compare_csv(out / name, reference / name, COMPARE_ATOL, COMPARE_RTOL))
    return {"reference_dir": str(reference), "atol": COMPARE_ATOL, "rtol": COMPARE_RTOL,
            "files_compared": compared, "problems": problems, "passed": not problems, "skipped": False}


def _committed_hash_changes(reference: Path, hashes: dict) -> list:
    path = reference / "audit.json"
    try:
        committed = json.loads(path.read_text(encoding="utf-8")).get("sources", {})
    except (OSError, ValueError):
        return ["(no readable audit.json in the reference copy)"]
    return sorted(name for name in set(hashes) | set(committed) if hashes.get(name) != committed.get(name))


def write_outputs(result: AuditResult, out: Path) -> None:
    """Write every table, ``checks.csv`` (``audit.json`` is written by :func:`main`)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, (header, rows) in result.tables.items():
        write_csv(out / name, header, rows)
    write_csv(out / "checks.csv", CHECK_HEADER, [c.row() for c in result.checks])


def _fmt(value, digits: int = 9) -> str:
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value) or abs(value) >= 1e-4:
            return f"{value:.{digits}g}"
        return f"{value:.3g}"
    return str(value)


HEADLINES = [
    ("example", "hand score q0.k0/2"),
    ("example", "weights[1,0]"), ("example", "weights[1,1]"),
    ("example", "context[2,0]"), ("example", "context[2,1]"),
    ("oracle", "max score error vs Decimal"), ("oracle", "max weight error vs Decimal"),
    ("oracle", "max output error vs Decimal"),
    ("batch", "batched vs per-head loop, context (max abs)"),
    ("cache", "query_start=2: max abs error vs full row 2"),
    ("cache", "query_start=0: output[0]"), ("cache", "query_start=0: output[1]"),
    ("cache", "query_start=0: max abs error vs full row 2"),
    ("bugs", "reversed mask: total weight on future keys (sum over rows of j > i)"),
    ("bugs", "softmax over queries: max row-sum error"),
    ("memory", "MHA bytes"), ("memory", "MHA (32 KV heads) GiB"), ("memory", "GQA (8 KV heads) GiB"),
    ("memory", "MQA (1 KV heads) GiB"), ("memory", "small float16 arrays: measured nbytes"),
    ("memory", "7e9 two-byte parameters GiB"),
]


def summary_lines(result: AuditResult, comparison: dict | None) -> list[str]:
    lines = ["attention audit: measured vs document"]
    by_key = {(c.section, c.name): c for c in result.checks}
    for key in HEADLINES:
        c = by_key.get(key)
        if c is None:
            continue
        doc = "" if c.document is None else f" (document {c.document!r})"
        lines.append(f"  {'ok  ' if c.passed else 'FAIL'} {c.name}: {_fmt(c.measured)}{doc}")
    sections = {}
    for c in result.checks:
        total, ok = sections.get(c.section, (0, 0))
        sections[c.section] = (total + 1, ok + c.passed)
    lines.append("  checks by section: " + ", ".join(f"{s} {ok}/{total}" for s, (total, ok) in sections.items()))
    for c in result.failed:
        lines.append(f"  FAILED [{c.section}] {c.name}: measured {_fmt(c.measured)}, document {_fmt(c.document)}, "
                     f"tolerance {_fmt(c.tolerance)}")
    if comparison is None:
        lines.append("  reference comparison: skipped (--no-reference)")
    else:
        lines.append(f"  reference comparison with {comparison['reference_dir']}: "
                     f"{len(comparison['files_compared'])} files, "
                     + ("all within tolerance" if comparison["passed"] else f"{len(comparison['problems'])} problems"))
        for problem in comparison["problems"][:20]:
            lines.append(f"  FAILED reference: {problem}")
        if comparison.get("source_hashes_changed"):
            lines.append("  note: sources differ from the ones that produced the reference copy: "
                         + ", ".join(comparison["source_hashes_changed"]))
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m reference.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="audit-out", help="directory for the CSV/JSON files (default: audit-out)")
    parser.add_argument("--reference", default=str(REFERENCE_DIR),
                        help="committed reference copy to compare with (default: reference/results)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the comparison (used once to create a reference copy); never prints the OK line")
    return parser


def main(argv=None) -> int:
    """Run the audit; returns the exit status (0 all passed, 1 a check failed, 2 usage error)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    out = Path(args.out).resolve()
    reference = Path(args.reference).resolve()
    for protected in {REFERENCE_DIR, reference}:
        if _inside(out, protected):
            print(f"audit: refusing to write into {protected}, which holds the committed reference copy; "
                  "choose another --out", file=sys.stderr)
            return 2

    result = run_checks()
    write_outputs(result, out)
    hashes = source_hashes()
    comparison = None
    if not args.no_reference:
        comparison = compare_with_reference(out, reference)
        comparison["source_hashes_changed"] = _committed_hash_changes(reference, hashes)
    failed = [f"[{c.section}] {c.name}" for c in result.failed]
    all_passed = not failed and comparison is not None and comparison["passed"]
    payload = {
        "tool": "python -m reference.audit",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "sources": hashes,
        "tolerances": {"printed_6_decimals": TOL_6, "printed_3_decimals": TOL_3, "printed_2_decimals": TOL_2,
                       "hand_arithmetic": TOL_HAND, "float64_roundoff": TOL_ROUNDOFF,
                       "reference_copy_atol": COMPARE_ATOL, "reference_copy_rtol": COMPARE_RTOL},
        "tables": sorted(list(result.tables) + ["checks.csv"]),
        "checks": [dict(zip(CHECK_HEADER, c.row())) for c in result.checks],
        "details": result.details,
        "summary": {"checks": len(result.checks), "passed": len(result.checks) - len(failed), "failed": failed,
                    "all_passed": all_passed},
        "reference_comparison": comparison if comparison is not None else {"skipped": True},
    }
    write_json(out / "audit.json", payload)

    for line in summary_lines(result, comparison):
        print(line)
    print(f"  wrote {len(result.tables) + 2} files to {out}")
    if all_passed:
        print(OK_LINE)
        return 0
    if not failed and comparison is None:
        print("all checks passed; ATTENTION_AUDIT_OK withheld because the reference comparison was skipped")
        return 0
    print(f"ATTENTION_AUDIT_FAILED: {len(failed)} checks failed"
          + ("" if comparison is None or comparison["passed"] else ", reference copy differs"))
    return 1


if __name__ == "__main__":
    sys.exit(main())
