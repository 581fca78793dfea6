"""A/B of the attention kernels of two source trees (e.g. a checkout of main vs a branch), interleaved round by
round because the machine is noisy: two worker processes (one per tree, each importing `decode` from its own
tree) alternate, ABAB then BABA, on the same shapes and the same seeded data; each round is `CALLS` timed
calls of the unchecked kernel entry (`decode.attention_plan.attend_unchecked`, or
`decode.attention._paged_decode_attention_unchecked` in trees before it) per shape over a rotation of layers (so K/V are mostly not in
cache). Reports per shape the median per-call time of each tree and the median of the per-round ratios B/A.

    python -m benchmarks.ab_trees TREE_A TREE_B ROUNDS
    AB_CPU=1 ...            process CPU time instead of wall clock (use with NUMBA_NUM_THREADS=1 on a busy box)
    AB_ONLY=MQA,GQA8 ...    only the shapes whose label contains one of these
    AB_PRECISION=highest    pass precision="highest" to the trees whose entry point takes it (float64 q.k)

Not collected by pytest (no timing claims of its own): a tool for measuring a kernel change side by side.
"""
import json
import math
import os
import statistics
import subprocess
import sys
import time

CALLS = 15
#         label,               q heads, kv heads, head_dim, context, dtype, page, new tokens, layers
SHAPES = [("MHA-fp32-4096", 32, 32, 128, 4096, "float32", 16, 1, 2),
          ("GQA8-fp32-4096", 32, 4, 128, 4096, "float32", 16, 1, 8),
          ("GQA8-fp16-4096", 32, 4, 128, 4096, "float16", 16, 1, 8),
          ("MQA-fp32-4096", 32, 1, 128, 4096, "float32", 16, 1, 32),
          ("MQA-fp16-4096", 32, 1, 128, 4096, "float16", 16, 1, 32),
          ("MQA-fp32-32768", 32, 1, 128, 32768, "float32", 16, 1, 4),
          ("GQA8-fp32-4096+128", 32, 4, 128, 4096, "float32", 16, 128, 4),
          ("GQA8-fp16-4096+128", 32, 4, 128, 4096, "float16", 16, 128, 4),
          ("GQA8-fp32-0->512", 32, 4, 128, 0, "float32", 16, 512, 4),
          ("MHA-bf16-4096", 32, 32, 128, 4096, "bfloat16", 16, 1, 2),
          ("GQA8-bf16-4096", 32, 4, 128, 4096, "bfloat16", 16, 1, 8),
          ("MQA-bf16-4096", 32, 1, 128, 4096, "bfloat16", 16, 1, 32),
          ("GQA8-bf16-4096+128", 32, 4, 128, 4096, "bfloat16", 16, 128, 4),
          ("GQA4-fp32-0->2048", 32, 8, 128, 0, "float32", 32, 2048, 1),        # vLLM's prefill / extend shapes
          ("GQA4-fp16-0->2048", 32, 8, 128, 0, "float16", 32, 2048, 1),
          ("GQA4-bf16-0->2048", 32, 8, 128, 0, "bfloat16", 32, 2048, 1),
          ("GQA4-fp32-0->512", 32, 8, 128, 0, "float32", 32, 512, 2),
          ("GQA4-fp16-0->512", 32, 8, 128, 0, "float16", 32, 512, 2),
          ("GQA4-bf16-0->512", 32, 8, 128, 0, "bfloat16", 32, 512, 2),
          ("GQA4-fp32-4096+512", 32, 8, 128, 4096, "float32", 32, 512, 1),
          ("GQA4-bf16-4096+16", 32, 8, 128, 4096, "bfloat16", 32, 16, 4),
          # hot: one layer of 32 q / 8 kv heads (issue 20's GQA-8; K+V 32 MiB float32, 16 MiB 16-bit: L3-sized)
          ("HOT-GQA8-fp32-4096", 32, 8, 128, 4096, "float32", 16, 1, 1),
          ("HOT-GQA8-fp16-4096", 32, 8, 128, 4096, "float16", 16, 1, 1),
          ("HOT-GQA8-bf16-4096", 32, 8, 128, 4096, "bfloat16", 16, 1, 1)]


def _pages(np, rng, shape, dt):
    """Seeded pages of a storage format: float32 / float16 arrays, bfloat16 as its nearest-even uint16 bits."""
    x = rng.standard_normal(shape, dtype=np.float32)
    if dt != "bfloat16":
        return x.astype(dt)
    b = x.view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)


def _selected():
    only = os.environ.get("AB_ONLY")
    return [s for s in SHAPES if not only or any(k in s[0] for k in only.split(","))]


def _cases(np):
    """Per shape: (label, [(k_pages, v_pages)] per layer, page_indices, page_indptr, q, query_seq, query_pos, out,
    scale); one sequence of context + new tokens, pages in random physical order, queries at the new positions."""
    rng = np.random.default_rng(0)
    cases = []
    for label, hq, hkv, d, n, dt, P, T, layers in _selected():
        npages = -(-(n + T) // P)
        pools = [tuple(_pages(np, rng, (npages, hkv, P, d), dt) for _ in range(2)) for _ in range(layers)]
        cases.append((label, pools, rng.permutation(npages).astype(np.int32), np.array([0, npages], np.int64),
                      rng.standard_normal((T, hq, d)).astype(np.float32), np.zeros(T, np.int32),
                      np.arange(n, n + T, dtype=np.int64), np.empty((T, hq, d), np.float32), 1 / math.sqrt(d)))
    return cases


def worker(tree):
    sys.path.insert(0, tree)
    import numpy as np
    import decode.attention as A
    assert A.__file__.startswith(os.path.abspath(tree)), A.__file__
    try:
        from decode.attention_plan import attend_unchecked
    except ImportError:                     # a tree before the planning module
        attend_unchecked = getattr(A, "_paged_decode_attention_unchecked")
    import inspect
    precision = os.environ.get("AB_PRECISION")
    kw = {"precision": precision} if precision and "precision" in inspect.signature(attend_unchecked).parameters \
        else {}
    clock = time.process_time if os.environ.get("AB_CPU") else time.perf_counter
    cases = _cases(np)

    def call(case, i):
        _, pools, pi, ptr, q, qseq, qpos, out, scale = case
        k, v = pools[i % len(pools)]
        extra = {"storage": "bfloat16"} if "bf16" in case[0] else {}
        attend_unchecked(q, k, v, pi, ptr, qseq, qpos, scale, 0, out, **kw, **extra)

    for case in cases:                  # compile / warm outside the timings
        for i in range(3):
            call(case, i)
    print("ready", flush=True)
    for line in sys.stdin:
        res = {}
        for case in cases:
            ts = []
            for i in range(int(line)):
                t0 = clock()
                call(case, i)
                ts.append(clock() - t0)
            res[case[0]] = statistics.median(ts)
        print(json.dumps(res), flush=True)


def driver(tree_a, tree_b, rounds):
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", t], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for t in (tree_a, tree_b)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    per = {s[0]: ([], []) for s in _selected()}
    for r in range(rounds):
        for w in ((0, 1) if r % 2 == 0 else (1, 0)):
            procs[w].stdin.write(f"{CALLS}\n")
            procs[w].stdin.flush()
            for k, v in json.loads(procs[w].stdout.readline()).items():
                per[k][w].append(v)
    for p in procs:
        p.stdin.close()
        p.wait()
    print(f"{'shape':22s} {'A ms':>8s} {'B ms':>8s}  B/A median [min..max] of per-round ratios")
    for k, (ta, tb) in per.items():
        ratios = [y / x for x, y in zip(ta, tb)]
        print(f"{k:22s} {1e3 * statistics.median(ta):8.3f} {1e3 * statistics.median(tb):8.3f}  "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}..{max(ratios):.3f}]")


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        driver(sys.argv[1], sys.argv[2], int(sys.argv[3]))
