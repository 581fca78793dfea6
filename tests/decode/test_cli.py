"""The console command `kvengine` (run as `python -m decode.app.cli`) end to end."""
import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "decode.app.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_audit_runs_the_engine_on_the_document_example(tmp_path):
    result = run_cli("audit", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "ATTENTION_AUDIT_OK"
    assert any("engine float32" in line and "PASS" in line for line in lines)
    with open(tmp_path / "out" / "engine" / "engine_context.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and all(row["passed"] == "true" for row in rows)
    row2 = [r for r in rows if r["storage"] == "float64" and r["row"] == "2"][0]
    assert abs(float(row2["context_0"]) + 0.439015) < 5e-7 and abs(float(row2["context_1"]) + 0.354843) < 5e-7


def test_audit_refuses_the_committed_reference_copy():
    result = run_cli("audit", "--out", str(ROOT / "reference" / "results"))
    assert result.returncode != 0
    assert "refusing" in (result.stdout + result.stderr)


def test_unknown_subcommand_fails_with_usage():
    result = run_cli("nonsense")
    assert result.returncode == 2 and "invalid choice" in result.stderr
