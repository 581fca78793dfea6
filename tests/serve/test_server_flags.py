"""`kvengine serve`'s flags reach the engine with vLLM's meanings; bad values exit 2 with the flag named."""
import argparse

import httpx2
import numpy as np
import pytest

from decode.app import serve_cli
from decode.serve.http import Server

from .harness import check_pool_idle


def parse(*argv):
    parser = argparse.ArgumentParser()
    serve_cli.add_parsers(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_flags_reach_the_engine_and_the_names_are_served(model_dir):
    args = parse("--model", str(model_dir), "--kv-cache-memory", "1MiB", "--block-size", "8", "--kv-cache-dtype",
                 "float16", "--max-model-len", "128", "--no-enable-prefix-caching", "--max-num-seqs", "3",
                 "--max-num-batched-tokens", "96", "--served-model-name", "a", "b")
    engine, served = serve_cli.build_engine(args)
    assert served.names == ("a", "b") and not served.random_weights
    assert engine.pool.page_size == 8 and engine.kv_cache_dtype == "float16" and engine.max_model_len == 128
    assert engine.pool.prefix_caching is False and engine.model_dtype == "float64"
    assert engine.scheduler.max_num_seqs == 3 and engine.scheduler.max_num_batched_tokens == 96
    config = engine.model.config
    bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * 16 * np.dtype("float16").itemsize
    assert engine.stats()["pages_total"] == (1 << 20) // bytes_per_token // 8      # head_dim 64 / 4 heads = 16
    server = Server(engine, served, port=0, log_level="warning").start()
    try:
        for name, status in (("b", 200), ("a", 200), (None, 200), ("c", 404)):
            body = {"prompt": [5, 6, 7], "max_tokens": 2, **({} if name is None else {"model": name})}
            r = httpx2.post(server.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == status, r.text
        check_pool_idle(server)
        assert server.loop.stats()["pages_in_use"] == 0           # no prefix caching: nothing stays held
    finally:
        server.stop()


@pytest.mark.parametrize("argv,named", [
    (["--kv-cache-dtype", "float7"], "kv_cache_dtype"),
    (["--kv-cache-memory", "lots"], "kv_cache_memory"),
    (["--max-model-len", "100000", "--kv-cache-memory", "1MiB"], "max_model_len"),
    (["--block-size", "0"], "block_size"),
])
def test_bad_flag_values_exit_2_naming_the_flag(model_dir, capsys, argv, named):
    assert serve_cli.cmd_serve(parse("--model", str(model_dir), *argv)) == 2
    assert named in capsys.readouterr().err


def test_the_kvengine_parser_imports_no_optional_package():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, decode.app.cli as cli; cli.build_parser(); print(sorted(m for m in ('torch', "
            "'transformers', 'fastapi', 'uvicorn', 'prometheus_client', 'openai') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
