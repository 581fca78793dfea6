"""Sharded decoding equals single-process decoding: head and sequence sharding bit for bit, context sharding
within TOL of the float64 reference (tests/distributed/workload.py), the K/V bytes equal in all three; bad
input raises the single-process exception (type and message) before anything is sent, and leaves every
worker byte for byte as it was. One local Ray instance (loopback) for the module."""
import numpy as np
import pytest

pytest.importorskip("ray")

from decode import Decoder  # noqa: E402
from decode.distributed import DecoderPool, ShardedDecoder, start_local_ray, stop_local_ray  # noqa: E402
from kvcache import KVCache  # noqa: E402

from .workload import CALL_TIMEOUT_S, MAX_FORKS, Workload  # noqa: E402

PAGE, MAX_TOKENS = 4, 64


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    start_local_ray()
    yield
    assert stop_local_ray() == []


def shapes(kind):
    return {"MHA": (3, 3), "GQA": (4, 2), "MQA": (4, 1)}[kind]


def settings(kind, dtype, layers, head_dim=8):
    heads, kv_heads = shapes(kind)
    return dict(num_q_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, page_size=PAGE,
                max_tokens=MAX_TOKENS, num_layers=layers)


FAST_GRID = [  # (shard, workers, attention kind, dtype, layers): every value of every axis at least once
    ("heads", 2, "GQA", "float16", 1),
    ("heads", 3, "MHA", "float32", 2),
    ("context", 2, "MQA", "float32", 1),
    ("context", 3, "GQA", "float16", 2),
    ("context", 2, "MHA", "float16", 1),
]
SLOW_GRID = [(s, w, a, d, l) for s in ("heads", "context") for w in (2, 3) for a in ("MHA", "GQA", "MQA")
             for d in ("float16", "float32") for l in (1, 2)
             if not (s == "heads" and w > shapes(a)[1]) and (s, w, a, d, l) not in FAST_GRID]


def run_sharded(shard, workers, kind, dtype, layers, operations, seed):
    rng = np.random.default_rng(seed)
    args = settings(kind, dtype, layers)
    # room for MAX_FORKS diverged sequences of up to MAX_TOKENS in the single pool and in every worker's pool
    # (context ranges stay MAX_TOKENS / workers: forks that diverge copy pages inside each worker's range)
    room = MAX_FORKS * MAX_TOKENS
    with ShardedDecoder(timeout=CALL_TIMEOUT_S, workers=workers, shard=shard, pages_per_worker=room // PAGE, **args) as sharded:
        counts = Workload(rng, [(sharded, Decoder(**dict(args, max_tokens=room)))], exact=shard == "heads",
                          max_length=MAX_TOKENS).run(operations)
    assert len(counts) >= 4, counts                                # a mixed workload ran


@pytest.mark.parametrize("shard,workers,kind,dtype,layers", FAST_GRID)
def test_sharded_decoder_equals_single_process(shard, workers, kind, dtype, layers):
    run_sharded(shard, workers, kind, dtype, layers, operations=40, seed=hash((shard, workers, kind)) % 2**32)


@pytest.mark.slow
@pytest.mark.parametrize("shard,workers,kind,dtype,layers", SLOW_GRID)
def test_sharded_decoder_equals_single_process_full_grid(shard, workers, kind, dtype, layers):
    run_sharded(shard, workers, kind, dtype, layers, operations=150, seed=7)


def run_pool(workers, kind, dtype, layers, operations, seed):
    rng = np.random.default_rng(seed)
    args = settings(kind, dtype, layers)
    total = 2 * MAX_TOKENS * workers                   # room for 4 sequences of MAX_TOKENS / 2 on one worker
    cache = KVCache(num_kv_heads=args["num_kv_heads"], head_dim=args["head_dim"], dtype=dtype, page_size=PAGE,
                    max_tokens=total, num_layers=layers)
    with DecoderPool(timeout=CALL_TIMEOUT_S, workers=workers, **dict(args, max_tokens=total)) as pool:
        pairs = [(pool.new_sequence(), Decoder.on_cache(cache, args["num_q_heads"])) for _ in range(workers)]
        assert [p[0].worker for p in pairs] == list(range(workers))          # spread over the workers
        work = Workload(rng, pairs, exact=True, max_length=MAX_TOKENS // 2, pool=pool, max_pairs=workers + 2)
        counts = work.run(operations)
        for sharded, _ in work.pairs[1:]:                          # forks stayed on their parents' workers
            assert sharded.worker in range(workers)
    assert counts.get("batch", 0) >= 2, counts


@pytest.mark.parametrize("workers,kind,dtype,layers", [(2, "MHA", "float32", 1), (3, "GQA", "float16", 2)])
def test_pool_equals_single_process(workers, kind, dtype, layers):
    run_pool(workers, kind, dtype, layers, operations=40, seed=workers)


@pytest.mark.slow
@pytest.mark.parametrize("workers,kind,dtype,layers", [(w, a, d, l) for w in (2, 3) for a in ("MHA", "GQA", "MQA")
                                                       for d in ("float16", "float32") for l in (1, 2)])
def test_pool_equals_single_process_full_grid(workers, kind, dtype, layers):
    run_pool(workers, kind, dtype, layers, operations=120, seed=11)


def test_fork_stays_on_its_parents_worker_and_batch_rows_keep_their_order():
    args = settings("GQA", "float32", 1)
    with DecoderPool(timeout=CALL_TIMEOUT_S, workers=2, **args) as pool:
        a, b = pool.new_sequence(), pool.new_sequence()
        assert (a.worker, b.worker) == (0, 1)
        c = b.fork()
        assert c.worker == 1
        rng = np.random.default_rng(3)
        q, k, v = rng.standard_normal((3, 4, 8)), rng.standard_normal((3, 2, 8)), rng.standard_normal((3, 2, 8))
        cache = KVCache(num_kv_heads=2, head_dim=8, page_size=PAGE, max_tokens=MAX_TOKENS)
        single = [Decoder.on_cache(cache, 4) for _ in range(2)]
        single.append(single[1].fork())
        from decode import batch_step
        order = [2, 0, 1]                                       # rows of different workers interleaved
        got = pool.batch_step([[a, b, c][i] for i in order], q, k, v)
        want = batch_step([single[i] for i in order], q, k, v)
        assert np.array_equal(got, want)


BAD_INPUTS = [  # (label, call on a decoder with heads=4, kv_heads=2, head_dim=8)
    ("q shape", lambda d, q, k, v: d.step(q[:3], k, v)),
    ("k int", lambda d, q, k, v: d.step(q, k.astype(int), v)),
    ("v nan", lambda d, q, k, v: d.step(q, k, np.where(v > 0, np.nan, v))),
    ("k overflows float16", lambda d, q, k, v: d.step(q, k * 1e6, v)),
    ("q list", lambda d, q, k, v: d.step(q.tolist()[:2], k, v)),
    ("extend k 2-d", lambda d, q, k, v: d.extend(q[None], k, v)),
    ("extend q rows", lambda d, q, k, v: d.extend(q[None].repeat(2, 0), k[None], v[None])),
    ("append v shape", lambda d, q, k, v: d.append(k[None], v[None, :1])),
    ("truncate too far", lambda d, q, k, v: d.truncate(d.length + 1)),
    ("truncate bool", lambda d, q, k, v: d.truncate(True)),
    ("num_tokens", lambda d, q, k, v: d.transaction(-1)),
    ("kv layer", lambda d, q, k, v: d.kv(1)),
]


def error_of(call, *args):
    try:
        call(*args)
    except Exception as e:                                      # noqa: BLE001 (compared below)
        return type(e), str(e)
    return None


@pytest.mark.parametrize("shard", ["heads", "context"])
def test_bad_input_raises_the_single_process_error_and_changes_nothing(shard):
    args = settings("GQA", "float16", 1)
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((4, 8)), rng.standard_normal((2, 8)), rng.standard_normal((2, 8))
    with ShardedDecoder(timeout=CALL_TIMEOUT_S, workers=2, shard=shard, **args) as sharded:
        single = Decoder(**args)
        for d in (sharded, single):
            d.extend(*(rng.standard_normal((6,) + s) for s in ((4, 8), (2, 8), (2, 8))))
        before = sharded.worker_states()
        for label, call in BAD_INPUTS:
            want = error_of(call, single, q, k, v)
            assert want is not None, label
            assert error_of(call, sharded, q, k, v) == want, label
        assert sharded.worker_states() == before
        # multi-layer transactions: the errors of DecoderTransaction, and everything rolled back
        layered = dict(args, num_layers=2)
        with ShardedDecoder(timeout=CALL_TIMEOUT_S, workers=2, shard=shard, **layered) as sharded2:
            single2 = Decoder(**layered)
            before = sharded2.worker_states()
            for label, body in [("layer out of range", lambda tx: tx.step(2, q, k, v)),
                                ("missing layer", lambda tx: tx.step(0, q, k, v)),
                                ("bad k in layer 1", lambda tx: (tx.step(0, q, k, v), tx.step(1, q, k[:1], v)))]:
                def in_tx(d):
                    with d.transaction(1) as tx:
                        body(tx)
                assert error_of(in_tx, sharded2) == error_of(in_tx, single2), label
                assert sharded2.length == single2.length == 0
                assert sharded2.worker_states() == before, label
            assert error_of(lambda d: d.step(q, k, v), sharded2) == error_of(lambda d: d.step(q, k, v), single2)


def test_configuration_errors():
    args = settings("GQA", "float32", 1)
    with pytest.raises(ValueError, match="workers: expected at most num_kv_heads=2 workers for shard='heads', got 3"):
        ShardedDecoder(timeout=CALL_TIMEOUT_S, workers=3, shard="heads", **args)
    with pytest.raises(ValueError, match="shard: expected 'heads' or 'context', got 'rows'"):
        ShardedDecoder(timeout=CALL_TIMEOUT_S, workers=2, shard="rows", **args)
    with pytest.raises(ValueError, match="window: expected None with shard='context'"):
        ShardedDecoder(timeout=CALL_TIMEOUT_S, workers=2, shard="context", window=8, **args)
    for storage in ("int8", "bfloat16"):
        with pytest.raises(ValueError, match="dtype: expected float16, float32 or float64 for decode.distributed"):
            ShardedDecoder(timeout=CALL_TIMEOUT_S, workers=2, shard="heads", **dict(args, dtype=storage))
    for bad in (dict(num_q_heads=3), dict(dtype="int16"), dict(page_size=0), dict(max_tokens=0)):
        single = error_of(lambda: Decoder(**dict(args, **bad)))
        assert single is not None and error_of(lambda: ShardedDecoder(2, "heads", **dict(args, **bad))) == single


def test_context_capacity_is_the_sum_of_the_workers_ranges():
    args = settings("GQA", "float32", 1)
    rng = np.random.default_rng(9)
    with ShardedDecoder(timeout=CALL_TIMEOUT_S, workers=2, shard="context", **dict(args, max_tokens=16)) as sharded:
        sharded.append(rng.standard_normal((16, 2, 8)), rng.standard_normal((16, 2, 8)))
        states = sharded.worker_states()
        assert [s["free_pages"] for s in states.values()] == [0, 0]          # 8 positions on each worker
        from kvcache import CacheFullError
        with pytest.raises(CacheFullError, match="context shards"):
            sharded.step(rng.standard_normal((4, 8)), rng.standard_normal((2, 8)), rng.standard_normal((2, 8)))
        assert sharded.worker_states() == states and sharded.length == 16


def test_the_example_of_docs_distributed_runs():
    import re
    from pathlib import Path
    doc = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert blocks and "pool.batch_step" in blocks[0], "docs/distributed.md lost its example"
    exec(compile(blocks[0], str(doc), "exec"), {})
