"""Pool reuse over many cycles, and several threads working on their own sequences of one shared cache."""
import sys
import threading

import numpy as np

import kvcache
from kvcache import CacheFullError
from ..kvcache.kv_helpers import DenseModel, assert_matches_model, random_kv


def test_hundred_fill_and_free_cycles_leave_the_pool_whole():
    rng = np.random.default_rng(11)
    cache = kvcache.KVCache(num_layers=2, num_kv_heads=2, head_dim=4, page_size=3, num_pages=16)
    for cycle in range(100):
        model = DenseModel(cache)
        seqs = []
        while True:                                   # fill until the pool refuses
            if seqs and rng.random() < 0.3:
                parent = seqs[rng.integers(len(seqs))]
                child = cache.fork(parent)
                model.fork(parent, child)
                seqs.append(child)
            seq = seqs[rng.integers(len(seqs))] if seqs and rng.random() < 0.5 else None
            if seq is None:
                seq = cache.create_sequence()
                model.create(seq)
                seqs.append(seq)
            k, v = random_kv(cache, int(rng.integers(1, 7)), rng)
            try:
                cache.append(seq, k, v)
            except CacheFullError as exc:
                assert exc.pages_free == cache.num_free_pages
                break
            model.append(seq, k, v)
            if rng.random() < 0.2:
                n = int(rng.integers(0, model.length(seq) + 1))
                cache.truncate(seq, n)
                model.truncate(seq, n)
        assert_matches_model(cache, model)
        cache.check_invariants()
        for seq in rng.permutation(seqs).tolist():
            cache.free(seq)
        assert cache.num_free_pages == 16, f"cycle {cycle}: pages leaked"
        cache.check_invariants()
    assert cache.sequences == ()


def worker(cache: kvcache.KVCache, seed: int, ops: int, errors: list, results: dict) -> None:
    """Append / truncate / fork / free / release on this thread's own sequences; compare with its own model."""
    try:
        rng = np.random.default_rng(seed)
        model = DenseModel(cache)
        mine: list[int] = []
        for step in range(ops):
            op = rng.random()
            if not mine or (op < 0.1 and len(mine) < 4):
                seq = cache.create_sequence()
                model.create(seq)
                mine.append(seq)
            seq = mine[rng.integers(len(mine))]
            if op < 0.55:
                k, v = random_kv(cache, int(rng.integers(1, 6)), rng)
                try:
                    cache.append(seq, k, v)
                    model.append(seq, k, v)
                except CacheFullError:                # another thread holds the pages: make room
                    victim = mine.pop(0)
                    cache.free(victim)
                    model.free(victim)
            elif op < 0.7:
                n = int(rng.integers(model.first[seq], model.length(seq) + 1))
                cache.truncate(seq, n)
                model.truncate(seq, n)
            elif op < 0.8 and len(mine) < 5:
                child = cache.fork(seq)
                model.fork(seq, child)
                mine.append(child)
            elif op < 0.9 and len(mine) > 1:
                cache.free(seq)
                model.free(seq)
                mine.remove(seq)
            elif op < 0.95:
                position = int(rng.integers(0, model.length(seq) + 1))
                assert cache.release_before(seq, position) == model.release_before(seq, position)
            else:
                cache.check_invariants()             # consistent under the lock, whatever others do
            if step % 25 == 0:
                assert_matches_model(cache, model, mine)
        assert_matches_model(cache, model, mine)
        results[seed] = (cache, model, mine)
    except BaseException as exc:                      # reported by the main thread
        errors.append((seed, exc))


def test_threads_on_their_own_sequences():
    cache = kvcache.KVCache(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, num_pages=64,
                            dtype="float16")
    errors, results = [], {}
    threads = [threading.Thread(target=worker, args=(cache, seed, 800, errors, results), daemon=True)
               for seed in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)                       # switch threads often: interleave inside operations
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "deadlock: a worker did not finish within 60 s"
    assert not errors, errors
    cache.check_invariants()
    for seed, (_, model, mine) in results.items():
        assert_matches_model(cache, model, mine)
        for seq in mine:
            cache.free(seq)
    assert cache.num_free_pages == 64 and cache.sequences == ()
    cache.check_invariants()
