"""The bad-input matrix: every public entry point against non-finite values (first, middle and last element of
each array), wrong ranks / head counts / head sizes, non-float dtypes, values that overflow the storage or the
computation, bad lengths and positions, freed or unknown sequences, an empty sequence, and a pool that is full
now versus one that can never fit the request.

Each case asserts the exception type, that the message is ``"name: expected ..., got ..."`` naming the argument
(with the value and index for a bad element), and that every cache involved is byte-identical afterwards
(`fingerprint`: pool bytes, NaN sentinels in every unused slot and in guard pages at both ends of the pool
included) with no page taken. Boundary controls (exactly one visible key, a length exactly at capacity, the
largest float16, zero new tokens) must pass.
"""
import re

import numpy as np
import pytest

from decode import Decoder, batch_step, batch_transaction
from decode.attention import paged_decode_attention
from kvcache import CacheFullError, KVCache
from reference.dense import decode_reference

from .driver import Guards

H, HKV, D, DV, P = 4, 2, 8, 6, 4
NONFINITE = [("nan", np.nan), ("+inf", np.inf), ("-inf", -np.inf)]
WHERE = ["first", "middle", "last"]
FULL_MESSAGE = r"needs \d+ free pages, \d+ of \d+ are free; (it fits once other sequences free pages|it can never fit: " \
               r"the pool has only \d+ pages)$"


class World:
    """Fresh state for one case: a shared pool with guard pages (pages 0 and 9) and NaN sentinels in every unused
    slot, decoders a (5 tokens), b (a fork of a, one step further), c (empty) and gone (freed); a 3-layer decoder
    (2 tokens), a float16 decoder, a window-2 decoder that released pages, and a standalone kernel scene."""

    def __init__(self):
        rng = self.rng = np.random.default_rng(0)
        self.cache = KVCache(num_kv_heads=HKV, head_dim=D, head_dim_v=DV, page_size=P, num_pages=10)
        self.guards = Guards(self.cache)
        self.a = Decoder.on_cache(self.cache, H)
        self.a.extend(*self.tokens(5))
        self.b = self.a.fork()
        self.b.step(*self.token())
        self.c = Decoder.on_cache(self.cache, H)
        self.gone = Decoder.on_cache(self.cache, H)
        self.gone.step(*self.token())
        self.gone.free()
        self.multi = Decoder(H, HKV, D, DV, page_size=P, max_tokens=24, num_layers=3)
        with self.multi.transaction(2) as tx:
            for layer in range(3):
                tx.extend(layer, *self.tokens(2))
        self.half = Decoder(H, HKV, D, DV, dtype="float16", page_size=P, max_tokens=16)
        self.half.step(*self.token())
        self.win = Decoder(H, HKV, D, DV, page_size=2, max_tokens=16, window=2)
        for _ in range(9):
            self.win.step(*self.token())
        assert self.win.cache.pool.first_position(self.win.seq) == 8
        self.guards.paint()
        self.caches = [self.cache, self.multi.cache, self.half.cache, self.win.cache]
        # a standalone kernel scene: 2 sequences over 4 pages
        self.k_pages = rng.standard_normal((4, HKV, P, D)).astype(np.float32)
        self.v_pages = rng.standard_normal((4, HKV, P, DV)).astype(np.float32)
        self.kernel = dict(q=rng.standard_normal((2, H, D)), k_pages=self.k_pages, v_pages=self.v_pages,
                           page_indices=np.array([2, 0, 3], np.int32), page_indptr=np.array([0, 2, 3]),
                           query_seq=np.array([0, 1]), query_pos=np.array([6, 1]))
        self.out = np.full((2, H, DV), 7.0, np.float32)

    def token(self, heads=H):
        return (self.rng.standard_normal((heads, D)), self.rng.standard_normal((HKV, D)),
                self.rng.standard_normal((HKV, DV)))

    def tokens(self, count, heads=H):
        return (self.rng.standard_normal((count, heads, D)), self.rng.standard_normal((count, HKV, D)),
                self.rng.standard_normal((count, HKV, DV)))

    def state(self):
        arrays = [np.array(x, copy=True) for x in self.kernel.values()] + [self.out.copy()]
        return ([c.fingerprint() for c in self.caches], [c.num_free_pages for c in self.caches], arrays)


def spoil(array, where, value):
    """A copy of ``array`` with its first / middle / last element set to ``value``; also returns the index."""
    array = np.array(array, dtype=np.float64)
    flat = {"first": 0, "middle": array.size // 2, "last": array.size - 1}[where]
    index = np.unravel_index(flat, array.shape)
    array[index] = value
    return array, tuple(int(i) for i in index)


def fmt(index):
    return "(" + ", ".join(map(str, index)) + ("," if len(index) == 1 else "") + ")"


# -- the cases: (id, call(world) -> callable, error type, message regex) ---------------------------------------
CASES = []


def case(name, error, message):
    def register(make):
        CASES.append(pytest.param(make, error, message, None, id=name))
        return make
    return register


def nonfinite_matrix(entry, arrays, build, index_shift=0):
    """27 cases (or 18 for two arrays): ``build(world, **{array: spoiled})`` is the call."""
    for array in arrays:
        for label, value in NONFINITE:
            for where in WHERE:
                def make(w, array=array, value=value, where=where):
                    return build(w, array, value, where)
                shown = {"nan": "nan", "+inf": "inf", "-inf": "-inf"}[label]
                CASES.append(pytest.param(make, ValueError, rf"^{array}: expected finite values, got {shown} at "
                                                            rf"index \(", None, id=f"{entry}-{array}-{label}-{where}"))


def spoiled(inputs, array, value, where):
    inputs = dict(inputs)
    inputs[array], _ = spoil(inputs[array], where, value)
    return inputs


# step, extend, append, batch_step, multi-layer transaction, cache.append, kernel wrapper, reference
def _step(w, array, value, where):
    q, k, v = w.token()
    x = spoiled({"q": q, "k": k, "v": v}, array, value, where)
    return lambda: w.a.step(x["q"], x["k"], x["v"])


def _extend(w, array, value, where):
    q, k, v = w.tokens(3)
    x = spoiled({"q": q, "k": k, "v": v}, array, value, where)
    return lambda: w.b.extend(x["q"], x["k"], x["v"])


def _append(w, array, value, where):
    _, k, v = w.tokens(6)
    x = spoiled({"k": k, "v": v}, array, value, where)
    return lambda: w.c.append(x["k"], x["v"])


def _batch(w, array, value, where):
    q, k, v = w.tokens(3)
    x = spoiled({"q": q, "k": k, "v": v}, array, value, where)
    return lambda: batch_step([w.a, w.b, w.c], x["q"], x["k"], x["v"])


def _transaction(w, array, value, where):
    tokens = [w.token() for _ in range(3)]
    x = spoiled(dict(zip("qkv", tokens[1])), array, value, where)
    tokens[1] = (x["q"], x["k"], x["v"])

    def call():
        with w.multi.transaction(1) as tx:
            for layer in range(3):                      # layer 0 is written before layer 1 fails
                tx.step(layer, *tokens[layer])
    return call


def _cache_append(w, array, value, where):
    _, k, v = w.tokens(5)
    x = spoiled({"k": k, "v": v}, array, value, where)
    return lambda: w.cache.append(w.b.seq, x["k"], x["v"])


def _kernel(w, array, value, where):
    x = spoiled(w.kernel, array, value, where)
    return lambda: paged_decode_attention(**x, out=w.out)


def _reference(w, array, value, where):
    q, k, v = w.tokens(3)
    x = spoiled({"q": q[:1], "k": k, "v": v}, array, value, where)
    return lambda: decode_reference(x["q"], x["k"], x["v"], 2)


for _entry, _arrays, _build in [("step", "qkv", _step), ("extend", "qkv", _extend), ("append", "kv", _append),
                                ("batch_step", "qkv", _batch), ("transaction", "qkv", _transaction),
                                ("cache.append", "kv", _cache_append), ("kernel", "q", _kernel),
                                ("reference", "qkv", _reference)]:
    nonfinite_matrix(_entry, list(_arrays), _build)


# -- shapes -----------------------------------------------------------------------------------------------------
def _shape_case(entry, array, shape, message, error=ValueError):
    def make(w):
        if entry == "step":
            x = dict(zip("qkv", w.token()))
            x[array] = np.ones(shape)
            return lambda: w.a.step(x["q"], x["k"], x["v"])
        if entry == "extend":
            x = dict(zip("qkv", w.tokens(2)))
            x[array] = np.ones(shape)
            return lambda: w.a.extend(x["q"], x["k"], x["v"])
        x = dict(zip("qkv", w.tokens(2)))
        x[array] = np.ones(shape)
        return lambda: batch_step([w.a, w.c], x["q"], x["k"], x["v"])
    CASES.append(pytest.param(make, error, message, None, id=f"{entry}-{array}-shape-{'x'.join(map(str, shape))}"))


for _array, _shape, _msg in [
        ("q", (8,), r"^q: expected shape \[num_q_heads, head_dim\] = \(4, 8\), got \(8,\)$"),
        ("q", (3, 8), r"^q: expected shape \[num_q_heads, head_dim\] = \(4, 8\), got \(3, 8\)$"),
        ("q", (4, 7), r"^q: expected shape \[num_q_heads, head_dim\] = \(4, 8\), got \(4, 7\)$"),
        ("k", (1, 2, 8), r"^k: expected shape \[num_kv_heads, head_dim\] = \(2, 8\), got \(1, 2, 8\)$"),
        ("k", (1, 8), r"^k: expected shape \[num_kv_heads, head_dim\] = \(2, 8\), got \(1, 8\)$"),
        ("k", (2, 9), r"^k: expected shape \[num_kv_heads, head_dim\] = \(2, 8\), got \(2, 9\)$"),
        ("v", (3, 6), r"^v: expected shape \[num_kv_heads, head_dim_v\] = \(2, 6\), got \(3, 6\)$"),
        ("v", (2, 8), r"^v: expected shape \[num_kv_heads, head_dim_v\] = \(2, 6\), got \(2, 8\)$")]:
    _shape_case("step", _array, _shape, _msg)
for _array, _shape, _msg in [
        ("q", (3, 4, 8), r"^q: expected shape \[T, num_q_heads, head_dim\] = \(2, 4, 8\), got \(3, 4, 8\)$"),
        ("q", (2, 2, 8), r"^q: expected shape \[T, num_q_heads, head_dim\] = \(2, 4, 8\), got \(2, 2, 8\)$"),
        ("k", (2, 8), r"^k: expected shape \[T, num_kv_heads, head_dim\], got \(2, 8\)$"),
        ("k", (2, 2, 7), r"^k: expected shape \[T, num_kv_heads, head_dim\] = \(2, 2, 8\), got \(2, 2, 7\)$"),
        ("v", (2, 1, 6), r"^v: expected shape \[T, num_kv_heads, head_dim_v\] = \(2, 2, 6\), got \(2, 1, 6\)$"),
        ("v", (3, 2, 6), r"^v: expected shape \[T, num_kv_heads, head_dim_v\] = \(2, 2, 6\), got \(3, 2, 6\)$")]:
    _shape_case("extend", _array, _shape, _msg)
for _array, _shape, _msg in [
        ("q", (3, 4, 8), r"^q: expected shape \[T, num_q_heads, head_dim\] = \(2, 4, 8\), got \(3, 4, 8\)$"),
        ("k", (2, 2, 8, 1), r"^k: expected shape \[T, num_kv_heads, head_dim\] = \(2, 2, 8\), got \(2, 2, 8, 1\)$"),
        ("v", (1, 2, 6), r"^v: expected shape \[T, num_kv_heads, head_dim_v\] = \(2, 2, 6\), got \(1, 2, 6\)$")]:
    _shape_case("batch_step", _array, _shape, _msg)


# -- dtypes ------------------------------------------------------------------------------------------------------
def _dtype_case(entry, array, dtype):
    def make(w):
        if entry == "step":
            x = dict(zip("qkv", w.token()))
        else:
            x = dict(zip("qkv", w.tokens(2)))
        x[array] = np.empty(x[array].shape, dtype=object) if dtype is object else x[array].astype(dtype)
        if dtype is object:
            x[array][...] = 1.0
        if entry == "step":
            return lambda: w.a.step(x["q"], x["k"], x["v"])
        if entry == "extend":
            return lambda: w.a.extend(x["q"], x["k"], x["v"])
        return lambda: w.c.append(x["k"], x["v"])
    name = dtype.__name__ if isinstance(dtype, type) else str(dtype)
    CASES.append(pytest.param(make, TypeError, rf"^{array}: expected a real floating-point array, got dtype ",
                              None, id=f"{entry}-{array}-{name}"))


for _entry, _arrays in [("step", "qkv"), ("extend", "qkv"), ("append", "kv")]:
    for _array in _arrays:
        for _dtype in (np.int64, bool, np.complex128, object):
            _dtype_case(_entry, _array, _dtype)


# -- overflow: the storage dtype and the compute dtype --------------------------------------------------------
def _overflow(entry, array, value, message):
    def make(w):
        x = dict(zip("qkv", w.token()))
        x[array], _ = spoil(x[array], "middle", value)
        dec = w.half if entry == "float16" else w.a
        return lambda: dec.step(x["q"], x["k"], x["v"])
    CASES.append(pytest.param(make, ValueError, message, None, id=f"{entry}-{array}-overflow-{value:g}"))


for _array in "kv":
    for _value in (65520.0, -1e5, 1e300):
        _overflow("float16", _array, _value, rf"^{_array}: expected values finite in float16 storage \(\|x\| <= "
                                             rf"65504\.0\), got {re.escape(repr(_value))} at index \(1, 0\)$")
    _overflow("float32", _array, 1e15, rf"^{_array}: expected \|x\| < 2\.81475e\+14 \(scores q\.k \* scale and the "
                                       rf"weighted sums of v must stay finite in float32\), got 1000000000000000\.0 at index \(1, 0\)$")
_overflow("float32", "q", 1e39, r"^q: expected values finite in float32 storage \(\|x\| <= 3\.40282\d*e\+38\), got "
                                r"1e\+39 at index \(2, 0\)$")
_overflow("float32", "q", 1e30, r"^q: expected \|x\| < 1\.06855e\+23 \(scores q\.k \* scale and the weighted sums "
                                r"of v must stay finite in float32\), got 1e\+30 at index \(2, 0\)$")


# -- lengths, positions, layers, counts ---------------------------------------------------------------------------
SCALARS = [
    ("truncate-n-negative", lambda w: lambda: w.a.truncate(-1), ValueError, r"^n: expected an integer in \[0, 5\], got -1$"),
    ("truncate-n-too-large", lambda w: lambda: w.a.truncate(6), ValueError, r"^n: expected an integer in \[0, 5\], got 6$"),
    ("truncate-n-float", lambda w: lambda: w.a.truncate(2.0), TypeError, r"^n: expected an integer, got float 2\.0$"),
    ("truncate-n-numpy-float", lambda w: lambda: w.a.truncate(np.float64(2)), TypeError,
     r"^n: expected an integer, got float64 "),
    ("truncate-n-bool", lambda w: lambda: w.a.truncate(True), TypeError, r"^n: expected an integer, got bool True$"),
    ("truncate-n-str", lambda w: lambda: w.a.truncate("1"), TypeError, r"^n: expected an integer, got str '1'$"),
    ("truncate-n-none", lambda w: lambda: w.a.truncate(None), TypeError, r"^n: expected an integer, got NoneType"),
    ("truncate-empty", lambda w: lambda: w.c.truncate(1), ValueError, r"^n: expected an integer in \[0, 0\], got 1$"),
    ("truncate-window-released", lambda w: lambda: w.win.truncate(8), ValueError,
     r"^n: expected >= 9 \(K/V before position 8 was released by the sliding window\), got 8$"),
    ("transaction-count-negative", lambda w: lambda: w.multi.transaction(-1), ValueError,
     r"^num_tokens: expected an integer >= 0, got -1$"),
    ("transaction-count-bool", lambda w: lambda: w.multi.transaction(True), TypeError,
     r"^num_tokens: expected an integer, got bool True$"),
    ("transaction-count-float", lambda w: lambda: w.multi.transaction(1.0), TypeError,
     r"^num_tokens: expected an integer, got float 1\.0$"),
    ("step-on-multi-layer", lambda w: lambda: w.multi.step(*w.token()), ValueError,
     r"^step: expected a one-layer cache \(use transaction\(\) for several layers\), got num_layers=3$"),
    ("extend-on-multi-layer", lambda w: lambda: w.multi.extend(*w.tokens(1)), ValueError,
     r"^extend: expected a one-layer cache"),
    ("batch-on-multi-layer", lambda w: lambda: batch_step([w.multi], *w.tokens(1)), ValueError,
     r"^batch_step: expected a one-layer cache"),
]


def _tx_layer(layer, error):
    def make(w):
        q, k, v = w.token()

        def call():
            with w.multi.transaction(1) as tx:
                tx.step(0, q, k, v)
                tx.step(layer, q, k, v)
        return call
    return make


SCALARS += [
    ("transaction-layer-too-large", _tx_layer(3, ValueError), ValueError, r"^layer: expected an integer in \[0, 2\], got 3$"),
    ("transaction-layer-negative", _tx_layer(-1, ValueError), ValueError, r"^layer: expected an integer in \[0, 2\], got -1$"),
    ("transaction-layer-bool", _tx_layer(True, TypeError), TypeError, r"^layer: expected an integer, got bool True$"),
    ("transaction-layer-float", _tx_layer(1.0, TypeError), TypeError, r"^layer: expected an integer, got float 1\.0$"),
]


def _missing_layer(w):
    q, k, v = w.tokens(2)

    def call():
        with w.multi.transaction(2) as tx:
            tx.extend(0, q, k, v)
            tx.extend(2, q, k, v)
    return call


def _after_commit(w):
    q, k, v = w.token()
    tx = w.multi.transaction(1)
    for layer in range(3):
        tx.step(layer, q, k, v)
    tx.commit()
    w.caches[1] = w.multi.cache                         # the state to keep is the committed one
    w.baseline = w.state()
    return lambda: tx.step(0, q, k, v)


SCALARS += [
    ("transaction-missing-layer", _missing_layer, ValueError,
     r"^commit: expected every layer written, got layers \{\d+: \[1\]\} missing \(seq: layers\)$"),
    ("transaction-step-after-commit", _after_commit, RuntimeError,
     r"^transaction: expected an open transaction, got one already finished$"),
]


# -- sequences: freed, unknown, busy ---------------------------------------------------------------------------
def _busy(action):
    def make(w):
        tx = w.a.transaction(1)                          # left open on purpose: a's sequence is busy
        w.baseline = w.state()
        calls = {"fork": w.a.fork, "free": w.a.free, "truncate": lambda: w.a.truncate(1),
                 "step": lambda: w.a.step(*w.token()), "release": lambda: w.cache.release_before(w.a.seq, 4)}
        w.cleanup = tx.rollback
        return calls[action]
    return make


SEQUENCES = [
    ("freed-step", lambda w: lambda: w.gone.step(*w.token()), ValueError, r"^seq: expected a live sequence id \["),
    ("freed-extend", lambda w: lambda: w.gone.extend(*w.tokens(2)), ValueError, r"^seq: expected a live sequence id"),
    ("freed-append", lambda w: lambda: w.gone.append(*w.tokens(2)[1:]), ValueError, r"^seq: expected a live sequence"),
    ("freed-truncate", lambda w: lambda: w.gone.truncate(0), ValueError, r"^seq: expected a live sequence id"),
    ("freed-fork", lambda w: w.gone.fork, ValueError, r"^seq: expected a live sequence id"),
    ("freed-free", lambda w: w.gone.free, ValueError,
     r"^seq: expected a live sequence id \[0, 2, 3, 4, 5\], got 6 \(freed or never created\)$"),
    ("freed-kv", lambda w: w.gone.kv, ValueError, r"^seq: expected a live sequence id"),
    ("freed-transaction", lambda w: lambda: w.gone.transaction(1), ValueError, r"^seq: expected a live sequence id"),
    ("freed-in-batch", lambda w: lambda: batch_step([w.a, w.gone], *w.tokens(2)), ValueError,
     r"^seq: expected a live sequence id"),
    ("batch-empty", lambda w: lambda: batch_step([], *w.tokens(0)), TypeError,
     r"^decoders: expected a non-empty list of Decoder, got \[\]$"),
    ("batch-not-decoders", lambda w: lambda: batch_transaction([w.a, 3]), TypeError,
     r"^decoders: expected a non-empty list of Decoder, got "),
    ("batch-repeated", lambda w: lambda: batch_step([w.a, w.c, w.a], *w.tokens(3)), ValueError,
     r"^decoders: expected distinct sequences, got sequence ids \[3, 5, 3\]$"),
    ("batch-two-pools", lambda w: lambda: batch_step([w.a, w.half], *w.tokens(2)), ValueError,
     r"^decoders: expected decoders sharing one cache \(Decoder.on_cache\), got several caches$"),
    ("batch-two-windows", lambda w: _then_baseline(w, lambda: batch_step([w.a, w.other], *w.tokens(2)),
                                                   other=Decoder.on_cache(w.cache, H, window=3)),
     ValueError, r"^decoders: expected one num_q_heads/scale/window, got \(4, 0\.35\d*, 0\) and \(4, 0\.35\d*, 3\)$"),
    ("busy-fork", _busy("fork"), RuntimeError,
     r"^seq: expected a sequence with no open transaction, got 3 \(in a transaction\)$"),
    ("busy-free", _busy("free"), RuntimeError, r"^seq: expected a sequence with no open transaction"),
    ("busy-truncate", _busy("truncate"), RuntimeError, r"^seq: expected a sequence with no open transaction"),
    ("busy-step", _busy("step"), RuntimeError, r"^seq: expected a sequence with no open transaction"),
    ("busy-release", _busy("release"), RuntimeError, r"^seq: expected a sequence with no open transaction"),
]

for _name, _id in [("negative", -1), ("unknown", 99)]:
    SEQUENCES += [
        (f"cache.append-{_name}-id", lambda w, i=_id: lambda: w.cache.append(i, *w.tokens(1)[1:]), ValueError,
         rf"^seq: expected a live sequence id \[.*\], got {_id} \(freed or never created\)$"),
        (f"cache.truncate-{_name}-id", lambda w, i=_id: lambda: w.cache.truncate(i, 0), ValueError,
         r"^seq: expected a live sequence id"),
        (f"cache.fork-{_name}-id", lambda w, i=_id: lambda: w.cache.fork(i), ValueError, r"^seq: expected a live"),
        (f"cache.free-{_name}-id", lambda w, i=_id: lambda: w.cache.free(i), ValueError, r"^seq: expected a live"),
        (f"cache.release-{_name}-id", lambda w, i=_id: lambda: w.cache.release_before(i, 0), ValueError,
         r"^seq: expected a live sequence id"),
        (f"cache.transaction-{_name}-id", lambda w, i=_id: lambda: w.cache.transaction({w.a.seq: 1, i: 1}),
         ValueError, r"^seq: expected a live sequence id"),
    ]
for _name, _id in [("str", "a"), ("none", None), ("bool", True), ("float", 2.0), ("list", [2])]:
    SEQUENCES += [
        (f"cache.free-{_name}-id", lambda w, i=_id: lambda: w.cache.free(i), TypeError,
         r"^seq: expected an integer sequence id, got "),
        (f"cache.transaction-list-{_name}-id", lambda w, i=_id: lambda: w.cache.transaction([w.a.seq, i]), TypeError,
         r"^seq: expected an integer sequence id, got "),
    ]
    if not isinstance(_id, list):                     # a list is the one-token-each shape of `KVCache.transaction`
        SEQUENCES.append((f"cache.transaction-{_name}-id", lambda w, i=_id: lambda: w.cache.transaction(i), TypeError,
                          r"^seq: expected an integer sequence id, got "))

CACHE_LEVEL = [
    ("cache.truncate-n-too-large", lambda w: lambda: w.cache.truncate(w.a.seq, 6), ValueError,
     r"^n: expected an integer in \[0, 5\], got 6$"),
    ("cache.truncate-n-bool", lambda w: lambda: w.cache.truncate(w.a.seq, False), TypeError,
     r"^n: expected an integer, got bool False$"),
    ("cache.release-position-negative", lambda w: lambda: w.cache.release_before(w.a.seq, -1), ValueError,
     r"^position: expected an integer in \[0, 5\], got -1$"),
    ("cache.release-position-too-large", lambda w: lambda: w.cache.release_before(w.a.seq, 6), ValueError,
     r"^position: expected an integer in \[0, 5\], got 6$"),
    ("cache.release-position-float", lambda w: lambda: w.cache.release_before(w.a.seq, 4.0), TypeError,
     r"^position: expected an integer, got float 4\.0$"),
    ("cache.release-empty", lambda w: lambda: w.cache.release_before(w.c.seq, 1), ValueError,
     r"^position: expected an integer in \[0, 0\], got 1$"),
    ("cache.transaction-count-negative", lambda w: lambda: w.cache.transaction({w.a.seq: -2}), ValueError,
     r"^num_tokens\[3\]: expected an integer >= 0, got -2$"),
    ("cache.transaction-count-bool", lambda w: lambda: w.cache.transaction({w.a.seq: True}), TypeError,
     r"^num_tokens\[3\]: expected an integer, got bool True$"),
    ("cache.transaction-count-float", lambda w: lambda: w.cache.transaction({w.a.seq: 1.5}), TypeError,
     r"^num_tokens\[3\]: expected an integer, got float 1\.5$"),
    ("cache.append-3d-into-multi-layer", lambda w: lambda: w.multi.cache.append(w.multi.seq, *w.tokens(1)[1:]),
     ValueError, r"^k: expected shape \[num_layers, T, num_kv_heads, head_dim\] = \(3, T, 2, 8\), got \(1, 2, 8\)$"),
    ("cache.append-int", lambda w: lambda: w.cache.append(w.a.seq, np.ones((1, 2, 8), int), np.ones((1, 2, 6))),
     TypeError, r"^k: expected a real floating-point array, got dtype int64$"),
    ("cache.append-float16-overflow", lambda w: lambda: w.half.cache.append(w.half.seq, np.full((1, 2, 8), 7e4),
                                                                           np.ones((1, 2, 6))),
     ValueError, r"^k: expected values finite in float16 storage \(\|x\| <= 65504\.0\), got 70000\.0 at index "
                 r"\(0, 0, 0, 0\)$"),
    ("cache.gather-layer", lambda w: lambda: w.cache.gather(w.a.seq, 1), ValueError,
     r"^layer: expected an integer in \[0, 0\], got 1$"),
    ("cache.k_pages-layer", lambda w: lambda: w.multi.cache.pool.k_pages(-1), ValueError,
     r"^layer: expected an integer in \[0, 2\], got -1$"),
]


def _memory(call, module="kvcache.accounting"):
    def make(w):
        import importlib
        return lambda: call(importlib.import_module(module))
    return make


def _report(call):
    return _memory(call, "decode.app.measure_memory")


MEMORY = [
    ("memory.cache_memory-type", _memory(lambda m: m.cache_memory("cache")), TypeError,
     r"^cache: expected a KVCache, got str$"),
    ("memory.formula-layers", _memory(lambda m: m.kv_bytes_formula(0, 1, 1, 1, 1, 2)), ValueError,
     r"^layers: expected an integer >= 1, got 0$"),
    ("memory.formula-tokens", _memory(lambda m: m.kv_bytes_formula(1, 1, -1, 1, 1, 2)), ValueError,
     r"^tokens: expected an integer >= 0, got -1$"),
    ("memory.formula-bool", _memory(lambda m: m.kv_bytes_formula(1, 1, 1, 1, True, 2)), TypeError,
     r"^head_dim: expected an integer, got bool True$"),
    ("memory.report-kv-heads", _report(lambda m: m.memory_report(kv_heads=3, measure=False)), ValueError,
     r"^kv_heads: expected a divisor of num_q_heads=32, got 3$"),
    ("memory.report-no-kv-heads", _report(lambda m: m.memory_report(kv_heads=[], measure=False)), ValueError,
     r"^kv_heads: expected at least one KV-head count, got none$"),
    ("memory.report-dtype", _report(lambda m: m.memory_report(dtype="int16", measure=False)), TypeError,
     r"^dtype: expected one of float16, float32, float64, int8, bfloat16, got 'int16'$"),
]


def _full(make_call, prepare=None):
    def make(w):
        if prepare:
            prepare(w)
        filler = Decoder.on_cache(w.cache, H)               # take every free page: nothing fits now
        while w.cache.num_free_pages:
            filler.append(*w.tokens(P)[1:])
        w.guards.paint()
        w.baseline = w.state()
        return make_call(w)
    return make


FULL = [
    ("full-now-step", _full(lambda w: lambda: w.c.step(*w.token())), True),
    ("full-now-extend", _full(lambda w: lambda: w.a.extend(*w.tokens(4))), True),      # 5 + 4: a third page
    ("full-now-append", _full(lambda w: lambda: w.c.append(*w.tokens(1)[1:])), True),
    ("full-now-batch", _full(lambda w: lambda: batch_step([w.a, w.c], *w.tokens(2))), True),
    ("full-now-cow", _full(lambda w: lambda: w.fork.step(*w.token()),                   # a shared partial page
                           prepare=lambda w: setattr(w, "fork", w.a.fork())), True),
    ("full-now-transaction", _full(lambda w: lambda: w.cache.transaction({w.a.seq: 1, w.c.seq: 1})), True),
    ("never-extend", lambda w: lambda: w.c.extend(*w.tokens(41)), False),              # 11 pages of a 10-page pool
    ("never-append", lambda w: lambda: w.a.append(*w.tokens(36)[1:]), False),           # 5 + 36 tokens: 11 pages
    ("never-multi-layer", lambda w: lambda: w.multi.transaction(23), False),            # 2 + 23 > 24 tokens
    ("never-cache-append", lambda w: lambda: w.cache.append(w.c.seq, *w.tokens(64)[1:]), False),
]


# -- the kernel wrapper and the reference -------------------------------------------------------------------------
def _kw(**changes):
    def make(w):
        args = dict(w.kernel)
        args.update({k: (v(w) if callable(v) else v) for k, v in changes.items()})
        out = args.pop("out", w.out)
        return lambda: paged_decode_attention(**args, out=out)
    return make


def _then_baseline(w, call, **prepared):
    """Set up ``prepared`` attributes (changing the cache), then take the baseline the call must keep."""
    for name, value in prepared.items():
        setattr(w, name, value)
    w.guards.paint()
    w.baseline = w.state()
    return call


KERNEL = [
    ("kernel-q-int", _kw(q=lambda w: np.ones((2, H, D), int)), TypeError,
     r"^q: expected a float32 or float64 array, got dtype int64$"),
    ("kernel-q-complex", _kw(q=lambda w: np.ones((2, H, D), complex)), TypeError, r"^q: expected a float32 or "),
    ("kernel-q-bool", _kw(q=lambda w: np.ones((2, H, D), bool)), TypeError, r"^q: expected a float32 or float64"),
    ("kernel-q-float16", _kw(q=lambda w: np.ones((2, H, D), np.float16)), TypeError,
     r"^q: expected float32 or float64, got dtype float16$"),
    ("kernel-q-2d", _kw(q=lambda w: np.ones((H, D))), ValueError, r"^q: expected a 3-d array, got shape \(4, 8\)$"),
    ("kernel-q-head-dim", _kw(q=lambda w: np.ones((2, H, 7))), ValueError,
     r"^q: expected head_dim 8 \(from k_pages\), got shape \(2, 4, 7\)$"),
    ("kernel-q-heads", _kw(q=lambda w: np.ones((2, 3, D))), ValueError,
     r"^q: expected num_q_heads a positive multiple of num_kv_heads=2, got 3$"),
    ("kernel-q-overflow", _kw(q=lambda w: np.full((2, H, D), 1e39)), ValueError,
     r"^q: expected values finite in float32 \(\|x\| <= 3\.4028235e\+38\), got 1e\+39 at index \(0, 0, 0\)$"),
    ("kernel-k-list", _kw(k_pages=lambda w: w.k_pages.tolist()), TypeError, r"^k_pages: expected a numpy array, got list$"),
    ("kernel-k-int", _kw(k_pages=lambda w: w.k_pages.astype(int)), TypeError,
     r"^k_pages: expected float16, float32, float64 or int8 \(or uint16 bfloat16 bits with storage='bfloat16'\), "
     r"got dtype int64$"),
    ("kernel-k-3d", _kw(k_pages=lambda w: w.k_pages[0]), ValueError, r"^k_pages: expected a 4-d array"),
    ("kernel-k-strided", _kw(k_pages=lambda w: w.k_pages[:, :, ::2]), ValueError,
     r"^k_pages: expected a C-contiguous array, got strides "),
    ("kernel-v-dtype", _kw(v_pages=lambda w: w.v_pages.astype(np.float64)), TypeError,
     r"^v_pages: expected dtype float32 \(as k_pages\), got float64$"),
    ("kernel-v-shape", _kw(v_pages=lambda w: w.v_pages[:3].copy()), ValueError,
     r"^v_pages: expected shape \(4, 2, 4, head_dim_v\) like k_pages, got \(3, 2, 4, 6\)$"),
    ("kernel-indices-float", _kw(page_indices=np.array([2.0, 0.0, 3.0])), TypeError,
     r"^page_indices: expected an integer array, got dtype float64$"),
    ("kernel-indices-too-large", _kw(page_indices=np.array([2, 4, 3])), ValueError,
     r"^page_indices: expected physical pages in \[0, 4\) \(or -1 for a freed page\), got 4 at index 1$"),
    ("kernel-indices-below-minus-one", _kw(page_indices=np.array([2, -2, 3])), ValueError,
     r"^page_indices: expected physical pages in \[0, 4\) \(or -1 for a freed page\), got -2 at index 1$"),
    ("kernel-indices-released-visible", _kw(page_indices=np.array([-1, 0, 3])), ValueError,
     r"^page_indices: expected allocated pages for the visible positions 0\.\.6 of query 0 \(sequence 0\), got a "
     r"freed page \(-1\)$"),
    ("kernel-indptr-decreasing", _kw(page_indptr=np.array([0, 3, 2])), ValueError,
     r"^page_indptr: expected non-decreasing offsets in \[0, 3\], got \[0, 3, 2\]"),
    ("kernel-indptr-short", _kw(page_indptr=np.array([0])), ValueError,
     r"^page_indptr: expected num_seqs \+ 1 >= 2 entries, got 1$"),
    ("kernel-query-seq-out-of-range", _kw(query_seq=np.array([0, 2])), ValueError,
     r"^query_seq: expected sequence indices in \[0, 2\), got 2 at index 1$"),
    ("kernel-query-seq-length", _kw(query_seq=np.array([0])), ValueError,
     r"^query_seq: expected 2 entries \(num_queries\), got 1$"),
    ("kernel-position-negative", _kw(query_pos=np.array([6, -1])), ValueError,
     r"^query_pos: expected 0 <= position < 4 \(the page capacity of sequence 1\), got -1 at index 1$"),
    ("kernel-position-beyond-table", _kw(query_pos=np.array([8, 1])), ValueError,
     r"^query_pos: expected 0 <= position < 8 \(the page capacity of sequence 0\), got 8 at index 0$"),
    ("kernel-position-float", _kw(query_pos=np.array([6.0, 1.0])), TypeError,
     r"^query_pos: expected an integer array, got dtype float64$"),
    ("kernel-scale-zero", _kw(scale=0.0), ValueError, r"^scale: expected a finite float > 0, got 0\.0$"),
    ("kernel-scale-nan", _kw(scale=float("nan")), ValueError, r"^scale: expected a finite float > 0, got nan$"),
    ("kernel-scale-bool", _kw(scale=True), TypeError, r"^scale: expected a float, got bool$"),
    ("kernel-window-negative", _kw(window=-1), ValueError, r"^window: expected an int >= 0 \(0 = no window\), got -1$"),
    ("kernel-window-float", _kw(window=1.5), TypeError, r"^window: expected an int, got float$"),
    ("kernel-out-dtype", _kw(out=np.zeros((2, H, DV))), TypeError, r"^out: expected dtype float32, got float64$"),
    ("kernel-out-shape", _kw(out=np.zeros((2, H, D), np.float32)), ValueError,
     r"^out: expected shape \(2, 4, 6\), got \(2, 4, 8\)$"),
]

REFERENCE = [
    ("reference-q-int", lambda w: lambda: decode_reference(np.ones((1, H, D), int), np.ones((3, HKV, D)),
                                                           np.ones((3, HKV, DV)), 2),
     TypeError, r"^q: expected a float dtype \(float16, float32 or float64\), got int64$"),
    ("reference-q-2d", lambda w: lambda: decode_reference(np.ones((H, D)), np.ones((3, HKV, D)), np.ones((3, HKV, DV)), 2),
     ValueError, r"^q: expected 3 dimensions \[T, num_q_heads, head_dim\], got shape \(4, 8\)$"),
    ("reference-k-head-dim", lambda w: lambda: decode_reference(np.ones((1, H, D)), np.ones((3, HKV, 7)),
                                                                np.ones((3, HKV, DV)), 2),
     ValueError, r"^k: expected head_dim 8 \(q's last axis\), got 7$"),
    ("reference-heads", lambda w: lambda: decode_reference(np.ones((1, 3, D)), np.ones((3, HKV, D)),
                                                           np.ones((3, HKV, DV)), 2),
     ValueError, r"^q: expected num_q_heads divisible by num_kv_heads = 2, got 3$"),
    ("reference-v-length", lambda w: lambda: decode_reference(np.ones((1, H, D)), np.ones((3, HKV, D)),
                                                              np.ones((2, HKV, DV)), 2),
     ValueError, r"^v: expected \[L, num_kv_heads\] = \(3, 2\) like k, got \(2, 2\)$"),
    ("reference-start-too-large", lambda w: lambda: decode_reference(np.ones((1, H, D)), np.ones((3, HKV, D)),
                                                                     np.ones((3, HKV, DV)), 3),
     ValueError, r"^query_start: expected query_start \+ Lq <= Lk = 3, got 3 \+ 1 = 4$"),
    ("reference-start-negative", lambda w: lambda: decode_reference(np.ones((1, H, D)), np.ones((3, HKV, D)),
                                                                    np.ones((3, HKV, DV)), -1),
     ValueError, r"^query_start: expected a non-negative int, got -1$"),
    ("reference-start-bool", lambda w: lambda: decode_reference(np.ones((1, H, D)), np.ones((3, HKV, D)),
                                                                np.ones((3, HKV, DV)), True),
     ValueError, r"^query_start: expected a non-negative int, got True of type bool$"),
    ("reference-window-zero", lambda w: lambda: decode_reference(np.ones((1, H, D)), np.ones((3, HKV, D)),
                                                                 np.ones((3, HKV, DV)), 2, window=0),
     ValueError, r"^window: expected None or an int >= 1, got 0$"),
    ("reference-scale-negative", lambda w: lambda: decode_reference(np.ones((1, H, D)), np.ones((3, HKV, D)),
                                                                    np.ones((3, HKV, DV)), 2, scale=-1.0),
     ValueError, r"^scale: expected a finite positive number, got -1\.0$"),
]

for _group in (SCALARS, SEQUENCES, CACHE_LEVEL, MEMORY, KERNEL, REFERENCE):
    for _name, _make, _error, _message in _group:
        CASES.append(pytest.param(_make, _error, _message, None, id=_name))
for _name, _make, _ever in FULL:
    CASES.append(pytest.param(_make, CacheFullError, FULL_MESSAGE, _ever, id=_name))


@pytest.mark.parametrize("make, error, message, could_ever_fit", CASES)
def test_bad_input(make, error, message, could_ever_fit):
    w = World()
    w.baseline = w.state()
    w.cleanup = None
    call = make(w)
    with pytest.raises(error) as info:
        call()
    text = str(info.value)
    assert re.search(message, text), f"{text!r} does not match {message!r}"
    if error is not CacheFullError:
        assert re.match(r"^[\w.\[\]]+: expected .+, got .+", text, re.S), text
    else:
        assert info.value.could_ever_fit is could_ever_fit
        assert info.value.pages_needed > info.value.pages_free == w.cache.num_free_pages or not info.value.could_ever_fit
    fingerprints, free, arrays = w.state()
    assert fingerprints == w.baseline[0], "the failed call changed a cache"
    assert free == w.baseline[1], "the failed call took pages"
    for before, after in zip(w.baseline[2], arrays):
        np.testing.assert_array_equal(before, after)                # kernel inputs and `out` untouched
    for cache in w.caches:
        cache.check_invariants()
    w.guards.check("a failed call")
    if w.cleanup:
        w.cleanup()


def test_the_matrix_is_large():
    assert len(CASES) >= 300


def test_constructor_errors():
    """Decoder construction: each argument named (no cache exists to compare)."""
    cases = [(dict(num_q_heads=3), ValueError, "num_q_heads: expected a multiple of num_kv_heads=2, got 3"),
             (dict(num_q_heads=0), ValueError, "num_q_heads: expected an integer >= 1, got 0"),
             (dict(num_q_heads=4.0), TypeError, "num_q_heads: expected an integer, got float 4.0"),
             (dict(num_kv_heads=0), ValueError, "num_kv_heads: expected an integer >= 1, got 0"),
             (dict(head_dim=True), TypeError, "head_dim: expected an integer, got bool True"),
             (dict(head_dim_v=0), ValueError, "head_dim_v: expected an integer >= 1, got 0"),
             (dict(dtype="int16"), TypeError, "dtype: expected one of float16, float32, float64, int8, bfloat16, got 'int16'"),
             (dict(dtype=None), TypeError, "dtype: expected one of float16, float32, float64, int8, bfloat16, got None"),
             (dict(dtype=np.complex64), TypeError, "dtype: expected one of float16, float32, float64, int8, bfloat16, got "),
             (dict(page_size=0), ValueError, "page_size: expected an integer >= 1, got 0"),
             (dict(page_size=1.0), TypeError, "page_size: expected an integer, got float 1.0"),
             (dict(max_tokens=0), ValueError, "max_tokens: expected an integer >= 1, got 0"),
             (dict(max_tokens="10"), TypeError, "max_tokens: expected an integer, got str '10'"),
             (dict(scale=0.0), ValueError, "scale: expected a finite float > 0, got 0.0"),
             (dict(scale="1"), TypeError, "scale: expected a finite float > 0, got str '1'"),
             (dict(window=0), ValueError, "window: expected an integer >= 1, got 0"),
             (dict(window=True), TypeError, "window: expected an integer, got bool True"),
             (dict(num_layers=0), ValueError, "num_layers: expected an integer >= 1, got 0")]
    for kwargs, error, message in cases:
        args = dict(num_q_heads=4, num_kv_heads=2, head_dim=8)
        args.update(kwargs)
        with pytest.raises(error) as info:
            Decoder(**args)
        assert str(info.value).startswith(message), (kwargs, str(info.value))
    with pytest.raises(TypeError, match=r"^cache: expected a kvcache.KVCache, got dict$"):
        Decoder.on_cache({}, 4)


# -- boundary controls: these must pass ------------------------------------------------------------------------
def test_exactly_one_visible_key():
    """The first token of a sequence, and every token with window=1, attend to exactly one key: the output is
    that key's V row (for every query head of its group)."""
    rng = np.random.default_rng(1)
    for window in (None, 1):
        dec = Decoder(H, HKV, D, DV, page_size=P, max_tokens=16, window=window, dtype="float64")
        for _ in range(1 if window is None else 9):
            q, k, v = rng.standard_normal((H, D)), rng.standard_normal((HKV, D)), rng.standard_normal((HKV, DV))
            np.testing.assert_allclose(dec.step(q, k, v), np.repeat(v, H // HKV, axis=0), rtol=1e-15, atol=0)


def test_length_exactly_at_capacity_then_one_more():
    rng = np.random.default_rng(2)
    dec = Decoder(H, HKV, D, DV, page_size=P, max_tokens=12)
    q, k, v = rng.standard_normal((12, H, D)), rng.standard_normal((12, HKV, D)), rng.standard_normal((12, HKV, DV))
    out = dec.extend(q, k, v)                                          # exactly the pool's 12 slots
    np.testing.assert_allclose(out, decode_reference(q, k.astype(np.float32), v.astype(np.float32), 0),
                               rtol=2e-5, atol=2e-6)
    assert dec.length == 12 and dec.cache.num_free_pages == 0
    before = dec.cache.fingerprint()
    with pytest.raises(CacheFullError) as info:
        dec.step(q[0], k[0], v[0])
    assert not info.value.could_ever_fit and dec.cache.fingerprint() == before
    dec.truncate(11)
    dec.step(q[0], k[0], v[0])                                         # the last slot again
    assert dec.length == 12


def test_float16_extremes_are_stored_exactly():
    dec = Decoder(H, HKV, D, DV, dtype="float16", page_size=P, max_tokens=8)
    k = np.full((HKV, D), 65504.0)
    k[0, 0] = 65519.0                                                  # rounds to 65504: finite, accepted
    k[1, 1] = -65504.0
    out = dec.step(np.zeros((H, D)), k, np.full((HKV, DV), -65504.0))
    K, V = dec.kv()
    assert K[0, 0, 0] == 65504 and K[0, 1, 1] == -65504 and (V == -65504).all()
    np.testing.assert_array_equal(out, -65504.0)


def test_zero_new_tokens_and_numpy_integers():
    rng = np.random.default_rng(3)
    dec = Decoder(H, HKV, D, DV, page_size=P, max_tokens=8)
    before = dec.cache.fingerprint()
    out = dec.extend(np.zeros((0, H, D)), np.zeros((0, HKV, D)), np.zeros((0, HKV, DV)))
    assert out.shape == (0, H, DV) and dec.length == 0 and dec.cache.fingerprint() == before
    dec.extend(rng.standard_normal((5, H, D)), rng.standard_normal((5, HKV, D)), rng.standard_normal((5, HKV, DV)))
    dec.truncate(np.int64(3))
    assert dec.length == 3
    assert dec.cache.release_before(dec.seq, np.int32(3)) == 0
    with dec.transaction(np.uint8(1)) as tx:
        tx.step(np.int16(0), rng.standard_normal((H, D)), rng.standard_normal((HKV, D)),
                rng.standard_normal((HKV, DV)))
    assert dec.length == 4
