"""Fault injection at every fault point of every Decoder-level operation, enumerated (tests/kvcache does the
cache-level operations one by one; these go through the Decoder: its lean single-token path, transactions,
batching, forks, sliding windows).

For each scenario a clean run with a counting `FaultInjector` lists the points the operation passes (each
allocation, copy-on-write copy, layer write, the length publication, each ref-count drop) and the kernel calls it
makes; then, for each point and each kernel call, a fresh identical setup fails there: the call raises, the
cache keeps its fingerprint (every pool byte, free-list order, ref counts, tables, lengths) and its free-page
count, the invariants hold; with the hook removed the same call succeeds with the clean run's result and
leaves the clean run's fingerprint. A fault after the commit, in a sliding window's release of old pages, is
absorbed: the call succeeds (its tokens are in the cache) and the release happens at the next commit.
"""
import numpy as np
import pytest

from decode.attention_plan import AttentionPlan
from decode import Decoder, batch_extend, batch_step, batch_transaction
from kvcache import CacheFullError, KVCache
from kvcache.testing import FaultInjector, InjectedFault, set_fault_hook
from kvcache.faults import no_fault

pytestmark = pytest.mark.kernel


class KernelFault(RuntimeError):
    pass


def tokens(rng, count, cfg, num_q_heads=4, layers=None):
    lead = (count,) if layers is None else (layers, count)
    return (rng.standard_normal(lead + (num_q_heads, cfg.head_dim)),
            rng.standard_normal(lead + (cfg.num_kv_heads, cfg.head_dim)),
            rng.standard_normal(lead + (cfg.num_kv_heads, cfg.head_dim_v)))


def observe(result):
    """What a call returned, comparable between runs (a Decoder by its sequence, length and K/V)."""
    if isinstance(result, Decoder):
        return ("decoder", result.seq, result.length) + tuple(np.concatenate(result.kv(l), axis=None)
                                                              for l in range(result.config.num_layers))
    return result


# the one way the Decoder reaches a kernel: a plan (every batch shape, made on the first layer) run per layer
KERNEL_ENTRIES = ((AttentionPlan, "run"),)


def patch_kernels(monkeypatch, wrap):
    """Replace every kernel entry by ``wrap(real)``; returns the function that puts the real ones back."""
    reals = [(owner, name, getattr(owner, name)) for owner, name in KERNEL_ENTRIES]
    for owner, name, real in reals:
        monkeypatch.setattr(owner, name, wrap(real))

    def restore():
        for owner, name, real in reals:
            monkeypatch.setattr(owner, name, real)
    return restore


def run_counting(ctx, op, monkeypatch):
    """Run ``op(ctx)`` counting fault points and kernel calls."""
    calls = []

    def wrap(real):
        def counting(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)
        return counting
    restore = patch_kernels(monkeypatch, wrap)
    counter = FaultInjector()
    set_fault_hook(ctx["cache"], counter)
    try:
        result = observe(op(ctx))
    finally:
        set_fault_hook(ctx["cache"], no_fault)
        restore()
    return result, counter.points, len(calls)


def failing_kernel(monkeypatch, fail_at):
    """Make the ``fail_at``-th kernel entry call raise; returns the restore function."""
    calls = []

    def wrap(real):
        def kernel(*args, **kwargs):
            calls.append(1)
            if len(calls) - 1 == fail_at:
                raise KernelFault(f"kernel call #{fail_at} failed")
            return real(*args, **kwargs)
        return kernel
    return patch_kernels(monkeypatch, wrap)


def enumerate_faults(build, op, monkeypatch, *, absorbed_after=None):
    """The protocol of the module docstring; returns the fault points. ``absorbed_after``: the fault points
    after the first ``"publish"`` are absorbed (sliding-window release after the commit)."""
    ctx = build()
    expected, points, kernel_calls = run_counting(ctx, op, monkeypatch)
    expected_fp = ctx["cache"].fingerprint()
    ctx["cache"].check_invariants()
    assert points, "the operation passed no fault point"
    commit = points.index("publish") if absorbed_after else len(points)
    cases = [("fault", i) for i in range(len(points))] + [("kernel", i) for i in range(kernel_calls)]
    for how, i in cases:
        ctx = build()
        cache = ctx["cache"]
        before, free = cache.fingerprint(), cache.num_free_pages
        if how == "fault":
            set_fault_hook(cache, FaultInjector(fail_at=i))
            error, where = InjectedFault, f"fault #{i} at {points[i]!r}"
        else:
            restore = failing_kernel(monkeypatch, i)
            error, where = KernelFault, f"kernel call #{i}"
        try:
            if how == "fault" and i > commit:
                np.testing.assert_equal(observe(op(ctx)), expected, err_msg=where)   # absorbed
            else:
                with pytest.raises(error):
                    op(ctx)
                assert cache.fingerprint() == before, f"{where} changed the cache"
                assert cache.num_free_pages == free
        finally:
            set_fault_hook(cache, no_fault)
            if how == "kernel":
                restore()
        cache.check_invariants()
        if how == "fault" and i > commit:
            continue
        np.testing.assert_equal(observe(op(ctx)), expected, err_msg=f"retry after {where}")
        assert cache.fingerprint() == expected_fp, f"retry after {where} differs from a clean run"
    return points


def count(points, name):
    return sum(1 for p in points if p == name)


# -- setups ------------------------------------------------------------------------------------------------------
def shared(tokens_each, *, layers=1, dtype="float32", window=None, num_pages=16, fork_last=False, seed=0):
    """A shared pool of 4-token pages with one decoder per entry of ``tokens_each`` (filled by extend); with
    ``fork_last`` the last decoder is a fork of the first (sharing its pages, its last one partially filled)."""
    rng = np.random.default_rng(seed)
    cache = KVCache(num_layers=layers, num_kv_heads=2, head_dim=8, head_dim_v=6, page_size=4, num_pages=num_pages,
                    dtype=dtype)
    decs = []
    for count_ in tokens_each:
        dec = Decoder.on_cache(cache, 4, window=window)
        if count_:
            with dec.transaction(count_) as tx:
                q, k, v = tokens(rng, count_, cache.config, layers=layers)
                for layer in range(layers):
                    tx.extend(layer, q[layer], k[layer], v[layer])
        decs.append(dec)
    if fork_last:
        decs.append(decs[0].fork())
    return {"cache": cache, "decs": decs, "rng": rng}


def with_inputs(ctx, count, layers=None):
    ctx["q"], ctx["k"], ctx["v"] = tokens(ctx["rng"], count, ctx["cache"].config, layers=layers)
    return ctx


# -- single-layer operations -------------------------------------------------------------------------------------
@pytest.mark.parametrize("length, fork, expect", [
    (5, False, ["write_k", "write_v", "publish"]),                       # the lean path: no page, no journal
    (8, False, ["allocate", "write_k", "write_v", "publish"]),          # a fresh page
    (5, True, ["allocate", "cow_copy", "write_k", "write_v", "publish"]),  # the shared partial page is copied
])
def test_step(length, fork, expect, monkeypatch):
    def build():
        return with_inputs(shared([length], fork_last=fork), 1)

    def op(ctx):
        dec = ctx["decs"][-1]
        return dec.step(ctx["q"][0], ctx["k"][0], ctx["v"][0])

    assert enumerate_faults(build, op, monkeypatch) == expect


def test_extend_across_pages_from_a_shared_partial_page(monkeypatch):
    def build():
        return with_inputs(shared([7, 3], fork_last=True), 6)

    points = enumerate_faults(build, lambda ctx: ctx["decs"][-1].extend(ctx["q"], ctx["k"], ctx["v"]), monkeypatch)
    assert count(points, "cow_copy") == 1 and count(points, "allocate") == 3 and count(points, "write_k") == 3


def test_append(monkeypatch):
    def build():
        return with_inputs(shared([2, 5]), 9)

    points = enumerate_faults(build, lambda ctx: ctx["decs"][0].append(ctx["k"], ctx["v"]), monkeypatch)
    assert count(points, "allocate") == 2 and count(points, "write_k") == 3


def test_extend_of_zero_tokens(monkeypatch):
    def build():
        return with_inputs(shared([3]), 0)

    assert enumerate_faults(build, lambda ctx: ctx["decs"][0].extend(ctx["q"], ctx["k"], ctx["v"]),
                            monkeypatch) == ["publish"]


def test_truncate_shared_and_private_pages(monkeypatch):
    def build():
        ctx = with_inputs(shared([10], fork_last=True), 6)
        ctx["decs"][1].append(ctx["k"], ctx["v"])                   # 3 shared + 1 copied + 1 fresh page
        return ctx

    points = enumerate_faults(build, lambda ctx: ctx["decs"][1].truncate(1), monkeypatch)
    assert points == ["decref"] * 3 + ["publish"]


def test_fork(monkeypatch):
    def build():
        return shared([9, 2])

    assert enumerate_faults(build, lambda ctx: ctx["decs"][0].fork(), monkeypatch) == ["fork_incref"] * 3 + ["publish"]


def test_free(monkeypatch):
    def build():
        return shared([9, 2], fork_last=True)

    assert enumerate_faults(build, lambda ctx: ctx["decs"][0].free(), monkeypatch) == ["decref"] * 3 + ["publish"]


def test_batch_step_lean_fresh_and_copied(monkeypatch):
    def build():
        return with_inputs(shared([5, 8, 2], fork_last=True), 4)    # decoder 3 shares decoder 0's partial page

    def op(ctx):
        return batch_step(ctx["decs"], ctx["q"], ctx["k"], ctx["v"])

    points = enumerate_faults(build, op, monkeypatch)
    assert count(points, "cow_copy") == 2 and count(points, "allocate") == 3    # 0 and 3 copy; 1 a fresh page
    assert count(points, "write_k") == 1 and points[-1] == "publish"     # one scatter for the batch (TokenBatch)


def ragged_inputs(ctx, counts, layers=None):
    """Per-decoder token counts: ctx q/k/v ragged ([layers,] sum(counts), ...), ctx counts."""
    ctx["counts"] = counts
    return with_inputs(ctx, sum(counts), layers=layers)


def test_batch_extend_fresh_copied_and_empty(monkeypatch):
    def build():
        return ragged_inputs(shared([5, 8, 0], fork_last=True), [3, 6, 0, 2])   # 3 shares 0's partial page

    def op(ctx):
        return batch_extend(ctx["decs"], ctx["q"], ctx["k"], ctx["v"], num_tokens=ctx["counts"])

    points = enumerate_faults(build, op, monkeypatch)
    # writes per page touched: 5..7 | 8..11, 12..13 | none | (the copy) 5..6
    assert count(points, "cow_copy") == 2 and count(points, "write_k") == 4 and points[-1] == "publish"


def test_batch_extend_lists(monkeypatch):
    def build():
        return ragged_inputs(shared([2, 9]), [7, 1])

    def op(ctx):
        parts = [np.split(ctx[x], [7]) for x in "qkv"]
        return np.concatenate(batch_extend(ctx["decs"], *parts))

    enumerate_faults(build, op, monkeypatch)


def test_window_batch_extend_releasing_pages(monkeypatch):
    def build():
        return ragged_inputs(shared([6, 3], window=3), [5, 9])

    def op(ctx):
        return batch_extend(ctx["decs"], ctx["q"], ctx["k"], ctx["v"], num_tokens=ctx["counts"])

    points = enumerate_faults(build, op, monkeypatch, absorbed_after="publish")
    assert count(points, "decref") >= 2


# -- several layers -----------------------------------------------------------------------------------------------
def test_multi_layer_step_on_the_lean_path(monkeypatch):
    def build():
        return with_inputs(shared([6], layers=3), 1, layers=3)

    def op(ctx):
        with ctx["decs"][0].transaction(1) as tx:
            return [tx.step(layer, ctx["q"][layer, 0], ctx["k"][layer, 0], ctx["v"][layer, 0]) for layer in range(3)]

    points = enumerate_faults(build, op, monkeypatch)
    assert points == ["write_k", "write_v"] * 3 + ["publish"]


def test_multi_layer_extend_with_copy_on_write(monkeypatch):
    def build():
        return with_inputs(shared([6], layers=3, fork_last=True), 5, layers=3)

    def op(ctx):
        with ctx["decs"][-1].transaction(5) as tx:
            return [tx.extend(layer, ctx["q"][layer], ctx["k"][layer], ctx["v"][layer]) for layer in (2, 0, 1)]

    points = enumerate_faults(build, op, monkeypatch)
    assert count(points, "cow_copy") == 1 and count(points, "write_k") == 3 * 2


def test_multi_layer_append_explicit_commit(monkeypatch):
    def build():
        return with_inputs(shared([3, 1], layers=2), 2, layers=2)

    def op(ctx):
        tx = ctx["decs"][1].transaction(2)
        for layer in range(2):
            tx.append(layer, ctx["k"][layer], ctx["v"][layer])
        tx.commit()

    enumerate_faults(build, op, monkeypatch)


def test_multi_layer_batch_transaction(monkeypatch):
    def build():
        return with_inputs(shared([4, 7, 0], layers=2, fork_last=True), 4, layers=2)

    def op(ctx):
        with batch_transaction(ctx["decs"]) as tx:
            return [tx.step(layer, ctx["q"][layer], ctx["k"][layer], ctx["v"][layer]) for layer in range(2)]

    points = enumerate_faults(build, op, monkeypatch)
    assert count(points, "allocate") == 3 and count(points, "cow_copy") == 0    # 4 + 1: a full shared page


def test_multi_layer_batch_extend_transaction(monkeypatch):
    def build():
        return ragged_inputs(shared([4, 7, 0], layers=2, fork_last=True), [2, 5, 3, 1], layers=2)

    def op(ctx):
        with batch_transaction(ctx["decs"], ctx["counts"]) as tx:
            return [tx.extend(layer, ctx["q"][layer], ctx["k"][layer], ctx["v"][layer]) for layer in (1, 0)]

    points = enumerate_faults(build, op, monkeypatch)
    # writes per page touched, each layer: 4..5 | 7, 8..11 | 0..2 | 4 (the fork: page 1 is full, shared -> fresh)
    assert count(points, "write_k") == 2 * 5 and points[-1] == "publish"


def test_multi_layer_batch_extend_planned_once(monkeypatch):
    """Every decoder's tokens form a run: one AttentionPlan (runs) made on the first layer, one kernel call per layer."""
    def build():
        return ragged_inputs(shared([4, 7, 0], layers=2, fork_last=True), [3, 5, 3, 4], layers=2)

    def op(ctx):
        with batch_transaction(ctx["decs"], ctx["counts"]) as tx:
            return [tx.extend(layer, ctx["q"][layer], ctx["k"][layer], ctx["v"][layer]) for layer in (0, 1)]

    ctx = build()
    assert run_counting(ctx, op, monkeypatch)[2] == 2
    enumerate_faults(build, op, monkeypatch)


# -- sliding windows: the release after the commit ---------------------------------------------------------------
def test_window_step_releasing_a_page(monkeypatch):
    def build():
        return with_inputs(shared([9], window=3), 1)           # the query at 9 reads 7..9: page 1 goes back

    points = enumerate_faults(build, lambda ctx: ctx["decs"][0].step(ctx["q"][0], ctx["k"][0], ctx["v"][0]),
                              monkeypatch, absorbed_after="publish")
    assert points == ["write_k", "write_v", "publish", "decref", "publish"]


def test_window_extend_releasing_pages(monkeypatch):
    def build():
        return with_inputs(shared([5], window=2, dtype="float64"), 7)        # 5 + 7: page 1 goes back

    points = enumerate_faults(build, lambda ctx: ctx["decs"][0].extend(ctx["q"], ctx["k"], ctx["v"]), monkeypatch,
                              absorbed_after="publish")
    assert count(points, "decref") == 1 and count(points, "allocate") == 1


def test_window_batch_step_releasing_pages_of_each(monkeypatch):
    def build():
        return with_inputs(shared([6, 10, 3], window=4), 3)      # 7 and 11 tokens: a page of each goes back

    points = enumerate_faults(build, lambda ctx: batch_step(ctx["decs"], ctx["q"], ctx["k"], ctx["v"]), monkeypatch,
                              absorbed_after="publish")
    assert count(points, "decref") == 2


def test_window_truncate_and_free(monkeypatch):
    def build():
        ctx = with_inputs(shared([13], window=3, fork_last=True), 2)
        ctx["decs"][1].append(ctx["k"], ctx["v"])
        return ctx

    enumerate_faults(build, lambda ctx: ctx["decs"][1].truncate(14), monkeypatch)
    enumerate_faults(build, lambda ctx: ctx["decs"][1].free(), monkeypatch)


# -- many cycles ---------------------------------------------------------------------------------------------------
def test_hundred_fill_and_free_cycles_with_faults_leave_the_pool_whole(reduced_grid):
    """Decoders fill a shared pool until it is full (steps, extends, forks, batch steps, some of them failing on
    an injected fault), then all are freed: after each cycle every page is free exactly once."""
    rng = np.random.default_rng(100)
    cache = KVCache(num_kv_heads=2, head_dim=8, page_size=4, num_pages=12)
    cfg = cache.config
    injected = full = 0
    for cycle in range(30 if reduced_grid else 100):
        decs = [Decoder.on_cache(cache, 4) for _ in range(3)]
        while True:
            set_fault_hook(cache, FaultInjector(fail_at=int(rng.integers(0, 12))) if rng.random() < 0.3 else no_fault)
            before = cache.fingerprint()
            try:
                what = rng.integers(4)
                if what == 0:
                    q, k, v = tokens(rng, 1, cfg)
                    decs[rng.integers(len(decs))].step(q[0], k[0], v[0])
                elif what == 1:
                    decs[rng.integers(len(decs))].extend(*tokens(rng, int(rng.integers(1, 7)), cfg))
                elif what == 2 and len(decs) < 6:
                    decs.append(decs[rng.integers(len(decs))].fork())
                else:
                    batch_step(decs, *tokens(rng, len(decs), cfg))
            except InjectedFault:
                injected += 1
                assert cache.fingerprint() == before
            except CacheFullError:
                full += 1
                assert cache.fingerprint() == before
                break
            finally:
                set_fault_hook(cache, no_fault)
        cache.check_invariants()
        for dec in decs:
            dec.free()
        assert cache.num_free_pages == cfg.num_pages and not cache.sequences
        assert sorted(cache.pool.allocator.free_list()) == list(range(cfg.num_pages))
        assert set(cache.pool.allocator.ref_counts()) == {0}
    assert injected > 20 and full == (30 if reduced_grid else 100)
