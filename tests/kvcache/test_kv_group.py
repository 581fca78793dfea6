"""`KVCache.group`: sequence operations undone together, byte for byte (the sequence-id counter included), with
a fault injected at every point of a mixed batch of operations."""
import pytest

from kvcache.testing import FaultInjector, InjectedFault, set_fault_hook
from kvcache.faults import no_fault
from .kv_helpers import make_cache, random_kv


def build():
    import numpy as np
    rng = np.random.default_rng(0)
    cache = make_cache(num_layers=2, page_size=4, num_pages=16)
    a, b = cache.create_sequence(), cache.create_sequence()
    cache.append(a, *random_kv(cache, 7, rng))
    cache.append(b, *random_kv(cache, 5, rng))
    return cache, (a, b)


def mixed(cache, ctx):
    a, b = ctx
    with cache.group():
        c = cache.fork(a)
        cache.create_sequence()
        cache.truncate(c, 3)
        cache.free(b)
        cache.release_before(a, 4)
        cache.free(a)


def test_every_fault_rolls_the_whole_group_back():
    cache, ctx = build()
    counter = FaultInjector()
    set_fault_hook(cache, counter)
    mixed(cache, ctx)
    set_fault_hook(cache, no_fault)
    expected = cache.fingerprint()
    for i, point in enumerate(counter.points):
        cache, ctx = build()
        before = cache.fingerprint()
        set_fault_hook(cache, FaultInjector(fail_at=i))
        with pytest.raises(InjectedFault):
            mixed(cache, ctx)
        set_fault_hook(cache, no_fault)
        assert cache.fingerprint() == before, f"fault #{i} at {point!r}"
        cache.check_invariants()
        mixed(cache, ctx)
        assert cache.fingerprint() == expected


def test_span_calls_group_and_nesting():
    cache, (a, b) = build()
    before = cache.fingerprint()
    group = cache.group(span_calls=True)
    with group:
        cache.fork(a)
    cache.create_sequence()                       # outside the group's blocks: not recorded, not undone
    after_outside = cache.fingerprint()
    with group:
        with cache.group():                       # a nested group hands its operations to the outer one
            cache.free(b)
    group.rollback()
    assert cache.fingerprint() != before          # the unrecorded create stays
    assert len(cache.sequences) == 3 and b in cache.sequences and cache.length(b) == 5
    with pytest.raises(RuntimeError, match="closed"):
        with group:
            pass
    assert after_outside != before
    cache.check_invariants()
