"""Fault injection at every fault point of every mutating operation.

For each scenario: one clean run with a counting `FaultInjector` lists the points the operation passes; then,
for each index i, a fresh identical cache runs the operation with ``FaultInjector(fail_at=i)``: it must raise
`InjectedFault`, leave the fingerprint (every pool byte, free-list order, ref counts, tables, lengths) and the
free-page count exactly as before, pass check_invariants; then, with the hook removed, the same call must
succeed and leave the cache byte-identical to the clean run.
"""
import numpy as np

from ..kvcache.kv_helpers import enumerate_faults, make_cache, random_kv


def filled(tokens, seed=0, **kwargs):
    rng = np.random.default_rng(seed)
    cache = make_cache(**kwargs)
    seqs = []
    for count in tokens:
        seq = cache.create_sequence()
        if count:
            cache.append(seq, *random_kv(cache, count, rng))
        seqs.append(seq)
    return cache, seqs, rng


def count(points, name):
    return sum(1 for p in points if p == name)


# -- append ------------------------------------------------------------------------------------------------------
def test_append_across_pages_multi_layer():
    def build():
        cache, [a], rng = filled([1], num_layers=3, page_size=4, num_pages=8)
        return cache, (a,) + random_kv(cache, 10, rng)            # 1 + 10 tokens: 2 new pages, 3 chunks

    points = enumerate_faults(build, lambda cache, ctx: cache.append(*ctx))
    assert count(points, "allocate") == 2
    assert count(points, "write_k") == count(points, "write_v") == 3 * 3   # 3 page chunks x 3 layers
    assert points[-1] == "publish" and "cow_copy" not in points


def test_append_with_copy_on_write_and_table_growth():
    def build():
        cache, [a], rng = filled([6], num_layers=2, page_size=2, num_pages=12)
        b = cache.fork(a)
        cache.free(a)
        c = cache.fork(b)                                          # b, c share 3 pages, the last one full
        cache.truncate(c, 5)                                       # c's tail page: shared and partial
        return cache, (c,) + random_kv(cache, 6, rng)               # 5 + 6 = 11 tokens: 6 pages (table grows)

    points = enumerate_faults(build, lambda cache, ctx: cache.append(*ctx))
    assert count(points, "cow_copy") == 1 and count(points, "allocate") == 4   # 3 new pages + the copy
    assert points[-1] == "publish"


def test_append_float16_pool():
    def build():
        cache, [a], rng = filled([3], num_layers=2, page_size=3, num_pages=5, dtype="float16")
        return cache, (a,) + random_kv(cache, 4, rng)
    enumerate_faults(build, lambda cache, ctx: cache.append(*ctx))


# -- transactions --------------------------------------------------------------------------------------------------
def build_two_sequence_tx():
    cache, [a, b], rng = filled([3, 5], num_layers=3, page_size=4, num_pages=10)
    c = cache.fork(b)                                              # b's tail page (5 of 8) shared: b copies it
    ka, va = random_kv(cache, 2, rng)
    kb, vb = random_kv(cache, 3, rng)
    return cache, (a, b, c, ka, va, kb, vb)


def test_multi_sequence_transaction_with_block():
    def op(cache, ctx):
        a, b, c, ka, va, kb, vb = ctx
        with cache.transaction({a: 2, b: 3}) as tx:
            for layer in range(3):                                 # a fault after some layers were written
                tx.write(layer, a, ka[layer], va[layer])
                tx.write(layer, b, kb[layer], vb[layer])

    points = enumerate_faults(build_two_sequence_tx, op)
    assert count(points, "cow_copy") == 1 and count(points, "allocate") == 2
    assert count(points, "write_k") == 3 * (1 + 2)                 # a: 1 chunk, b: 2 chunks (5..7, 8), 3 layers
    assert points[-1] == "publish"


def test_multi_sequence_transaction_explicit_calls():
    """No with-block: write() and commit() must roll back by themselves."""
    def op(cache, ctx):
        a, b, c, ka, va, kb, vb = ctx
        tx = cache.transaction({b: 3, a: 2})
        for layer in (2, 0, 1):
            tx.write(layer, b, kb[layer], vb[layer])
            tx.write(layer, a, ka[layer], va[layer])
        tx.commit()

    enumerate_faults(build_two_sequence_tx, op)


def test_transaction_of_forked_siblings_sharing_the_tail():
    def build():
        cache, [a], rng = filled([3], num_layers=2, page_size=4, num_pages=6)
        b = cache.fork(a)
        return cache, (a, b) + random_kv(cache, 5, rng)

    def op(cache, ctx):
        a, b, k, v = ctx
        with cache.transaction({a: 5, b: 1}) as tx:
            for layer in range(2):
                tx.write(layer, a, k[layer], v[layer])
                tx.write(layer, b, k[layer][:1], v[layer][:1])

    points = enumerate_faults(build, op)
    assert count(points, "cow_copy") == 2


# -- truncate, fork, free, release_before -------------------------------------------------------------------------
def test_truncate_dropping_shared_and_private_pages():
    def build():
        cache, [a], rng = filled([10], num_layers=2, page_size=2, num_pages=12)
        b = cache.fork(a)
        cache.truncate(b, 6)
        cache.append(b, *random_kv(cache, 3, rng))                 # b: 3 shared + 2 private pages
        return cache, b

    points = enumerate_faults(build, lambda cache, b: cache.truncate(b, 1))
    assert points == ["decref"] * 4 + ["publish"]


def test_fork():
    def build():
        cache, [a], rng = filled([7], num_layers=2, page_size=2)
        cache.release_before(a, 2)
        return cache, a

    points = enumerate_faults(build, lambda cache, a: cache.fork(a))
    assert points == ["fork_incref"] * 3 + ["publish"]


def test_free():
    def build():
        cache, [a, b], rng = filled([7, 2], page_size=2)
        c = cache.fork(a)
        cache.append(c, *random_kv(cache, 3, rng))
        return cache, c

    points = enumerate_faults(build, lambda cache, c: cache.free(c))
    assert points == ["decref"] * 5 + ["publish"]


def test_release_before():
    def build():
        cache, [a], rng = filled([9], page_size=2)
        cache.fork(a)
        return cache, a

    points = enumerate_faults(build, lambda cache, a: cache.release_before(a, 7))
    assert points == ["decref"] * 3 + ["publish"]


def test_free_after_release_before():
    def build():
        cache, [a], rng = filled([9], num_layers=2, page_size=2)
        cache.release_before(a, 4)
        return cache, a

    points = enumerate_faults(build, lambda cache, a: cache.free(a))
    assert points == ["decref"] * 3 + ["publish"]
