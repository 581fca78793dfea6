"""Heatmap PNGs (skipped where matplotlib is not installed)."""
import pytest

pytest.importorskip("matplotlib")

from reference import plot  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_the_three_heatmaps_and_the_combined_figure(tmp_path):
    paths = plot.plot_heatmaps(tmp_path / "plots")
    assert [p.name for p in paths] == ["scores.png", "masked_scores.png", "weights.png", "attention_heatmaps.png"]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5000


def test_plot_command_line(tmp_path, capsys):
    assert plot.main(["--out", str(tmp_path)]) == 0
    assert "weights.png" in capsys.readouterr().out
    assert (tmp_path / "weights.png").exists()
