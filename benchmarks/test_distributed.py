"""decode.distributed on one machine: the cost of a call to the workers, and a step's overhead against the
single-process step (the workers share this machine's cores, so no speed-up can show here; docs/distributed.md
turns these figures into a break-even model for several machines).

    round trip     ShardedDecoder.ping(payload): one call to every worker in parallel, payload there and back
    step           one decode step (GQA 8/2 heads, head_dim 64, float32) at a context length, single-process
                   Decoder vs ShardedDecoder(heads, 2 workers) vs ShardedDecoder(context, 2 workers)
    batch          one batched step of 8 sequences: decode.batch_step vs DecoderPool(2 workers).batch_step

One local Ray instance (loopback, `start_local_ray`) for the module; every sharded result is checked against
the single-process one before it is timed (bitwise for heads and the pool, with the single process run at the
workers' thread count, 2e-6 + 2e-5 relative for context).
"""
import numba
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from decode import Decoder, batch_step  # noqa: E402
from decode.distributed import DecoderPool, ShardedDecoder, start_local_ray, stop_local_ray  # noqa: E402
from kvcache import KVCache  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 8, 2, 64, 16
CALL_TIMEOUT_S = 600.0      # worker call timeout: a first call may compile cold while CI's other stages share the cores
ARGS = dict(num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype="float32", page_size=PAGE)


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    start_local_ray()
    yield
    assert stop_local_ray() == []


def lengths(quick):
    return [64] if quick else [256, 4096, 32768]


def rounds(quick):
    return 1 if quick else 200


@pytest.fixture(scope="module")
def two_workers():
    with ShardedDecoder(workers=2, shard="heads", max_tokens=64, timeout=CALL_TIMEOUT_S, **ARGS) as dec:
        yield dec


@pytest.mark.parametrize("payload_kib", [0, 16, 256])
def test_round_trip(benchmark, quick, two_workers, payload_kib):
    payload = np.zeros(payload_kib * 256, dtype=np.float32)              # payload_kib KiB
    for _ in range(5):
        two_workers.ping(payload)                                        # warm (untimed)
    benchmark.group = "distributed round trip"
    benchmark.extra_info.update(workers=2, payload_bytes=payload.nbytes)
    benchmark.pedantic(two_workers.ping, args=(payload,), rounds=rounds(quick), iterations=1, warmup_rounds=0)


def _tokens(rng, count=None):
    lead = () if count is None else (count,)
    return (rng.standard_normal(lead + (HEADS, DIM)).astype(np.float32),
            rng.standard_normal(lead + (KV_HEADS, DIM)).astype(np.float32),
            rng.standard_normal(lead + (KV_HEADS, DIM)).astype(np.float32))


@pytest.mark.parametrize("impl", ["single", "heads", "context"])
@pytest.mark.parametrize("length", [64, 256, 4096, 32768])
def test_step(benchmark, quick, impl, length):
    if length not in lengths(quick):
        pytest.skip("not in this grid")
    rng = np.random.default_rng(length)
    capacity = length + 2 * PAGE
    single = Decoder(**ARGS, max_tokens=capacity)
    prompt = _tokens(rng, length)
    single.append(*prompt[1:])
    dec = single if impl == "single" else ShardedDecoder(workers=2, shard=impl, max_tokens=capacity, timeout=CALL_TIMEOUT_S, **ARGS)
    try:
        if dec is not single:
            for start in range(0, length, 4096):                         # the prompt in pieces (object store)
                dec.append(prompt[1][start:start + 4096], prompt[2][start:start + 4096])
        q, k, v = _tokens(rng)
        if dec is not single:
            # the same kernel settings as a worker (its CPU share: 1 thread here): the serial kernel, bitwise
            threads = numba.get_num_threads()
            numba.set_num_threads(max(1, threads // 2))
            try:
                want = single.step(q, k, v)
            finally:
                numba.set_num_threads(threads)
            got = dec.step(q, k, v)
            assert np.array_equal(got, want) if impl == "heads" else np.allclose(got, want, rtol=2e-5, atol=2e-6)
            single.truncate(length)
        dec.truncate(length)

        def setup():
            dec.truncate(length)                                         # every round decodes position `length`
            return (q, k, v), {}
        benchmark.group = f"distributed step L={length}"
        benchmark.extra_info.update(impl=impl, workers=1 if dec is single else 2, context=length)
        benchmark.pedantic(dec.step, setup=setup, rounds=rounds(quick), iterations=1, warmup_rounds=1)
    finally:
        if dec is not single:
            dec.close()


@pytest.mark.parametrize("impl", ["single", "pool"])
def test_batch_step(benchmark, quick, impl):
    rng = np.random.default_rng(8)
    batch, length = 8, 64 if quick else 1024
    cache = KVCache(num_kv_heads=KV_HEADS, head_dim=DIM, page_size=PAGE, max_tokens=batch * (length + PAGE))
    singles = [Decoder.on_cache(cache, HEADS) for _ in range(batch)]
    pool = DecoderPool(workers=2, max_tokens=batch * (length + PAGE), timeout=CALL_TIMEOUT_S, **ARGS) if impl == "pool" else None
    try:
        seqs = singles if pool is None else [pool.new_sequence() for _ in range(batch)]
        for s, d in zip(seqs, singles):
            _, k, v = _tokens(rng, length)
            d.append(k, v) if pool is None else (d.append(k, v), s.append(k, v))
        q, k, v = _tokens(rng, batch)
        run = batch_step if pool is None else pool.batch_step
        if pool is not None:
            assert np.array_equal(pool.batch_step(seqs, q, k, v), batch_step(singles, q, k, v))
            for s in seqs:
                s.truncate(length)

        def setup():
            for s in seqs:
                s.truncate(length)
            return (seqs, q, k, v), {}
        benchmark.group = f"distributed batch of {batch} at L={length}"
        benchmark.extra_info.update(impl=impl, batch=batch, context=length)
        benchmark.pedantic(run, setup=setup, rounds=rounds(quick), iterations=1, warmup_rounds=1)
    finally:
        if pool is not None:
            pool.close()
