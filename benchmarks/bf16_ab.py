"""bfloat16 pages vs float16 / float32 in the per-query (decode) kernel, and the bf16 score modes (`decode.kernels.bf16_dot`),
A/B interleaved in one process over `AttentionPlan.run` (round by round, order alternating); medians of rounds,
and each variant's median per-round ratio to the first variant ("V/first").
Variants: f32, f16, bf16:M (mode M, float32 q), bf16:Mx (mode M, q rounded to bfloat16). Not collected by pytest.

    python -m benchmarks.bf16_ab [--tokens 4096,32768] [--pages 16,32] [--shapes MHA,GQA-kv8,GQA-kv4,MQA] [--sets hot,cold]
                                 [--threads 1 --cpu] [--rounds 5] [--calls 7] [--cold-mib 256] [--variants ...]
"""
import argparse, json, math, time
import numpy as np
import numba
from decode import attention_plan as AP
from decode.kernels import bf16_dot

SH = {"MHA": (32, 32), "GQA-kv8": (32, 8), "GQA-kv4": (32, 4), "MQA": (32, 1)}
ap = argparse.ArgumentParser()
ap.add_argument("--tokens", default="4096,32768"); ap.add_argument("--pages", default="16,32")
ap.add_argument("--shapes", default="MHA,GQA-kv8,GQA-kv4,MQA"); ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--calls", type=int, default=7); ap.add_argument("--cold-mib", type=int, default=256)
ap.add_argument("--variants", default="f32,f16,bf16:0,bf16:1,bf16:1x,bf16:2")
ap.add_argument("--sets", default="hot,cold"); ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--cpu", action="store_true", help="process CPU time (use with --threads 1 on a busy machine)")
a = ap.parse_args()
numba.set_num_threads(a.threads)
clock = time.process_time if a.cpu else time.perf_counter
D = 128
rng = np.random.default_rng(0)

def bf16_bits(x):
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

def make(fmt, Hkv, P, L, copies):
    npg = -(-L // P)
    pools = []
    for c in range(copies):
        x = rng.standard_normal((npg, Hkv, P, D), dtype=np.float32)
        y = rng.standard_normal((npg, Hkv, P, D), dtype=np.float32)
        if fmt == "f16": x, y = x.astype(np.float16), y.astype(np.float16)
        if fmt == "bf16": x, y = bf16_bits(x), bf16_bits(y)
        pools.append((x, y, rng.permutation(npg).astype(np.int32)))
    return pools

results = []
for shape in a.shapes.split(","):
    Hq, Hkv = SH[shape]
    for L in map(int, a.tokens.split(",")):
        for P in map(int, a.pages.split(",")):
            for st in a.sets.split(","):
                per = 2 * L * Hkv * D * 2
                copies = 1 if st == "hot" else max(2, -(-a.cold_mib * 2**20 // per) + 1)
                if st == "hot" and per > 64 * 2**20:
                    continue
                data = {f: make(f, Hkv, P, L, copies) for f in ("f32", "f16", "bf16")}
                qf = rng.standard_normal((1, Hq, D), dtype=np.float32)
                qx = (bf16_bits(qf).astype(np.uint32) << 16).view(np.float32)
                runs = {}
                for v in a.variants.split(","):
                    fmt, _, mode = v.partition(":")
                    exact = mode.endswith("x"); mode = int(mode.rstrip("x")) if mode else 0
                    storage = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": "bfloat16"}[fmt]
                    bf16_dot.MODE = mode
                    plan = AP.AttentionPlan(np.zeros(1, np.int32), np.array([L - 1]), 0, (1, Hq, D),
                                            data[fmt][0][1].shape, storage)
                    views = [(AP.kernel_view(k, storage), AP.kernel_view(v_, storage), pt) for k, v_, pt in data[fmt]]
                    q = qx if exact else qf
                    out = np.empty((1, Hq, D), np.float32)
                    indptr = np.array([0, len(views[0][2])])
                    def call(i, plan=plan, views=views, q=q, out=out, indptr=indptr):
                        k, v_, pt = views[i % len(views)]
                        return plan.run(q, k, v_, pt, indptr, 1 / math.sqrt(D), 0, out)
                    call(0)
                    runs[v] = (call, [])
                ctr = 0
                for r in range(a.rounds):
                    for v, (call, ts) in (list(runs.items()) if r % 2 == 0 else list(runs.items())[::-1]):
                        tt = []
                        for _ in range(a.calls):
                            ctr += 1
                            t0 = clock(); call(ctr); tt.append(clock() - t0)
                        ts.append(np.median(tt))
                row = {"shape": shape, "tokens": L, "page": P, "set": st}
                base = runs[next(iter(runs))][1]
                for v, (_, ts) in runs.items():
                    row[v] = round(float(np.median(ts)) * 1e3, 3)
                for v, (_, ts) in list(runs.items())[1:]:     # median of per-round ratios to the first variant
                    row[v + "/first"] = round(float(np.median(np.array(ts) / np.array(base))), 3)
                results.append(row)
                print(json.dumps(row), flush=True)
