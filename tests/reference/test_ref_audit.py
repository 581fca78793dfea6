"""The audit end to end: files, JSON, refusal of the committed copy, and failures it must report."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import reference
from reference import audit, dense
from reference.records import read_csv, write_csv

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "reference" / "results"


def run_audit(*args, code=None):
    command = [sys.executable, "-m", "reference.audit", *args] if code is None else [sys.executable, "-c", code, *args]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    out = tmp_path_factory.mktemp("audit")
    proc = run_audit("--out", str(out))
    return out, proc


def test_audit_passes_and_prints_the_ok_line_last(fresh):
    out, proc = fresh
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "ATTENTION_AUDIT_OK"
    assert "0.872569" in proc.stdout and "1.43901522" in proc.stdout


def test_audit_writes_one_csv_per_table_and_the_json(fresh):
    out, _ = fresh
    names = {p.name for p in out.iterdir()}
    for table in ("scores", "masked_scores", "weights", "context", "oracle", "batch", "cached_query",
                  "visibility", "deliberate_bugs", "cache_append", "rejections", "memory", "checks"):
        assert f"{table}.csv" in names
    assert "audit.json" in names
    header, rows = read_csv(out / "weights.csv")
    assert header == ["query", "key_0", "key_1", "key_2"]
    assert float(rows[1][1]) == pytest.approx(0.278885, abs=5e-7)
    assert len(rows[1][1].replace("0.", "", 1)) >= 16  # full precision, not the printed 6 decimals


def test_audit_json_records_sources_versions_and_every_check(fresh):
    out, _ = fresh
    data = json.loads((out / "audit.json").read_text())
    package = ROOT / "reference"
    assert data["sources"] == {f"reference/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
                               for p in sorted(package.glob("*.py"))}
    assert data["numpy"] == np.__version__ and data["python"] == ".".join(map(str, sys.version_info[:3]))
    checks = data["checks"]
    assert all(set(c) >= {"name", "measured", "document", "tolerance", "passed"} for c in checks)
    assert all(c["passed"] is True for c in checks)
    assert data["summary"]["all_passed"] is True and data["summary"]["failed"] == []
    by_name = {c["name"]: c for c in checks}
    doc_figures = {
        "weights[1,0]": 0.278885, "weights[1,1]": 0.721115, "context[2,0]": -0.439015, "context[2,1]": -0.354843,
        "query_start=0: max abs error vs full row 2": 1.439015,
        "reversed mask: total weight on future keys (sum over rows of j > i)": 0.872569,
        "softmax over queries: max row-sum error": 0.596413,
        "MHA bytes": 5_242_880_000, "MHA (32 KV heads) GiB": 4.88, "GQA (8 KV heads) GiB": 1.22,
        "MQA (1 KV heads) GiB": 0.15, "7e9 two-byte parameters GiB": 13.04,
        "small float16 arrays: measured nbytes": 480, "max score error vs Decimal": 1.1e-16,
    }
    for name, figure in doc_figures.items():
        assert by_name[name]["document"] == figure, name
    assert by_name["max score error vs Decimal"]["measured"] <= 1e-15
    rejections = [c for c in checks if c["section"] == "rejections"]
    assert len(rejections) >= 20
    assert data["reference_comparison"]["passed"] is True
    assert len(data["reference_comparison"]["files_compared"]) == 13


def test_committed_reference_copy_is_complete():
    names = {p.name for p in RESULTS.iterdir()}
    assert "audit.json" in names and "checks.csv" in names and len([n for n in names if n.endswith(".csv")]) == 13


def test_refuses_to_write_into_the_committed_reference_copy():
    before = {p.name: p.read_bytes() for p in RESULTS.iterdir()}
    for target in (RESULTS, RESULTS / "nested"):
        proc = run_audit("--out", str(target))
        assert proc.returncode == 2
        assert "refusing to write" in proc.stderr and "ATTENTION_AUDIT_OK" not in proc.stdout
    assert not (RESULTS / "nested").exists()
    assert {p.name: p.read_bytes() for p in RESULTS.iterdir()} == before


def copy_reference(tmp_path) -> Path:
    ref = tmp_path / "ref"
    shutil.copytree(RESULTS, ref)
    return ref


def perturb(path: Path, row: int, column: int, delta: float) -> None:
    header, rows = read_csv(path)
    rows[row][column] = float(rows[row][column]) + delta
    write_csv(path, header, rows)


def test_corrupted_reference_copy_makes_the_audit_fail(tmp_path):
    ref = copy_reference(tmp_path)
    perturb(ref / "weights.csv", 1, 1, 1e-6)
    proc = run_audit("--out", str(tmp_path / "out"), "--reference", str(ref))
    assert proc.returncode == 1
    assert "ATTENTION_AUDIT_OK" not in proc.stdout
    assert "weights.csv row 2 column key_0" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("ATTENTION_AUDIT_FAILED")
    # refusing also applies to the reference directory given on the command line
    assert run_audit("--out", str(ref), "--reference", str(ref)).returncode == 2


def test_reference_comparison_uses_a_tolerance_not_bits(tmp_path):
    ref = copy_reference(tmp_path)
    perturb(ref / "context.csv", 2, 1, 1e-14)
    assert audit.main(["--out", str(tmp_path / "out"), "--reference", str(ref)]) == 0


def test_missing_reference_file_fails(tmp_path, capsys):
    ref = copy_reference(tmp_path)
    (ref / "memory.csv").unlink()
    assert audit.main(["--out", str(tmp_path / "out"), "--reference", str(ref)]) == 1
    assert "memory.csv: produced but missing from the reference copy" in capsys.readouterr().out


def test_no_reference_mode_never_prints_the_ok_line(tmp_path, capsys):
    assert audit.main(["--out", str(tmp_path / "out"), "--no-reference"]) == 0
    out = capsys.readouterr().out
    assert "ATTENTION_AUDIT_OK\n" not in out and "comparison was skipped" in out


def column_softmax(masked):
    """A deliberately wrong softmax (over queries) to prove the audit notices."""
    masked = np.asarray(masked, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # an all -inf column gives NaN: that is the bug's business
        e = np.exp(masked - masked.max(axis=-2, keepdims=True))
        return e / e.sum(axis=-2, keepdims=True)


def test_audit_reports_a_broken_implementation(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dense, "softmax_over_keys", column_softmax)
    assert audit.main(["--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert "FAILED [example] weights[1,0]" in out and "ATTENTION_AUDIT_OK" not in out
    data = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert data["summary"]["all_passed"] is False and "[example] weights[1,0]" in data["summary"]["failed"]


def test_audit_runs_without_matplotlib_and_without_the_engine(tmp_path):
    code = ("import sys\n"
            "for name in ('matplotlib', 'kvcache', 'decode', 'numba'):\n"
            "    sys.modules[name] = None  # any import of these now fails\n"
            "from reference.audit import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    proc = run_audit("--out", str(tmp_path / "out"), code=code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "ATTENTION_AUDIT_OK"


def test_reference_sources_import_only_numpy_and_the_standard_library():
    allowed = set(sys.stdlib_module_names) | {"numpy", "reference", "matplotlib"}
    import ast
    for path in (ROOT / "reference").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [] if node.level else [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
    for name in ("audit.py", "audit_checks.py", "audit_document.py", "audit_invariants.py"):
        assert "matplotlib" not in (ROOT / "reference" / name).read_text()


def test_public_names():
    assert reference.decode_reference is dense.decode_reference
    assert reference.kv_bytes(32, 1, 10_000, 8, 128, 2) == 1_310_720_000


def test_help_returns_zero(capsys):
    assert audit.main(["--help"]) == 0
    assert "--reference" in capsys.readouterr().out
