"""`kvengine generate`: both ways on a tiny model, identical tokens at equal precision, the paged path ran."""
import json

from decode.app import cli


def test_generate_json(capsys):
    code = cli.main(["generate", "--arch", "gpt2", "--layers", "2", "--hidden", "32", "--heads", "4", "--batch", "2",
                     "--prompt", "7", "--new-tokens", "5", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["rows_with_identical_tokens"] == 2 and result["max_logit_difference"] < 1e-5
    assert result["kernel_calls"] == 2 * 5 and result["forwards"] == 5


def test_generate_report(capsys):
    code = cli.main(["generate", "--arch", "mistral", "--layers", "2", "--hidden", "32", "--heads", "4",
                     "--kv-heads", "2", "--batch", "1", "--prompt", "5", "--new-tokens", "3", "--storage", "float16"])
    out = capsys.readouterr().out
    assert code == 0 and "tokens/s" in out and "PagedCache" in out and "kernel calls" in out


def test_help_shows_defaults_and_storage_choices(capsys):
    import pytest
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "(default: model)" in out and "int8" in out and "bfloat16" in out and "(default: 64)" in out


def test_int8_storage_runs(capsys):
    code = cli.main(["generate", "--arch", "llama", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads",
                     "2", "--batch", "1", "--prompt", "5", "--new-tokens", "3", "--storage", "int8", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["storage"] == "int8" and result["forwards"] == 3


def test_divergence_note_tells_rounding_from_error():
    """A near-tie (margin within the logit difference seen, itself within bfloat16 rounding) is rounding; a
    difference beyond bfloat16 rounding is not."""
    import torch
    from types import SimpleNamespace
    from decode.app.hf_compare import divergences, format_report

    def run(tokens, logits):
        return SimpleNamespace(sequences=torch.tensor([[9, 9] + tokens]), logits=[torch.tensor([x]) for x in logits])
    ref = run([1, 2], [[0.0, 5.0, 1.0], [0.0, 1.0, 1.001]])
    tie = run([1, 1], [[0.0, 5.0, 1.01], [0.0, 1.002, 0.999]])        # differs at step 1, margin 0.001 < 0.01
    clear = run([2, 2], [[0.0, 4.9, 5.0], [0.0, 1.0, 1.0]])           # differs at step 0, margin 4 > 0.1
    [d] = divergences(ref, tie, prompt=2, dtype="bfloat16")
    assert d["step"] == 1 and d["by_rounding"] and abs(d["margin"] - 0.001) < 1e-6
    [e] = divergences(ref, clear, prompt=2, dtype="bfloat16")
    assert e["step"] == 0 and not e["by_rounding"]
    report = {"pagedkv_tokens_per_s": 1.0, "sdpa_tokens_per_s": 1.0, "arch": "llama", "layers": 1, "batch": 1,
              "prompt": 2, "new_tokens": 2, "model_dtype": "bfloat16", "storage": "float32", "sdpa_seconds": 1.0,
              "pagedkv_seconds": 1.0, "kernel_calls": 1, "forwards": 1, "rows_with_identical_tokens": 0,
              "token_agreement": 0.5, "max_logit_difference": 0.01, "divergences": [d, e]}
    text = format_report(report)
    assert "not an error" in text and "beyond rounding" in text


def test_bfloat16_model_divergence_is_rounding(capsys):
    code = cli.main(["generate", "--arch", "llama", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads",
                     "2", "--batch", "2", "--prompt", "7", "--new-tokens", "16", "--model-dtype", "bfloat16",
                     "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and all(d["by_rounding"] for d in result["divergences"])
    print(f"\nbfloat16 model, {result['storage']} pages: identical rows {result['rows_with_identical_tokens']}/2, "
          f"divergences {result['divergences']}")
