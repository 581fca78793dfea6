"""The planning layer's per-call shortcuts (`decode.attention_plan`) give the plans of the rules they shortcut: a
call of fewer queries than any routing table's shortest run skips the rule, a single query's cut is computed in
Python integers, and the accumulation zero of a storage format is remembered."""
import numba
import numpy as np
import pytest

from decode import attention_plan as AP

STORAGES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64), np.dtype(np.int8), AP.BFLOAT16)


def test_shortest_run_bounds_every_rule(monkeypatch):
    """Every table's every rule (each CPU's table chosen in turn) asks for runs of >= SHORTEST_MIN_RUN queries,
    so a call with fewer is never tiled whatever the rule; such a call's plan equals the plan that applies the
    rule's length explicitly."""
    for amx_cpu in (False, True):
        for avx512 in (False, True):
            monkeypatch.setattr(AP, "AMX_CPU", amx_cpu)
            monkeypatch.setattr(AP, "AVX512", avx512)
            for storage in STORAGES:
                for head_dim in (32, 64, 128, 256):
                    for group in (1, 2, 3, 4, 8, 16, 32, 64):
                        min_run, _ = AP.route_rule(group, head_dim, storage)
                        assert min_run >= AP.SHORTEST_MIN_RUN >= 1, (storage, head_dim, group)
    for storage in STORAGES:
        for n in range(1, AP.SHORTEST_MIN_RUN):
            seqs, pos = np.zeros(n, np.int32), 5000 + np.arange(n, dtype=np.int64)
            plans = [AP.AttentionPlan(seqs, pos, 0, (n, 32, 128), (8, 8, 16, 128), storage, min_run=m)
                     for m in (None, AP.route_min_run(4, 128, storage))]
            for plan in plans:
                assert plan.tiles is None and plan.rest is None
            a, b = (p.single for p in plans)
            for name in a.__slots__:
                x, y = getattr(a, name), getattr(b, name)
                assert (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y), name


@pytest.mark.parametrize("split", (16, 64, 256, 1024))
def test_one_querys_cut_equals_the_vector_rule(split):
    """`any_cut` of one query (Python integers) answers as the vectorised rule does (the same query twice)."""
    for window in (0, 1, 5, 16, 17, 255, 256, 1000, 5000):
        for p in list(range(0, 80)) + list(range(200, 2100, 7)) + [split - 1, split, split + 1, 3 * split - 1]:
            one = AP.any_cut(np.array([p], np.int64), window, split)
            two = AP.any_cut(np.array([p, p], np.int64), window, split)
            assert one == two, (p, window, split)
            lo = max(p + 1 - window, 0) if window else 0
            assert one == (lo // split != p // split), (p, window, split)       # the keys lo..p cross a multiple


def test_accumulator_of_a_format_is_the_rule():
    """`plan_accumulator` gives, computed and then remembered, the documented accumulation dtype: float32 for int8
    pages whatever the precision (its micro-kernels), float64 for float64 pages, for precision="highest" and for a
    head under WIDE_HEAD_DIM, float32 otherwise."""
    for storage in STORAGES:
        for precision in AP.PRECISIONS:
            for head_dim in (8, AP.WIDE_HEAD_DIM - 1, AP.WIDE_HEAD_DIM, 128):
                if storage == np.dtype(np.int8):
                    want = np.float32
                elif storage == np.dtype(np.float64) or precision == "highest" or head_dim < AP.WIDE_HEAD_DIM:
                    want = np.float64
                else:
                    want = np.float32
                for _ in range(2):                                             # computed, then remembered
                    got = AP.plan_accumulator(storage, precision, head_dim)
                    assert type(got) is want and got == 0, (storage, precision, head_dim)


def test_serial_plans_read_numbas_count_only_where_threads_could_help(monkeypatch):
    """A call too small for threads is serial without asking numba its thread count; a large one asks, and plans
    as `threads=` that count would."""
    asked = []
    count = numba.get_num_threads()
    monkeypatch.setattr(AP.numba, "get_num_threads", lambda: asked.append(1) or count)
    small = AP.QueryPlan(np.array([40], np.int64), 0, 8, 64, 64, 16, np.float32(0.0))
    assert small.serial and not asked
    pos = np.array([AP.SERIAL_WORK], np.int64)
    large = AP.QueryPlan(pos, 0, 32, 128, 128, 16, np.float32(0.0))
    assert asked
    same = AP.QueryPlan(pos, 0, 32, 128, 128, 16, np.float32(0.0), threads=count)
    assert large.serial == same.serial and np.array_equal(large.units, same.units)


def test_remembered_routing_follows_what_chooses_the_table(monkeypatch):
    """`route_rule` remembers its answers by the shapes and by what chooses the table (the CPU flags, the tiles,
    the tables themselves): a replaced table or another CPU flag gives that table's answer, not the remembered
    one."""
    f32 = np.dtype(np.float32)
    monkeypatch.setattr(AP, "AMX_CPU", False)
    monkeypatch.setattr(AP, "AVX512", False)
    avx2 = AP.route_rule(1, 128, f32)
    monkeypatch.setattr(AP, "ROUTE_MIN_RUN_AVX2", {("float32", 128): ((1, 9, (10,)),)})
    assert AP.route_rule(1, 128, f32) == (9, (10,)) != avx2
    monkeypatch.setattr(AP, "AVX512", True)
    monkeypatch.setattr(AP, "ROUTE_MIN_RUN", {("float32", 128): ((1, 8),)})
    assert AP.route_rule(1, 128, f32) == (8, ())
    monkeypatch.setattr(AP, "AVX512", False)
    assert AP.route_rule(1, 128, f32) == (9, (10,))
