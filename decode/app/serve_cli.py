"""The ``serve`` and ``make-model`` subcommands of ``kvengine`` (argument parsing; nothing optional imported
until a subcommand runs).

    kvengine serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--kv-cache-memory 2GiB] [--dtype auto]
                   [--kv-cache-dtype auto] [--block-size 16] [--max-num-batched-tokens 2048] [--max-num-seqs 64]
                   [--max-model-len N] [--enable-prefix-caching | --no-enable-prefix-caching]
                   [--served-model-name NAME ...] [--timeout-graceful-shutdown 30]
    kvengine make-model DIR [--layers 2] [--hidden 128] [--heads 4] [--kv-heads 2] [--vocab 512] ...

Flag names are vLLM's where the meaning is the same. Without ``--model`` the server builds a small
random-weight Llama in place (`decode.app.make_model`) and says so in its log line and in ``/v1/models``.
"""
from __future__ import annotations

import argparse
import sys

RANDOM_MODEL_NAME = "kvengine-random-weights"
MODEL_DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server over the continuous-batching engine")
    p.add_argument("--model", default=None, help="a transformers checkpoint directory (default: a small "
                                                 "random-weight model built in place)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-cache-memory", default="2GiB", help="KV pool budget, e.g. 512MiB, 2GiB (default 2GiB)")
    p.add_argument("--dtype", default="auto", choices=MODEL_DTYPES, help="the model's weights/activations")
    p.add_argument("--kv-cache-dtype", default="auto", help="KV storage dtype (auto: the model's)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--served-model-name", nargs="+", default=None, help="name(s) clients use in `model`")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGINT/SIGTERM (then aborted)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)

    from .make_model import add_spec_arguments
    p = sub.add_parser("make-model", help="write a small random-weight checkpoint (config, safetensors, tokenizer)")
    p.add_argument("dir", help="output directory")
    add_spec_arguments(p)
    p.add_argument("--dtype", default="float32", choices=MODEL_DTYPES[1:])
    p.set_defaults(func=cmd_make_model)


def cmd_make_model(args) -> int:
    try:
        from . import make_model
    except ImportError as exc:
        print(f"kvengine make-model: needs the hf extra (pip install 'pagedkv[hf]'): {exc}", file=sys.stderr)
        return 2
    return make_model.main(args)


def build_engine(args):
    """(engine, ServedModel) from the parsed flags; a ValueError names a bad flag."""
    from decode.serve import Engine
    from decode.serve.http import ServedModel

    kwargs = dict(kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
                  kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype,
                  enable_prefix_caching=args.enable_prefix_caching,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len)
    if args.model is not None:
        engine = Engine(args.model, **kwargs)
        names = tuple(args.served_model_name or (str(args.model),))
        return engine, ServedModel(names, False, f"checkpoint {args.model}")
    from .make_model import ModelSpec, describe, random_model

    spec = ModelSpec(dtype="float32" if args.dtype == "auto" else args.dtype)
    model, tokenizer = random_model(spec)
    engine = Engine(model, tokenizer, **kwargs)
    names = tuple(args.served_model_name or (RANDOM_MODEL_NAME,))
    return engine, ServedModel(names, True, describe(spec) + ", built in place because no --model was given")


def cmd_serve(args) -> int:
    try:
        from decode.serve.http import Server
    except ImportError as exc:
        print(f"kvengine serve: needs the serve and hf extras (pip install 'pagedkv[serve,hf]'): {exc}",
              file=sys.stderr)
        return 2
    try:
        engine, served = build_engine(args)
        server = Server(engine, served, host=args.host, port=args.port, grace_s=args.timeout_graceful_shutdown,
                        log_level=args.log_level)
    except (ValueError, TypeError, OSError) as exc:          # a bad flag value, a port in use
        print(f"kvengine serve: {exc}", file=sys.stderr)
        return 2
    stats = engine.stats()
    print(f"kvengine serve: {served.names[0]} = {served.description}; max_model_len {engine.max_model_len}, "
          f"{stats.get('pages_total')} KV pages of {args.block_size} tokens; listening on {server.url}",
          file=sys.stderr, flush=True)
    return server.run()
