"""Threads over one shared pool: workers decode their own sequences (`Decoder.on_cache`) while a forker forks
theirs, for 10**4+ steps in all. Every output sampled is checked against the float64 reference on the K/V the
thread's model holds, every fork's K/V against its parent's model, the invariants are checked while the others
run, and every thread must finish (join with a timeout: no deadlock).

A worker's *public* decoders are only ever appended to (never truncated), so the rows its model holds below a
committed length never change and the forker may read them from another thread; the worker writes a row into
its model before the step that appends it and counts it only after the step succeeds. Its *private* decoders
are also truncated. Pool exhaustion (`CacheFullError`) is expected: a worker then frees one of its decoders.
"""
import threading
import time

import numpy as np
import pytest

from decode import Decoder
from kvcache import CacheFullError, KVCache
from reference.dense import decode_reference

from .driver import Model, Settings

HEADS, KV_HEADS, DIM, DIM_V = 4, 2, 16, 8
TOL = (2e-6, 2e-5)


def close(out, q, model, start):
    ref = decode_reference(q, model.k[0, :start + len(q)], model.v[0, :start + len(q)], start)
    return (np.abs(out - ref) <= TOL[0] + TOL[1] * np.abs(ref)).all()


class Shared:
    def __init__(self, cache):
        self.cache = cache
        self.public: dict[int, tuple[Decoder, Model]] = {}      # seq -> (decoder, model), append-only decoders
        self.lock = threading.Lock()                            # guards the dict only
        self.errors: list[str] = []
        self.steps = 0
        self.forks = 0
        self.fork_refusals = 0
        self.full = 0
        self.stop = threading.Event()

    def error(self, message):
        self.errors.append(message)
        self.stop.set()


def new_model(capacity):
    return Model(Settings(layers=1, num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, head_dim_v=DIM_V),
                 capacity, np.dtype(np.float32))


def worker(shared: Shared, index: int, steps: int, sample: int):
    rng = np.random.default_rng(1000 + index)
    cache = shared.cache
    capacity = cache.config.num_pages * cache.config.page_size
    mine: list[tuple[Decoder, Model, bool]] = []               # (decoder, model, public)
    try:
        for step in range(steps):
            if shared.stop.is_set():
                return
            if len(mine) < 3:
                dec = Decoder.on_cache(cache, HEADS)
                entry = (dec, new_model(capacity), len(mine) % 2 == 0)
                mine.append(entry)
                if entry[2]:
                    with shared.lock:
                        shared.public[dec.seq] = entry[:2]
            dec, model, public = mine[rng.integers(len(mine))]
            count = 1 if rng.random() < 0.9 else int(rng.integers(2, 5))
            q = rng.standard_normal((count, HEADS, DIM))
            k = rng.standard_normal((count, KV_HEADS, DIM))
            v = rng.standard_normal((count, KV_HEADS, DIM_V))
            start = model.length
            if start + count > capacity:
                continue
            model.k[0, start:start + count] = k                  # rows first: forks read committed rows only
            model.v[0, start:start + count] = v
            try:
                out = dec.step(q[0], k[0], v[0])[None] if count == 1 else dec.extend(q, k, v)
            except CacheFullError:
                shared.full += 1
                victim = mine.pop(int(rng.integers(len(mine))))
                with shared.lock:
                    shared.public.pop(victim[0].seq, None)
                victim[0].free()
                continue
            model.length = start + count
            shared.steps += count
            if step % sample == 0 and not close(out, q, model, start):
                shared.error(f"worker {index}: output differs at seq {dec.seq} position {start}")
            if not public and rng.random() < 0.05:
                n = int(rng.integers(0, model.length + 1))
                dec.truncate(n)
                model.length = n
            if rng.random() < 0.01:
                K, V = dec.kv()
                if not (np.array_equal(K, model.k[0, :model.length]) and np.array_equal(V, model.v[0, :model.length])):
                    shared.error(f"worker {index}: kv() of seq {dec.seq} differs from the model")
    except Exception as error:                                  # noqa: BLE001 - reported by the test
        shared.error(f"worker {index}: {type(error).__name__}: {error}")
    finally:
        for dec, _, _ in mine:
            with shared.lock:
                shared.public.pop(dec.seq, None)
            dec.free()


def forker(shared: Shared, steps_each: int):
    """Fork the workers' public decoders while they append, check the fork, decode it a little, free it."""
    rng = np.random.default_rng(7)
    try:
        while not shared.stop.is_set():
            with shared.lock:
                entries = list(shared.public.values())
            if not entries:
                time.sleep(0.001)
                continue
            parent, parent_model = entries[rng.integers(len(entries))]
            try:
                child = parent.fork()
            except (RuntimeError, ValueError):                  # in a transaction right now / already freed
                shared.fork_refusals += 1
                continue
            shared.forks += 1
            length = child.length
            model = new_model(parent_model.k.shape[1])
            model.k[:, :length] = parent_model.k[:, :length]    # committed rows: never rewritten
            model.v[:, :length] = parent_model.v[:, :length]
            model.length = length
            K, V = child.kv()
            if not (np.array_equal(K, model.k[0, :length]) and np.array_equal(V, model.v[0, :length])):
                shared.error(f"forker: fork of seq {parent.seq} at length {length} differs from the parent's model")
            try:
                for _ in range(steps_each):
                    q = rng.standard_normal((HEADS, DIM))
                    k = rng.standard_normal((KV_HEADS, DIM))
                    v = rng.standard_normal((KV_HEADS, DIM_V))
                    start = model.length
                    if start + 1 > model.k.shape[1]:
                        break
                    model.k[0, start], model.v[0, start] = k, v
                    out = child.step(q, k, v)                   # copy-on-write of the shared last page
                    model.length += 1
                    if not close(out[None], q[None], model, start):
                        shared.error(f"forker: output of the fork of seq {parent.seq} differs at {start}")
            except CacheFullError:
                shared.full += 1
            finally:
                child.free()
    except Exception as error:                                  # noqa: BLE001
        shared.error(f"forker: {type(error).__name__}: {error}")


def checker(shared: Shared):
    """check_invariants while the others run (it takes the pool's lock; open transactions are allowed)."""
    try:
        while not shared.stop.is_set():
            shared.cache.check_invariants()
            time.sleep(0.002)
    except AssertionError as error:
        shared.error(f"invariants: {error}")


def run_threads(workers: int, steps: int, sample: int, num_pages: int = 96, timeout: float = 300.0):
    cache = KVCache(num_kv_heads=KV_HEADS, head_dim=DIM, head_dim_v=DIM_V, page_size=4, num_pages=num_pages)
    shared = Shared(cache)
    threads = [threading.Thread(target=worker, args=(shared, i, steps, sample), name=f"worker-{i}")
               for i in range(workers)]
    helpers = [threading.Thread(target=forker, args=(shared, 3), name="forker"),
               threading.Thread(target=checker, args=(shared,), name="checker")]
    for t in threads + helpers:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    shared.stop.set()
    for t in helpers:
        t.join(max(1.0, deadline - time.monotonic()))
    alive = [t.name for t in threads + helpers if t.is_alive()]
    assert not alive, f"threads still running after {timeout} s (deadlock?): {alive}"
    assert not shared.errors, shared.errors[:5]
    cache.check_invariants()
    assert cache.num_free_pages == cache.config.num_pages and not cache.sequences   # every thread freed its own
    return shared


@pytest.mark.kernel
def test_workers_and_a_forker_on_one_pool(reduced_grid):
    steps = 300 if reduced_grid else 2600
    shared = run_threads(workers=4, steps=steps, sample=4)
    assert shared.steps >= (1000 if reduced_grid else 10_000)
    assert shared.full > 0 and (reduced_grid or shared.forks > 10)


@pytest.mark.kernel
def test_threads_on_the_parallel_kernel(monkeypatch, reduced_grid):
    """Every kernel call takes the parallel (prange) path while several threads decode."""
    import decode.attention_plan as attention_plan
    monkeypatch.setattr(attention_plan, "SERIAL_WORK", 0)
    shared = run_threads(workers=3, steps=100 if reduced_grid else 600, sample=2)
    assert reduced_grid or shared.forks > 0


@pytest.mark.slow
def test_threads_long():
    start = time.perf_counter()
    shared = run_threads(workers=6, steps=20_000, sample=16, num_pages=160, timeout=1800)
    print(f"\n[threads] 6 workers + a forker + a checker: {shared.steps} tokens decoded, {shared.forks} forks "
          f"({shared.fork_refusals} refused: busy or freed), {shared.full} CacheFullError, "
          f"{time.perf_counter() - start:.1f} s")
    assert shared.steps >= 100_000
