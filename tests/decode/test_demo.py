"""`kvengine demo` with tiny sizes, in-process: exit status, logits vs the no-cache float64 recomputation,
speculative == greedy, naive == engine, rollback leaves the cache unchanged."""
import numpy as np
import pytest

from decode.app import cli, demo, tiny_model


@pytest.fixture(scope="module")
def result():
    cfg = demo.DemoConfig(tokens=16, layers=2, prompt=6, seed=3, progress=False)
    lines = []
    res = demo.run(cfg, log=lines.append)
    res.lines = lines
    return res


def test_all_checks_pass(result):
    failed = [name for name, passed in result.checks.items() if not passed]
    assert result.ok and not failed, "\n".join(result.lines)


def test_engine_logits_match_no_cache_recomputation(result):
    cfg = result.config
    seq = result.tokens_engine[:-1]
    assert len(seq) == cfg.prompt + cfg.tokens
    assert result.logits_engine.shape == (len(seq), cfg.vocab)
    # recompute here, independently of the stored reference
    model64 = tiny_model.TinyTransformer(cfg, np.float64)
    expected = demo.reference_logits(model64, seq)
    err = np.max(np.abs(result.logits_engine - expected))
    assert err <= demo.TOLERANCE["float32"]
    assert err == pytest.approx(result.max_logit_error)
    # and the greedy tokens are the argmax of the engine's own logits at each step
    assert result.tokens_engine[cfg.prompt:] == np.argmax(result.logits_engine[cfg.prompt - 1:], axis=-1).tolist()


def test_speculative_tokens_equal_greedy(result):
    assert result.tokens_spec == result.tokens_engine
    assert 0.0 <= result.acceptance <= 1.0
    assert result.spec_rounds >= 1


def test_naive_and_engine_token_streams_equal(result):
    assert result.tokens_naive == result.tokens_engine
    assert len(result.tokens_engine) == result.config.prompt + result.config.tokens + 1


def test_rollback_checks_and_memory(result):
    assert result.rollback_checks and all(result.rollback_checks.values())
    assert 0 < result.pages_used <= result.pages_total
    assert result.formula_bytes <= result.used_page_bytes <= result.pool_bytes


def test_cli_exit_code_and_last_line(capsys):
    code = cli.main(["demo", "--tokens", "8", "--layers", "2", "--prompt", "5", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.strip().splitlines()[-1] == "DEMO_OK"
    assert "summary" in out and "tokens/s" in out and "max |error|" in out


def test_failed_check_exits_nonzero(monkeypatch, capsys):
    monkeypatch.setitem(demo.TOLERANCE, "float32", 0.0)       # no float32 run can be exact
    code = cli.main(["demo", "--tokens", "3", "--layers", "1", "--prompt", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1
    assert out.strip().splitlines()[-1] == "DEMO_FAILED"


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--layers", "-1"], ["--spec-k", "0"]])
def test_bad_options_exit_2(argv, capsys):
    assert cli.main(["demo", "--no-progress", *argv]) == 2
    assert "kvengine demo:" in capsys.readouterr().err


def test_progress_falls_back_to_plain_lines(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)   # import tqdm -> ImportError
    lines = []
    bar = demo.Progress(16, "engine decode", True, lines.append)
    assert bar.bar is None
    for _ in range(16):
        bar.update()
    bar.close()
    assert lines[-1] == "  engine decode: 16/16 tokens" and len(lines) == 8
    quiet = demo.Progress(16, "x", False, lines.append)
    quiet.update(16)
    assert len(lines) == 8
