"""Time the first decode step of a fresh process and print one JSON object (used by test_generation.py).

    python -m benchmarks.first_step [--dtype float32] [--heads 32 --kv-heads 8 --head-dim 128 --context 512]

Stages (seconds, perf_counter): ``import_s`` (import decode: numba, the kernels' cached machine code is found),
``construct_s`` (Decoder + a context of N - 1 tokens appended), ``first_step_s`` (the first `Decoder.step`: the
dispatcher loads the compiled kernel from the numba cache, or compiles it when the cache is cold),
``second_step_s``. ``process_start_to_first_step_s`` counts from the interpreter's start (psutil create_time,
10 ms resolution) to the end of the first step.
"""
import argparse
import json
import sys
import time

T0 = time.perf_counter()
T0_WALL = time.time()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float32")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--context", type=int, default=512)
    args = p.parse_args(argv)

    t = time.perf_counter()
    import numpy as np
    from decode import Decoder
    t_import = time.perf_counter() - t

    t = time.perf_counter()
    rng = np.random.default_rng(0)
    dec = Decoder(num_q_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                  page_size=64, max_tokens=args.context + 64)
    kv = rng.standard_normal((args.context - 1, args.kv_heads, args.head_dim), dtype=np.float32)
    dec.append(kv, kv)
    q = rng.standard_normal((args.heads, args.head_dim), dtype=np.float32)
    t_construct = time.perf_counter() - t

    t = time.perf_counter()
    dec.step(q, kv[0], kv[0])
    t_first = time.perf_counter() - t
    t_end_first = time.time()

    t = time.perf_counter()
    dec.step(q, kv[0], kv[0])
    t_second = time.perf_counter() - t

    out = {"import_s": t_import, "construct_s": t_construct, "first_step_s": t_first, "second_step_s": t_second,
           "script_start_to_first_step_s": time.perf_counter() - T0 - t_second}
    try:
        import psutil

        out["process_start_to_first_step_s"] = t_end_first - psutil.Process().create_time()
    except ImportError:                                        # pragma: no cover
        pass
    out.update(vars(args))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
