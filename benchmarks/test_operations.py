"""What the cache operations cost: append, extend, truncate, fork (and the copy-on-write step after it),
a batched step over 8-64 sequences of mixed lengths (one kernel call vs one `Decoder.step` per sequence), and
the page size (64, used everywhere here, vs the Decoder's default 16).

Shape: 32 query heads, 8 kv heads, head_dim 128, float16 storage (GQA, a typical served model), context 4096.
"""
import numpy as np
import pytest

from . import common
from .common import Shape
from .test_decode_step import run_step_benchmark

PAGE = common.PAGE_SIZE


def op_shape(quick) -> Shape:
    return Shape(8, 2, 32, 256, "float16") if quick else Shape(32, 8, 128, 4096, "float16")


def token_bytes(shape: Shape) -> int:
    return shape.num_kv_heads * 2 * shape.head_dim * shape.itemsize


def make_decoder(shape: Shape, data: common.Data, length: int, extra: int, page_size=PAGE, layer=0):
    from decode import Decoder

    dec = Decoder(num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                  dtype=shape.dtype, page_size=page_size, max_tokens=length + extra + page_size)
    fill(dec, data, length, layer)
    return dec


def fill(dec, data: common.Data, length: int, layer=0):
    """Append tokens until ``dec.length == length`` (from the data's chunks)."""
    for start, k, v in data.chunks(layer, length):
        if start + len(k) > dec.length:
            cut = max(0, dec.length - start)
            dec.append(k[cut:], v[cut:])


def rounds_for(quick, seconds, budget=0.8, maximum=3000):
    return 1 if quick else common.choose_rounds(seconds, budget, minimum=5, maximum=maximum)


def trial(fn, setup, count=3):
    times = []
    for _ in range(count):
        args, kwargs = setup()
        times.append(common.time_calls(lambda: fn(*args, **kwargs), [()]))
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_append(benchmark, ceilings, quick, warm_engine, tokens):
    """`Decoder.append` of T tokens (no query) at length N: reserve pages, journaled write, commit."""
    shape = op_shape(quick)
    data = common.Data(shape, 1)
    dec = make_decoder(shape, data, shape.context, tokens)
    rng = np.random.default_rng(2)
    k = rng.standard_normal((tokens, shape.num_kv_heads, shape.head_dim), dtype=np.float32)

    def setup():
        if dec.length != shape.context:
            dec.truncate(shape.context)
        return (k, k), {}

    rounds = rounds_for(quick, trial(dec.append, setup))
    benchmark.group = "op append"
    common.pedantic(benchmark, dec.append, setup=setup, rounds=rounds)
    nbytes = tokens * token_bytes(shape)
    common.record(benchmark, ceilings, nbytes, 0, impl="engine_append", op="append", tokens=tokens,
                  bytes_written=nbytes, **shape.info())


@pytest.mark.parametrize("tokens", [16, 128])
def test_extend(benchmark, ceilings, quick, warm_engine, tokens):
    """`Decoder.extend`: T queries at positions N .. N + T - 1 over the cache and themselves (a prefill chunk)."""
    shape = op_shape(quick)
    data = common.Data(shape, 1)
    dec = make_decoder(shape, data, shape.context, tokens)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((tokens, shape.num_q_heads, shape.head_dim), dtype=np.float32)
    k = rng.standard_normal((tokens, shape.num_kv_heads, shape.head_dim), dtype=np.float32)

    def setup():
        if dec.length != shape.context:
            dec.truncate(shape.context)
        return (q, k, k), {}

    rounds = rounds_for(quick, trial(dec.extend, setup))
    benchmark.group = "op extend"
    common.pedantic(benchmark, dec.extend, setup=setup, rounds=rounds)
    n = shape.context
    keys = sum(n + i + 1 for i in range(tokens))
    common.record(benchmark, ceilings, (n + tokens) * token_bytes(shape), 4 * shape.num_q_heads * keys * shape.head_dim,
                  impl="engine_extend", op="extend", tokens=tokens, keys_attended=keys, **shape.info())


@pytest.mark.parametrize("drop", [1, 512, "all"])
def test_truncate(benchmark, ceilings, quick, warm_engine, drop):
    """`Decoder.truncate(n)`: drop the last ``drop`` tokens (pages wholly past n go back to the pool)."""
    shape = op_shape(quick)
    data = common.Data(shape, 1)
    top = shape.context + (0 if drop == "all" else drop)
    keep = 0 if drop == "all" else shape.context
    dec = make_decoder(shape, data, top, 0)

    def setup():
        fill(dec, data, top)
        return (keep,), {}

    rounds = rounds_for(quick, trial(dec.truncate, setup), budget=0.3, maximum=100)
    benchmark.group = "op truncate"
    common.pedantic(benchmark, dec.truncate, setup=setup, rounds=rounds)
    common.record(benchmark, ceilings, 0, 0, impl="engine_truncate", op="truncate", tokens=top - keep,
                  pages_freed=-(-top // PAGE) - (-(-keep // PAGE)), **shape.info())


def test_fork(benchmark, ceilings, quick, warm_engine):
    """`Decoder.fork()` of an N-token sequence: the child shares every page (reference counts, no K/V copy)."""
    shape = op_shape(quick)
    data = common.Data(shape, 1)
    dec = make_decoder(shape, data, shape.context - 1, 64 * PAGE)
    children = []

    def setup():
        while children:
            children.pop().free()
        return (), {}

    def fork():
        children.append(dec.fork())

    rounds = rounds_for(quick, trial(fork, setup))
    benchmark.group = "op fork"
    common.pedantic(benchmark, fork, setup=setup, rounds=rounds)
    setup()
    common.record(benchmark, ceilings, 0, 0, impl="engine_fork", op="fork", tokens=dec.length,
                  pages_shared=-(-dec.length // PAGE), **shape.info())


def test_step_after_fork(benchmark, ceilings, quick, warm_engine):
    """The first `step` of a fresh fork: copy-on-write of the shared partial last page, then the step."""
    shape = op_shape(quick)
    data = common.Data(shape, 1)
    dec = make_decoder(shape, data, shape.context - 1, 64 * PAGE)
    children = []

    def setup():
        while children:
            children.pop().free()
        children.append(dec.fork())
        return (data.q[0], data.k_in[0], data.v_in[0]), {}

    def step(q, k, v):
        return children[-1].step(q, k, v)

    rounds = rounds_for(quick, trial(step, setup))
    benchmark.group = "op fork"
    common.pedantic(benchmark, step, setup=setup, rounds=rounds)
    setup()
    common.record(benchmark, ceilings, shape.kv_bytes, shape.flops, impl="engine_step_after_fork",
                  op="step_after_fork", cow_bytes=PAGE * token_bytes(shape), **shape.info())


# ----------------------------------------------------------------------------------------------------------------
BATCHES = [8, 16, 32, 64]


def batch_case(quick, batch):
    shape = op_shape(quick)
    rng = np.random.default_rng(100 + batch)
    hi = shape.context
    lengths = rng.integers(min(64, hi // 2), hi, size=batch)             # mixed: each sequence its own length
    return shape, lengths


@pytest.mark.parametrize("how", ["batch_step", "step_loop"])
@pytest.mark.parametrize("batch", BATCHES)
def test_batched_step(benchmark, ceilings, quick, warm_engine, batch, how):
    """One token for each of B sequences of mixed lengths in one shared pool: `decode.batch_step` (one kernel
    call) vs a loop of B `Decoder.step` calls. B * mean length of K/V is read (> the last-level cache from B=8)."""
    if quick and batch > 8:
        pytest.skip("--quick: B=8 only")
    from decode import Decoder, batch_step
    from kvcache import KVCache

    shape, lengths = batch_case(quick, batch)
    ceil = ceilings.near(f"batched step B={batch}")
    data = common.Data(shape, 1)
    pool = KVCache(num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype=shape.dtype, page_size=PAGE,
                   num_pages=int(sum(-(-(int(n) + 2) // PAGE) for n in lengths)) + batch)
    decs = []
    for i, n in enumerate(lengths):
        dec = Decoder.on_cache(pool, shape.num_q_heads)
        for start, k, v in data.chunks(i, int(n)):
            dec.append(k, v)
        decs.append(dec)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((batch, shape.num_q_heads, shape.head_dim), dtype=np.float32)
    k = rng.standard_normal((batch, shape.num_kv_heads, shape.head_dim), dtype=np.float32)
    v = rng.standard_normal((batch, shape.num_kv_heads, shape.head_dim), dtype=np.float32)

    def setup():
        for dec, n in zip(decs, lengths):
            if dec.length != n:
                dec.truncate(int(n))
        return (), {}

    if how == "batch_step":
        def run():
            return batch_step(decs, q, k, v)
    else:
        def run():
            return [dec.step(q[i], k[i], v[i]) for i, dec in enumerate(decs)]

    setup()
    expected = np.array(batch_step(decs, q, k, v))
    setup()
    got = np.array(run())
    assert np.allclose(got, expected, atol=1e-5), "batch_step and the step loop disagree"
    rounds = rounds_for(quick, trial(run, setup), budget=1.0)
    benchmark.group = f"batched step B={batch}"
    common.pedantic(benchmark, run, setup=setup, rounds=rounds)
    keys = int(sum(lengths + 1))
    common.record(benchmark, ceil, keys * token_bytes(shape), 4 * shape.num_q_heads * keys * shape.head_dim,
                  impl=f"engine_{how}", op="batched_step", batch=batch, keys_attended=keys,
                  lengths_min=int(lengths.min()), lengths_max=int(lengths.max()), **shape.info())


# ----------------------------------------------------------------------------------------------------------------
def page_size_cases(quick):
    if quick:
        return [(Shape(8, 2, 32, 300, "float16"), p) for p in (16, 64)]
    return [(Shape(32, kv, 128, 4096, dt), p) for kv, dt in ((32, "float32"), (8, "float16")) for p in (16, 64)]


def pytest_generate_tests(metafunc):
    if "page_case" in metafunc.fixturenames:
        cases = page_size_cases(metafunc.config.getoption("--quick"))
        metafunc.parametrize("page_case", cases, ids=[f"{s.label}-page{p}" for s, p in cases])


@pytest.mark.kernel
def test_page_size(benchmark, ceilings, quick, warm_engine, page_case):
    """Cold `Decoder.step` with pages of 16 tokens (the Decoder default) vs 64 (used by this suite)."""
    shape, page = page_case
    run_step_benchmark(benchmark, ceilings, quick, shape, "engine_step", page_size=page,
                       group=f"page size {shape.label}")
    benchmark.extra_info["impl"] = f"engine_step_page{page}"
