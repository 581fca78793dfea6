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
