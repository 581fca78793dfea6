"""A decode step through `decode.hf.plan.ForwardPlan` (one new column per row: `decode.hf.token_column`, its q /
output buffers kept for the forward). Every model dtype, in place (a contiguous float32 q on float32-compute
pages) or copied (bfloat16 / float16 / float64 q, a strided q), against the float64 reference over the stored
history; each layer's output keeps its values after later layers run (no buffer behind a returned tensor); a
non-finite q / k / v (or a float64 q that overflows float32) is named at its index before its layer writes; a
kernel thread count above 1 holds for the whole forward and is given back at its commit or rollback, one thread
plans serial calls without touching numba's count; the buffers are kept between forwards, never handed out."""
import numba
import numpy as np
import pytest
import torch

from decode.hf.plan import ForwardPlan
from kvcache import KVCache
from kvcache.testing import FaultInjector
from reference.dense import attention_context

ROWS, HISTORY, LAYERS, HEADS, KV_HEADS, DIM = 2, 5, 3, 4, 2, 8
# one rounding of the output to the model's dtype, relative (float32 / float64: the kernels' float32 scores)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def tensors(width, seed, dtype, strided=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(ROWS, h, width, DIM * (2 if strided else 1), generator=g).to(dtype)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    return tuple(x[..., ::2] for x in (q, k, v)) if strided else (q, k, v)


def filled(pages: str, dtype) -> tuple:
    """A pool holding HISTORY tokens of each of ROWS rows in every layer, and its sequences."""
    pool = KVCache(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=pages, page_size=4,
                   max_tokens=256)
    seqs = [pool.create_sequence() for _ in range(ROWS)]
    plan = ForwardPlan(pool, seqs, np.ones((ROWS, HISTORY), dtype=bool))
    for layer in range(LAYERS):
        plan.run_layer(layer, *tensors(HISTORY, 10 + layer, dtype), None, 0)
    plan.commit()
    return pool, seqs


def expected(pool, seqs, layer, q) -> np.ndarray:
    """float64 ``[B, 1, Hq, D]`` over what the pool holds (the step's token, committed, included)."""
    out = []
    for b, seq in enumerate(seqs):
        k, v = (x.astype(np.float64).transpose(1, 0, 2).repeat(HEADS // KV_HEADS, axis=0)
                for x in pool.gather(seq, layer))
        out.append(attention_context(q[b].double().numpy()[None], k[None], v[None], query_start=HISTORY)[0])
    return np.stack(out).transpose(0, 2, 1, 3)


CASES = [("float32", torch.float32, False), ("float32", torch.float32, True), ("float32", torch.bfloat16, False),
         ("float32", torch.float64, False), ("bfloat16", torch.bfloat16, False), ("bfloat16", torch.float32, False),
         ("float16", torch.float16, False), ("float64", torch.float64, False)]


@pytest.mark.parametrize("pages, dtype, strided", CASES)
def test_a_decode_step_attends_as_the_reference_in_every_layer(pages, dtype, strided):
    pool, seqs = filled(pages, dtype)
    plan = ForwardPlan(pool, seqs, np.ones((ROWS, 1), dtype=bool))
    outs, queries = [], []
    for layer in range(LAYERS):
        q, k, v = tensors(1, 40 + layer, dtype, strided)
        outs.append(plan.run_layer(layer, q, k, v, None, 0))
        queries.append(q)
    plan.commit()
    for layer, (out, q) in enumerate(zip(outs, queries)):   # earlier outputs unchanged by the later layers
        want = expected(pool, seqs, layer, q)
        assert out.dtype == dtype and tuple(out.shape) == (ROWS, 1, HEADS, DIM)
        np.testing.assert_allclose(out.double().numpy(), want, rtol=RTOL[dtype], atol=1e-6)
    assert len({out.data_ptr() for out in outs}) == LAYERS
    assert [pool.length(s) for s in seqs] == [HISTORY + 1] * ROWS


BAD = {"q nan": ("query", 0, (1, 3, 0, 5), float("nan")), "k inf": ("key", 1, (0, 1, 0, 2), float("inf")),
       "v -inf": ("value", 2, (1, 0, 0, 7), float("-inf"))}


@pytest.mark.parametrize("pages", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype, bad", [(dtype, bad) for dtype in (torch.float32, torch.bfloat16, torch.float16,
                                                                   torch.float64) for bad in BAD]
                         + [(torch.float64, "q overflows float32")])
def test_a_bad_value_in_a_decode_step_is_named_before_its_layer_writes(pages, dtype, bad):
    pool, seqs = filled(pages, dtype)
    pool.fault_hook = points = FaultInjector()
    plan = ForwardPlan(pool, seqs, np.ones((ROWS, 1), dtype=bool))
    plan.run_layer(0, *tensors(1, 50, dtype), None, 0)
    written = len(points.points)
    before = [pool.pool.k_pages(1).copy(), pool.pool.v_pages(1).copy()]
    q, k, v = tensors(1, 51, dtype)
    if bad in BAD:
        name, which, index, value = BAD[bad]
        (q, k, v)[which][index] = value
        message = f"{name}: expected finite values, got {value} at index {index}"
    else:
        q[0, 2, 0, 1] = 1e39
        message = "query: expected values finite in float32"
    with pytest.raises(ValueError) as err:
        plan.run_layer(1, q, k, v, None, 0)
    assert message in str(err.value)
    assert len(points.points) == written                              # no fault point passed: nothing written
    assert all(np.array_equal(a, b) for a, b in zip(before, (pool.pool.k_pages(1), pool.pool.v_pages(1))))
    plan.rollback()
    assert [pool.length(s) for s in seqs] == [HISTORY] * ROWS


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two numba threads to tell the counts apart")
@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_the_kernel_thread_count_holds_for_the_forward_and_is_given_back(end):
    """`kernel_threads` > 1 is set at a forward's first layer (not per layer) and numba's count is given back when
    the forward commits or rolls back."""
    pool, seqs = filled("float32", torch.float32)
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        plan = ForwardPlan(pool, seqs, np.ones((ROWS, 1), dtype=bool), kernel_threads=2)
        for layer in range(LAYERS):
            plan.run_layer(layer, *tensors(1, 60 + layer, torch.float32), None, 0)
            assert numba.get_num_threads() == 2
        getattr(plan, end)()
        assert numba.get_num_threads() == 1
    finally:
        numba.set_num_threads(before)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two numba threads to tell the counts apart")
@pytest.mark.parametrize("width", [1, HISTORY])
def test_one_kernel_thread_plans_serial_calls_and_leaves_numbas_count(width):
    """`kernel_threads=1` plans every kernel call serial (run on the calling thread) without touching numba's
    count, whatever that count is; the outputs are bitwise those of a forward run with numba's count set to 1."""
    outs = {}
    before = numba.get_num_threads()
    try:
        for threads, count in ((1, 2), (None, 1)):
            pool, seqs = filled("float32", torch.float32)
            numba.set_num_threads(count)
            plan = ForwardPlan(pool, seqs, np.ones((ROWS, width), dtype=bool), kernel_threads=threads)
            outs[threads] = [plan.run_layer(layer, *tensors(width, 70 + layer, torch.float32), None, 0)
                             for layer in range(LAYERS)]
            assert numba.get_num_threads() == count
            made = plan.plans if threads == 1 else []
            plan.commit()
            assert numba.get_num_threads() == count
            for p in made:
                assert all(part.serial for part in (p.tiles, p.single) if part is not None)
    finally:
        numba.set_num_threads(before)
    for a, b in zip(outs[1], outs[None]):
        assert torch.equal(a, b)


def test_a_decode_steps_buffers_are_kept_between_forwards_and_never_handed_out():
    """The `TokenColumn` of a decode step is made once per shape in the `columns` given (the cache's) and reused
    by the next forward; every output stays as it was after later forwards overwrite the buffers."""
    pool, seqs = filled("float32", torch.bfloat16)
    columns, outs, seen = {}, [], []
    for step in range(3):
        plan = ForwardPlan(pool, seqs, np.ones((ROWS, 1), dtype=bool), columns=columns)
        q, k, v = tensors(1, 80 + step, torch.bfloat16)
        out = plan.run_layer(0, q, k, v, None, 0)
        outs.append((out, out.clone(), q))
        for layer in range(1, LAYERS):
            plan.run_layer(layer, *tensors(1, 90 + layer, torch.bfloat16), None, 0)
        plan.commit()
        seen.append(plan.column)
    assert len(columns) == 1 and all(c is seen[0] for c in seen)
    for out, kept, _ in outs:
        assert torch.equal(out, kept)
