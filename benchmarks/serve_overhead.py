"""Where a decode step of `decode.serve.Engine` goes: the scheduler and the rest of the engine's Python vs the
model forward, split into attention (the engine's kernel calls, K/V writes and input checks) and everything
else of the model (matmuls, norms, RoPE, transformers' Python).

    python -m benchmarks.serve_overhead [--layers 8 --hidden 1024 --heads 16 --kv-heads 4 --vocab 32000 |
                                         --checkpoint DIR]
                                        [--requests 32 --prompt 128 --new 48 --dtype float32 --threads 2]

Steps where every running request decodes (``--requests`` of them, one token each) are timed; the figures are
medians over those steps. Not collected by pytest (the helper "peers" owns benchmarks/test_serve.py).
"""
import argparse
import statistics
import time

import torch


def _timed(owner, name, sink):
    """Replace ``owner.name`` by a wrapper adding its wall time to ``sink[-1]`` (one slot per step)."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink[-1] += time.perf_counter() - t
    setattr(owner, name, wrapper)
    return fn


def build_model(args):
    import copy

    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=4096, eos_token_id=None,
                      bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).to(getattr(torch, args.dtype)).eval()


def measure(args) -> dict:
    from decode.serve import Engine, SamplingParams
    from decode.serve import packed_attention
    from decode.serve.fixtures import random_prompts

    model = args.checkpoint or build_model(args)                 # a directory: its tokenizer detokenizes too
    engine = Engine(model, max_tokens=args.requests * (args.prompt + args.new) + 1024, block_size=16,
                    max_num_seqs=args.requests, max_num_batched_tokens=max(2048, args.requests))
    slots = {name: [0.0] for name in ("schedule", "forward", "model", "attention", "sample")}
    _timed(engine.scheduler, "schedule", slots["schedule"])
    _timed(engine.runner, "forward", slots["forward"])
    model = engine.runner.model
    engine.runner.model = lambda *a, **kw: model(*a, **kw)                  # a callable to time (the module's
    _timed(engine.runner, "model", slots["model"])                          # __call__ itself stays untouched)
    _timed(engine.sampler, "sample", slots["sample"])
    attend = _timed(packed_attention.PackedForward, "attend", slots["attention"])
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    vocab = engine.vocab_size
    for prompt in random_prompts(args.requests, args.prompt, args.prompt + 1, vocab, seed=1):
        engine.add_request(prompt, params)
    rows = []
    try:
        while engine.has_unfinished_requests():
            for sink in slots.values():
                sink.append(0.0)
            t = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t
            decoding = engine.stats()["requests_running"] == args.requests
            if decoding and engine.scheduler.running[0].num_computed > args.prompt:
                rows.append({"step": total, **{name: sink[-1] for name, sink in slots.items()}})
    finally:
        packed_attention.PackedForward.attend = attend
    out = summarize(rows)
    import numba

    out["threading_layer"] = numba.threading_layer()
    out["tokenizer"] = type(engine.tokenizer).__name__ if engine.tokenizer is not None else None
    return out


def summarize(rows: list) -> dict:
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    med["engine_python"] = statistics.median(r["step"] - r["model"] for r in rows)      # all but the model call
    med["model_other"] = statistics.median(r["model"] - r["attention"] for r in rows)
    med["steps"] = len(rows)
    return med


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("layers", 8), ("hidden", 1024), ("heads", 16), ("kv-heads", 4), ("vocab", 32000),
                          ("requests", 32), ("prompt", 128), ("new", 48), ("threads", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint directory instead of the built model "
                        "(with a tokenizer: outputs are detokenized, as a server's are)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    m = measure(args)
    step = m["step"]
    print(f"{args.requests} running requests, decode steps timed: {m['steps']} (medians, ms)")
    print(f"threading layer {m['threading_layer']}, torch threads {torch.get_num_threads()}, tokenizer: "
          f"{m['tokenizer']}")
    for key, what in (("step", "whole step"), ("schedule", "scheduler.schedule"),
                      ("engine_python", "engine's own work: all but the model call (schedule, inputs, "
                                        "transaction, sampling, outputs)"),
                      ("sample", "sampler"), ("forward", "runner.forward (inputs + transaction + model call)"),
                      ("model", "the model call"),
                      ("attention", "  of which attention (engine kernel calls + K/V writes + checks)"),
                      ("model_other", "rest of the model (matmuls, norms, RoPE, transformers Python)")):
        print(f"  {what:100s} {m[key] * 1e3:9.2f}  {m[key] / step * 100:6.2f}%")


if __name__ == "__main__":
    main()
