"""A seeded random driver of the whole engine against a dense model: decoders on one shared pool stepped,
extended, appended to, truncated, forked, freed and batch-stepped, interleaved with calls that must fail (bad
input, a full pool, injected faults), every output checked against `reference.dense.decode_reference` on the
K/V the model keeps per sequence.

    python -m tests.reliability.driver --ops 100000 --seed 0            # the long run of docs/reliability.md
    python -m tests.reliability.driver --ops 3000 --dtype float16 --layers 2 --window 5

After every operation (``--check-every``): each decoder's length, first held position and `kv()` (every layer,
bit for bit) equal the model; `check_invariants`; with guards (default), the sentinels are intact: the pool's
first and last pages belong to two guard sequences and hold a NaN pattern, and every slot no sequence holds
(free pages, the tail of each last page) is repainted with it before each operation and must still hold it
after, unless the operation legitimately took the slot. A failing call must leave `fingerprint()` unchanged. At
the end every sequence is freed and the pool must be whole. Resident memory (psutil) is read after a warm-up
(a tenth of the operations) and at the end.

A divergence raises `Divergence` (with the operation index and the seed); the CLI prints the summary and exits 1.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from decode import Decoder, batch_step, batch_transaction
from kvcache import CacheFullError, KVCache, bf16, testing
from kvcache.testing import FaultInjector, InjectedFault, set_fault_hook
from kvcache.faults import no_fault
from reference.dense import decode_reference

TOLERANCE = {"float64": (1e-12, 1e-12), "float32": (2e-6, 2e-5), "float16": (2e-6, 2e-5), "bfloat16": (2e-6, 2e-5)}
SENTINEL_BITS = {2: 0x7E5A, 4: 0x7FC0_BAD5, 8: 0x7FF8_0000_DEAD_BEEF}       # quiet NaNs with a payload
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


class Divergence(AssertionError):
    """The engine and the dense model disagree (or a sentinel / invariant / fingerprint check failed)."""


@dataclass
class Settings:
    ops: int = 3000
    seed: int = 0
    dtype: str = "float32"
    layers: int = 1
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    head_dim_v: int = 6
    page_size: int = 4
    num_pages: int = 48
    window: int | None = None
    max_decoders: int = 10
    guards: bool = True
    check_every: int = 1          # full state checks every N operations (1: after every one)
    compare_every: int = 1        # compare every N-th output-producing operation with the reference


@dataclass
class Summary:
    operations: int = 0
    by_kind: dict = field(default_factory=dict)
    sequences_created: int = 0
    outputs_compared: int = 0
    failures_injected: int = 0            # InjectedFault raised and rolled back
    faults_absorbed: int = 0              # a fault in a sliding window's post-commit release (the step succeeded)
    bad_inputs_rejected: int = 0
    cache_full_now: int = 0               # CacheFullError with could_ever_fit True
    cache_full_never: int = 0             # ... and False
    divergences: int = 0
    leaked_pages: int = 0
    max_live_decoders: int = 0
    rss_warm_mib: float = 0.0
    rss_end_mib: float = 0.0
    seconds: float = 0.0

    def text(self, settings: Settings) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.by_kind.items()))
        return "\n".join([
            f"settings: {json.dumps(asdict(settings))}",
            f"operations: {self.operations} ({kinds})",
            f"sequences: {self.sequences_created} created, at most {self.max_live_decoders} live",
            f"outputs compared with decode_reference: {self.outputs_compared}",
            f"failures injected: {self.failures_injected} (+{self.faults_absorbed} absorbed by a post-commit window "
            f"release)",
            f"bad inputs rejected: {self.bad_inputs_rejected}; cache full: {self.cache_full_now} now, "
            f"{self.cache_full_never} never",
            f"divergences: {self.divergences}",
            f"leaked pages: {self.leaked_pages}",
            f"RSS after warm-up: {self.rss_warm_mib:.1f} MiB, at the end: {self.rss_end_mib:.1f} MiB "
            f"({self.rss_end_mib - self.rss_warm_mib:+.1f} MiB)",
            f"time: {self.seconds:.1f} s",
        ])


def rss_mib() -> float:
    import psutil
    return psutil.Process().memory_info().rss / 2 ** 20


# -- guard pages and sentinel slots ------------------------------------------------------------------------------
class Guards:
    """Two guard sequences own the pool's first and last pages (all NaN sentinels); every slot no sequence holds is
    painted with the sentinel before an operation and checked after it."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        cfg = cache.config
        size = cfg.dtype.itemsize
        self.bits = UINT[size](SENTINEL_BITS[size])
        k, v = testing.pool_arrays(cache)            # [layers, num_pages, heads, page_size, dim]
        self.k, self.v = k.view(UINT[size]), v.view(UINT[size])          # their bit patterns
        self.before = None
        self.taken: set[int] = set()                   # pages allocated during the current operation
        alloc = testing.allocator(cache)
        allocate = alloc.allocate

        def recording(count, *args, **kwargs):
            pages = allocate(count, *args, **kwargs)
            self.taken.update(pages)
            return pages
        alloc.allocate = recording
        one = np.zeros((cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim))
        one_v = np.zeros((cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim_v))
        if cfg.num_pages < 3 or cache.num_free_pages != cfg.num_pages:
            raise ValueError("guards: expected an empty pool of at least 3 pages")
        self.low = cache.create_sequence()
        cache.append(self.low, one, one_v)                                  # page 0
        filler = cache.create_sequence()
        middle = (cfg.num_pages - 2) * cfg.page_size
        cache.append(filler, np.zeros((cfg.num_layers, middle, cfg.num_kv_heads, cfg.head_dim)),
                     np.zeros((cfg.num_layers, middle, cfg.num_kv_heads, cfg.head_dim_v)))
        self.high = cache.create_sequence()
        cache.append(self.high, one, one_v)                                 # the last page
        cache.free(filler)
        assert cache.pool.page_table(self.low).tolist() == [0]
        assert cache.pool.page_table(self.high).tolist() == [cfg.num_pages - 1]
        for pool in (self.k, self.v):
            pool[:, 0] = self.bits
            pool[:, -1] = self.bits

    @property
    def sequences(self) -> tuple[int, int]:
        return self.low, self.high

    def unused(self) -> np.ndarray:
        """bool [num_pages, page_size]: slots no sequence holds (guard pages count as unused: all sentinel)."""
        cache, cfg = self.cache, self.cache.config
        fill = np.zeros(cfg.num_pages, dtype=np.int64)
        with testing.lock(cache):
            for seq in cache.sequences:
                if seq in (self.low, self.high):
                    continue
                s = testing.sequence_record(cache, seq)          # the reserved pages of an open transaction too
                for logical in range(s.first_live_page, s.num_logical_pages):
                    page = int(s.table[logical])
                    fill[page] = max(fill[page], min(cfg.page_size, s.length - logical * cfg.page_size))
        return np.arange(cfg.page_size)[None, :] >= fill[:, None]

    def paint(self) -> None:
        mask = self.before = self.unused()
        self.taken.clear()
        self.used_before = np.array(self.cache.pool.allocator.ref_counts()) > 0
        for pool in (self.k, self.v):
            pool.transpose(1, 3, 0, 2, 4)[mask] = self.bits

    def check(self, what: str) -> None:
        """Every slot unused before the operation and still unused now holds the sentinel, bit for bit; except in
        pages the operation allocated or gave back: a copy-on-write copies a whole page (the slots past the
        copier's length hold the source page's bytes, never read), and a sliding window gives back pages written
        in the same call. (A failed operation is held to more: its fingerprint must not change.)"""
        still = self.before & self.unused()
        still[sorted(self.taken)] = False
        still[self.used_before & (np.array(self.cache.pool.allocator.ref_counts()) == 0)] = False
        for name, pool in (("k", self.k), ("v", self.v)):
            slots = pool.transpose(1, 3, 0, 2, 4)[still]                     # [n, layers, heads, dim]
            if not (slots == self.bits).all():
                bad = np.argwhere(still)[np.flatnonzero((slots != self.bits).reshape(len(slots), -1).any(axis=1))[0]]
                raise Divergence(f"{what}: sentinel of {name} page {bad[0]} slot {bad[1]} overwritten")
            for page in (0, -1):
                if not (pool[:, page] == self.bits).all():
                    raise Divergence(f"{what}: guard page {page} of {name} overwritten")


# -- the dense model ---------------------------------------------------------------------------------------------
class Model:
    """What one decoder's sequence holds: K/V of every position ever appended (storage dtype), its length."""

    def __init__(self, settings: Settings, capacity: int, dtype: np.dtype):
        s = settings
        self.k = np.zeros((s.layers, capacity, s.num_kv_heads, s.head_dim), dtype)
        self.v = np.zeros((s.layers, capacity, s.num_kv_heads, s.head_dim_v), dtype)
        self.length = 0
        self.first = 0                 # first position the cache still holds (sliding window)

    def copy(self) -> "Model":
        other = Model.__new__(Model)
        other.k, other.v, other.length, other.first = self.k.copy(), self.v.copy(), self.length, self.first
        return other

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """``k [layers, T, H, D]`` (cast to the storage dtype like the cache does)."""
        count = k.shape[1]
        if self.length + count > self.k.shape[1]:              # a sliding window lets a sequence outgrow the pool
            size = max(self.length + count, 2 * self.k.shape[1])
            self.k, self.v = (np.concatenate([a, np.zeros((a.shape[0], size - a.shape[1]) + a.shape[2:], a.dtype)], 1)
                              for a in (self.k, self.v))
        self.k[:, self.length:self.length + count] = k
        self.v[:, self.length:self.length + count] = v
        self.length += count


# -- the driver --------------------------------------------------------------------------------------------------
class Driver:
    KINDS = ("step", "extend", "append", "truncate", "fork", "free", "new", "batch", "bad", "fault")
    WEIGHTS = (30, 8, 5, 6, 5, 4, 4, 10, 14, 14)

    def __init__(self, settings: Settings):
        self.s = s = settings
        self.rng = np.random.default_rng(s.seed)
        self.cache = KVCache(num_layers=s.layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                             head_dim_v=s.head_dim_v, dtype=s.dtype, page_size=s.page_size, num_pages=s.num_pages)
        self.cfg = self.cache.config
        self.capacity = s.num_pages * s.page_size
        self.guards = Guards(self.cache) if s.guards else None
        self.decoders: list[Decoder] = []
        self.models: dict[int, Model] = {}
        self.freed: list[Decoder] = []
        self.summary = Summary()
        self.op = 0
        self.atol, self.rtol = TOLERANCE[s.dtype]
        self.weights = np.array(self.WEIGHTS, dtype=float) / sum(self.WEIGHTS)

    # -- helpers ----------------------------------------------------------------------------------------------
    def stored(self, x: np.ndarray) -> np.ndarray:
        """What the pool keeps of ``x`` as `Decoder.kv` gives it back (bfloat16: rounded, widened to float32)."""
        return bf16.to_float32(bf16.to_bits(x)) if self.cfg.bfloat16 else x.astype(self.cfg.dtype)

    def fail(self, message: str):
        self.summary.divergences += 1
        raise Divergence(f"op {self.op} (seed {self.s.seed}): {message}")

    def tokens(self, count: int, queries: bool = True):
        s, rng = self.s, self.rng
        scale = 10.0 ** rng.choice([-2, 0, 0, 0, 1])
        q = rng.standard_normal((s.layers, count, s.num_q_heads, s.head_dim)) if queries else None
        k = rng.standard_normal((s.layers, count, s.num_kv_heads, s.head_dim)) * scale
        v = rng.standard_normal((s.layers, count, s.num_kv_heads, s.head_dim_v)) * scale
        return q, k, v

    def new_decoder(self) -> Decoder:
        dec = Decoder.on_cache(self.cache, self.s.num_q_heads, window=self.s.window)
        self.decoders.append(dec)
        self.models[dec.seq] = Model(self.s, self.capacity, np.float32 if self.cfg.bfloat16 else self.cfg.dtype)
        self.summary.sequences_created += 1
        return dec

    def pick(self) -> Decoder | None:
        return self.decoders[self.rng.integers(len(self.decoders))] if self.decoders else None

    def compare(self, dec_models, q, outs, starts) -> None:
        """``outs [layers, T_i...]``: query t of decoder i at position starts[i] + t against the reference."""
        self.summary.outputs_compared += 1
        if (self.summary.outputs_compared - 1) % self.s.compare_every:
            if not all(np.isfinite(o).all() for o in outs):
                self.fail("non-finite output")
            return
        for (model, qi, out, start) in zip(dec_models, q, outs, starts):
            count = qi.shape[1]
            for layer in range(self.s.layers):
                ref = decode_reference(qi[layer], model.k[layer, :start + count], model.v[layer, :start + count],
                                       start, window=self.s.window)
                err = np.abs(out[layer] - ref)
                lo = max(0, start - self.s.window + 1) if self.s.window else 0
                vmax = max(1.0, float(np.abs(model.v[layer, lo:start + count]).max()))  # errors scale with |v|
                if not (err <= self.atol * vmax + self.rtol * np.abs(ref)).all():
                    self.fail(f"output differs from the reference by {err.max():.3g} (layer {layer}, start {start})")

    # -- the engine calls (one layer: the plain API, sometimes a transaction; several layers: transactions) -----
    def call_step(self, dec, q, k, v):
        if self.s.layers == 1 and self.rng.random() < 0.8:
            return dec.step(q[0, 0], k[0, 0], v[0, 0])[None, None]
        with dec.transaction(1) as tx:
            outs = [tx.step(layer, q[layer, 0], k[layer, 0], v[layer, 0]) for layer in range(self.s.layers)]
        return np.array(outs)[:, None]

    def call_extend(self, dec, q, k, v):
        if self.s.layers == 1 and self.rng.random() < 0.8:
            return dec.extend(q[0], k[0], v[0])[None]
        with dec.transaction(k.shape[1]) as tx:
            return np.array([tx.extend(layer, q[layer], k[layer], v[layer]) for layer in range(self.s.layers)])

    def call_append(self, dec, k, v):
        if self.s.layers == 1 and self.rng.random() < 0.8:
            return dec.append(k[0], v[0])
        with dec.transaction(k.shape[1]) as tx:
            for layer in range(self.s.layers):
                tx.append(layer, k[layer], v[layer])

    def call_batch(self, decs, q, k, v):
        """``q [layers, B, Hq, D]`` -> ``[layers, B, Hq, Dv]``."""
        if self.s.layers == 1 and self.rng.random() < 0.8:
            return batch_step(decs, q[0], k[0], v[0])[None]
        with batch_transaction(decs) as tx:
            return np.array([tx.step(layer, q[layer], k[layer], v[layer]) for layer in range(self.s.layers)])

    # -- operations: each returns a thunk running the engine call and the model update it implies -------------
    def plan(self, kind: str):
        """A (run, commit) pair: ``run()`` calls the engine and returns its result; ``commit(result)`` applies the
        change to the model and checks outputs. None when the operation does not apply now."""
        rng, s = self.rng, self.s
        dec = self.pick()
        if kind == "new":
            if len(self.decoders) >= s.max_decoders:
                return None
            return (lambda: self.new_decoder()), (lambda result: None)
        if dec is None:
            return None
        model = self.models[dec.seq]
        if kind == "step":
            q, k, v = self.tokens(1)
            start = model.length

            def commit(out):
                model.append(self.stored(k), self.stored(v))
                self.compare([model], [q], [out], [start])
            return (lambda: self.call_step(dec, q, k, v)), commit
        if kind == "extend":
            q, k, v = self.tokens(int(rng.integers(0, 7)))
            start = model.length

            def commit(out):
                model.append(self.stored(k), self.stored(v))
                if k.shape[1]:
                    self.compare([model], [q], [out], [start])
            return (lambda: self.call_extend(dec, q, k, v)), commit
        if kind == "append":
            _, k, v = self.tokens(int(rng.integers(1, 9)), queries=False)
            return (lambda: self.call_append(dec, k, v)), (lambda _: model.append(self.stored(k),
                                                                                  self.stored(v)))
        if kind == "truncate":
            lo = self.lowest_truncate(dec, model)
            n = int(rng.integers(lo, model.length + 1))

            def commit(_):
                model.length = n
            return (lambda: dec.truncate(n)), commit
        if kind == "fork":
            if len(self.decoders) >= s.max_decoders:
                return None

            def commit(child):
                self.decoders.append(child)
                self.models[child.seq] = model.copy()
                self.summary.sequences_created += 1
            return (lambda: dec.fork()), commit
        if kind == "free":
            def commit(_):
                self.decoders.remove(dec)
                del self.models[dec.seq]
                self.freed.append(dec)
                del self.freed[:-4]
            return (lambda: dec.free()), commit
        if kind == "batch":
            if len(self.decoders) < 2:
                return None
            count = int(rng.integers(2, len(self.decoders) + 1))
            decs = [self.decoders[i] for i in rng.choice(len(self.decoders), count, replace=False)]
            q, k, v = self.tokens(count)
            models = [self.models[d.seq] for d in decs]
            starts = [m.length for m in models]

            def commit(out):
                for i, m in enumerate(models):
                    m.append(self.stored(k[:, i:i + 1]), self.stored(v[:, i:i + 1]))
                self.compare(models, [q[:, i:i + 1] for i in range(count)], [out[:, i:i + 1] for i in range(count)],
                             starts)
            return (lambda: self.call_batch(decs, q, k, v)), commit
        raise ValueError(kind)

    def lowest_truncate(self, dec, model) -> int:
        first = self.cache.pool.first_position(dec.seq)
        return 0 if first == 0 else (first + s.window - 1 if (s := self.s).window else first)

    def bad_call(self):
        """A call that must fail with nothing changed: (callable, exception types)."""
        rng, s = self.rng, self.s
        dec = self.pick()
        choice = self.bad_choice = int(rng.integers(11))
        if dec is None or choice == 0:
            if self.freed:
                gone = self.freed[int(rng.integers(len(self.freed)))]
                call = [lambda: gone.step(*(x[0, 0] for x in self.tokens(1))), gone.fork, gone.free,
                        lambda: gone.truncate(0), lambda: gone.kv()][int(rng.integers(5))]
                return call, (ValueError,)
            return (lambda: self.cache.free(10 ** 6)), (ValueError,)
        model = self.models[dec.seq]
        kind = ["step", "extend", "batch"][int(rng.integers(3))]
        q, k, v = self.tokens(1 if kind == "step" else int(rng.integers(1, 4)))
        if choice <= 4:                                               # a non-finite or too large value
            target = [q, k, v][choice % 3]
            index = tuple(int(rng.integers(n)) for n in target.shape)   # first, middle or last: anywhere
            target[index] = rng.choice([np.nan, np.inf, -np.inf, 1e300])
        elif choice == 5:                                             # a wrong shape
            k = k[..., :-1]
        elif choice == 6:                                             # a non-float dtype
            v = v.astype(rng.choice([np.int64, np.complex128, bool]))
        elif choice == 7:                                             # truncate out of range / of a wrong type
            n = [model.length + 1, -1, True, float(model.length), self.lowest_truncate(dec, model) - 1][
                int(rng.integers(5))]
            return (lambda: dec.truncate(n)), (ValueError, TypeError)
        elif choice == 8:                                             # more than the whole pool
            _, k, v = self.tokens(self.capacity + 1, queries=False)
            return (lambda: self.call_append(dec, k, v)), (CacheFullError,)
        elif choice == 9:                                             # a multi-layer call missing a layer
            def partial():
                with dec.transaction(1) as tx:
                    if s.layers > 1:
                        tx.step(0, q[0, 0], k[0, 0], v[0, 0])
            return partial, (ValueError,)
        elif choice == 10:                                            # a batch with a repeated decoder
            return (lambda: batch_step([dec, dec], q[0, :1].repeat(2, 0), k[0, :1].repeat(2, 0),
                                       v[0, :1].repeat(2, 0))), (ValueError,)
        count = q.shape[1]
        if kind == "step" or count == 1 and kind == "batch":
            return (lambda: self.call_step(dec, q, k, v)), (ValueError, TypeError)
        if kind == "batch" and len(self.decoders) >= count:
            decs = [dec] + [d for d in self.decoders if d is not dec][:count - 1]
            return (lambda: self.call_batch(decs, q, k, v)), (ValueError, TypeError)
        return (lambda: self.call_extend(dec, q, k, v)), (ValueError, TypeError)

    # -- one operation ----------------------------------------------------------------------------------------
    def expect_unchanged(self, before: str, what: str) -> None:
        if self.cache.fingerprint() != before:
            self.fail(f"{what} changed the cache")

    def run_one(self) -> str:
        rng, summary = self.rng, self.summary
        kind = str(rng.choice(self.KINDS, p=self.weights))
        if self.guards is not None:
            self.guards.paint()
        if kind == "bad":
            call, errors = self.bad_call()
            errors = errors + (CacheFullError,) if CacheFullError not in errors else errors   # pages come first
            before = self.cache.fingerprint()
            try:
                call()
            except errors as error:
                if isinstance(error, CacheFullError):
                    summary.cache_full_never += not error.could_ever_fit
                    summary.cache_full_now += error.could_ever_fit
                    if error.could_ever_fit and self.bad_choice == 8:
                        self.fail(f"a request larger than the pool said could_ever_fit: {error}")
                elif not str(error).split(":")[0] or "expected" not in str(error):
                    self.fail(f"an error message without 'name: expected ...': {error!r}")
                summary.bad_inputs_rejected += 1
            except Exception as error:                               # noqa: BLE001 - reported as a divergence
                self.fail(f"a bad call raised {type(error).__name__}: {error} (expected {errors})")
            else:
                self.fail(f"a bad call succeeded (choice {self.bad_choice})")
            self.expect_unchanged(before, "a rejected call")
        else:
            fault = kind == "fault"
            if fault:
                kind = str(rng.choice(["step", "extend", "append", "truncate", "fork", "free", "batch"]))
            planned = self.plan(kind)
            if planned is None:
                return kind
            run, commit = planned
            before = self.cache.fingerprint()
            injector = None
            if fault:
                injector = FaultInjector(fail_at=int(rng.integers(0, 10)))
                set_fault_hook(self.cache, injector)
            try:
                result = run()
            except InjectedFault:
                summary.failures_injected += 1
                self.expect_unchanged(before, "an injected fault")
            except CacheFullError as error:
                summary.cache_full_now += error.could_ever_fit
                summary.cache_full_never += not error.could_ever_fit
                self.expect_unchanged(before, "CacheFullError")
                set_fault_hook(self.cache, no_fault)
                if self.decoders and rng.random() < 0.5:             # make room: free a random decoder
                    victim = self.pick()
                    victim.free()
                    self.decoders.remove(victim)
                    del self.models[victim.seq]
            except Exception as error:                               # noqa: BLE001 - reported as a divergence
                set_fault_hook(self.cache, no_fault)
                self.fail(f"{kind} raised {type(error).__name__}: {error}")
            else:
                if injector is not None and len(injector.points) > injector.fail_at:
                    summary.faults_absorbed += 1                     # raised inside a swallowed window release
                commit(result)
            finally:
                set_fault_hook(self.cache, no_fault)
        summary.by_kind[kind] = summary.by_kind.get(kind, 0) + 1
        return kind

    def check_state(self, what: str) -> None:
        cache, s = self.cache, self.s
        try:
            cache.check_invariants()
        except AssertionError as error:
            self.fail(f"{what}: invariants: {error}")
        if self.guards is not None:
            try:
                self.guards.check(what)
            except Divergence as error:
                self.fail(str(error))
        for dec in self.decoders:
            model = self.models[dec.seq]
            if dec.length != model.length:
                self.fail(f"{what}: seq {dec.seq} length {dec.length}, model {model.length}")
            first = cache.pool.first_position(dec.seq)
            if s.window:
                need = max(0, model.length - s.window + 1)            # the next query reads from here on
                if first > need or first % s.page_size or first < model.first:
                    self.fail(f"{what}: seq {dec.seq} holds from {first}, needs {need} (was {model.first})")
            elif first:
                self.fail(f"{what}: seq {dec.seq} released positions without a window")
            model.first = first
            for layer in range(s.layers):
                K, V = dec.kv(layer)
                if not (np.array_equal(K, model.k[layer, first:model.length])
                        and np.array_equal(V, model.v[layer, first:model.length])):
                    self.fail(f"{what}: seq {dec.seq} layer {layer}: kv() differs from the model")

    def run(self) -> Summary:
        s, summary = self.s, self.summary
        start = time.perf_counter()
        warm = max(1, s.ops // 10)
        for _ in range(3):
            self.new_decoder()
        for self.op in range(s.ops):
            kind = self.run_one()
            summary.operations += 1
            summary.max_live_decoders = max(summary.max_live_decoders, len(self.decoders))
            if self.op % s.check_every == 0 or self.op == s.ops - 1:
                self.check_state(f"after op {self.op} ({kind})")
            if self.op + 1 == warm:
                gc.collect()
                summary.rss_warm_mib = rss_mib()
        self.finish()
        gc.collect()
        summary.rss_end_mib = rss_mib()
        summary.seconds = time.perf_counter() - start
        return summary

    def finish(self) -> None:
        """Free every sequence (guards too): the pool must be whole."""
        for dec in self.decoders:
            dec.free()
        self.decoders.clear()
        self.models.clear()
        if self.guards is not None:
            for seq in self.guards.sequences:
                self.cache.free(seq)
        self.cache.check_invariants()
        self.summary.leaked_pages = self.cfg.num_pages - self.cache.num_free_pages
        if self.summary.leaked_pages or self.cache.sequences:
            self.fail(f"{self.summary.leaked_pages} pages leaked, sequences left {self.cache.sequences}")
        if sorted(self.cache.pool.allocator.free_list()) != list(range(self.cfg.num_pages)):
            self.fail("the free list is not every page exactly once")


def run(settings: Settings) -> Summary:
    return Driver(settings).run()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability.driver", description=__doc__.split("\n\n")[0])
    defaults = Settings()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        elif name == "window":
            parser.add_argument(flag, type=int, default=None)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    settings = Settings(**{name: getattr(args, name) for name in asdict(defaults)})
    driver = Driver(settings)
    try:
        summary = driver.run()
        code = 0
    except Divergence as error:
        summary = driver.summary
        print(f"DIVERGENCE: {error}", file=sys.stderr)
        code = 1
    print(json.dumps(asdict(summary)) if args.json else summary.text(settings))
    return code


if __name__ == "__main__":
    sys.exit(main())
