"""Regression tests for the bugs the reliability suite found (one test, or a few, per fix; see docs/reliability.md)."""
import re

import numpy as np
import pytest

from decode import Decoder
from kvcache import KVCache
from kvcache.testing import set_fault_hook


def _token(rng, dec):
    cfg = dec.config
    return (rng.standard_normal((dec.num_q_heads, cfg.head_dim)), rng.standard_normal((cfg.num_kv_heads, cfg.head_dim)),
            rng.standard_normal((cfg.num_kv_heads, cfg.head_dim_v)))


# -- 1. Decoder.step with a float dtype numba cannot type (float16, long double, byte-swapped) -------------------
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [np.longdouble, ">f8", ">f4", "<f2" if np.little_endian else ">f2"])
def test_step_accepts_any_real_float_dtype_like_extend(which, dtype):
    """The step fast path handed float16, long-double and byte-swapped arrays to the jitted finiteness check,
    which failed with numba's NotImplementedError / TypingError (no argument name; float16 q/k/v into a float16
    cache is the common case). They are real floats, accepted everywhere else. Its slow path also named the
    index of a bad element in a [1, H, D] copy instead of the caller's [H, D] array."""
    rng = np.random.default_rng(1)
    a, b = Decoder(4, 2, 8, page_size=4, max_tokens=32), Decoder(4, 2, 8, page_size=4, max_tokens=32)
    for _ in range(3):
        q, k, v = _token(rng, a)
        args = {"q": q, "k": k, "v": v}
        args[which] = args[which].astype(dtype)
        np.testing.assert_array_equal(a.step(args["q"], args["k"], args["v"]),
                                      b.extend(args["q"][None], args["k"][None], args["v"][None])[0])
    bad = args[which].copy()
    bad[0, -1] = np.nan
    args[which] = bad
    before = a.cache.fingerprint()
    with pytest.raises(ValueError, match=rf"^{which}: expected finite values, got nan at index \(0, 7\)"):
        a.step(args["q"], args["k"], args["v"])
    assert a.cache.fingerprint() == before


# -- 2. Decoder(scale=...) of a non-real type -------------------------------------------------------------------
@pytest.mark.parametrize("scale", ["0.5", 1j, np.complex64(1), [0.5], np.array([0.5]), object(), True])
def test_scale_of_a_wrong_type_is_a_type_error_naming_scale(scale):
    """A str, complex or Decimal scale raised numpy's / Python's own TypeError (no argument name)."""
    with pytest.raises(TypeError, match=r"^scale: expected a finite float > 0, got "):
        Decoder(4, 2, 8, scale=scale)


def test_scale_decimal_and_fraction():
    from decimal import Decimal
    from fractions import Fraction
    with pytest.raises(TypeError, match="^scale: expected a finite float > 0, got Decimal"):
        Decoder(4, 2, 8, scale=Decimal("0.5"))
    assert Decoder(4, 2, 8, scale=Fraction(1, 2)).scale == 0.5
    assert Decoder(4, 2, 8, scale=np.float32(0.25)).scale == 0.25


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), np.float32("nan")])
def test_scale_out_of_range_is_a_value_error(scale):
    with pytest.raises(ValueError, match=r"^scale: expected a finite float > 0, got "):
        Decoder(4, 2, 8, scale=scale)


# -- 3. Decoder.on_cache with a bad argument ---------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_q_heads=3), ValueError, "num_q_heads: expected a multiple of num_kv_heads=2, got 3"),
    (dict(num_q_heads=0), ValueError, "num_q_heads: expected an integer >= 1, got 0"),
    (dict(num_q_heads=4, scale=-1.0), ValueError, "scale: expected a finite float > 0, got -1.0"),
    (dict(num_q_heads=4, window=0), ValueError, "window: expected an integer >= 1, got 0"),
    (dict(num_q_heads=4, window=2.0), TypeError, "window: expected an integer, got float 2.0"),
])
def test_on_cache_with_a_bad_argument_creates_no_sequence(kwargs, error, message):
    """on_cache created the new sequence before checking its arguments: a failed call left an empty sequence
    registered in the shared pool (fingerprint, ``cache.sequences`` and the memory accounting changed)."""
    cache = KVCache(num_kv_heads=2, head_dim=8, page_size=4, num_pages=8)
    Decoder.on_cache(cache, 4)
    before, sequences = cache.fingerprint(), cache.sequences
    with pytest.raises(error) as info:
        Decoder.on_cache(cache, **kwargs)
    assert str(info.value) == message
    assert cache.fingerprint() == before and cache.sequences == sequences


# -- 4. The Decoder read page -1 (the pool's last page: foreign K/V) after KVCache.release_before ------------------
def _released_setup(window=None):
    """A (10 tokens) and B share a 4-page pool of 4-token pages; A's first two pages are released at the cache
    level and B takes them and the last free page, so the pool's last page (what index -1 reads) holds B's K/V."""
    rng = np.random.default_rng(4)
    cache = KVCache(num_kv_heads=2, head_dim=8, page_size=4, num_pages=4)
    a, b = Decoder.on_cache(cache, 4, window=window), Decoder.on_cache(cache, 4, window=window)
    for _ in range(10):
        a.step(*_token(rng, a))
    cache.release_before(a.seq, 8)
    b.extend(*(x[None].repeat(9, 0) for x in _token(rng, b)))
    assert cache.pool.page_table(a.seq).tolist()[:2] == [-1, -1] and 3 in cache.pool.page_table(b.seq).tolist()
    return rng, cache, a, b


@pytest.mark.parametrize("call", ["step", "extend", "batch_step", "transaction"])
def test_reading_positions_released_at_the_cache_level_is_rejected(call):
    """No window: the next query reads positions 0.. whose page-table entries are -1; the unchecked kernel call
    indexed k_pages[-1] (numba wraps negative indices) and silently attended over whatever the pool's last page
    held. The paged_decode_attention wrapper rejects such a table; the Decoder now does too."""
    from decode import batch_step
    rng, cache, a, b = _released_setup()
    before = cache.fingerprint()
    q, k, v = _token(rng, a)
    calls = {"step": lambda: a.step(q, k, v),
             "extend": lambda: a.extend(q[None], k[None], v[None]),
             "batch_step": lambda: batch_step([b, a], np.stack([q, q]), np.stack([k, k]), np.stack([v, v])),
             "transaction": lambda: _in_transaction(a, q, k, v)}
    with pytest.raises(ValueError, match=r"^seq: expected K/V held for positions 0\.\.10 \(read by the query at "
                                         r"position 10\), got positions < 8 released"):
        calls[call]()
    assert cache.fingerprint() == before
    cache.check_invariants()


def _in_transaction(dec, q, k, v):
    with dec.transaction(1) as tx:
        tx.step(0, q, k, v)


def test_window_reading_released_positions_is_rejected_and_inside_the_window_still_works():
    rng, cache, a, b = _released_setup(window=4)        # the query at 10 reads 7..10: position 7 is released
    before = cache.fingerprint()
    with pytest.raises(ValueError, match=r"^seq: expected K/V held for positions 7\.\.10"):
        a.step(*_token(rng, a))
    assert cache.fingerprint() == before
    with pytest.raises(ValueError, match=r"^n: expected >= 11"):    # the Decoder's own guard on truncate
        a.truncate(9)
    b.free()
    c = Decoder.on_cache(cache, 4, window=2)             # a window decoder that released its own pages: fine
    for _ in range(9):
        c.step(*_token(rng, c))


# -- 5. KVCache.transaction(seq) (was begin_token): writes and commits after the token write ended --------------------------------------
def _one_token(cache, rng):
    cfg = cache.config
    return rng.standard_normal((cfg.num_kv_heads, cfg.head_dim)), rng.standard_normal((cfg.num_kv_heads, cfg.head_dim_v))


def test_token_write_after_rollback_cannot_touch_a_reused_page():
    """TokenWrite.write did not check its state: after a rollback gave its fresh page back, the page went to
    another sequence and a late write overwrote that sequence's K/V."""
    rng = np.random.default_rng(5)
    cache = KVCache(num_kv_heads=2, head_dim=3, page_size=4, num_pages=4)
    a, b = cache.create_sequence(), cache.create_sequence()
    cache.append(a, *(rng.standard_normal((4, 2, 3)) for _ in range(2)))
    tw = cache.transaction(a)                           # position 4: a fresh page
    page = int(tw.slot_pages[0])
    tw.rollback()
    cache.append(b, *(rng.standard_normal((1, 2, 3)) for _ in range(2)))
    assert cache.pool.page_table(b).tolist() == [page]
    before = cache.fingerprint()
    with pytest.raises(RuntimeError, match="^transaction: expected an open transaction, got one that is rolled back"):
        tw.write(0, *(x.astype(np.float32) for x in _one_token(cache, rng)))
    with pytest.raises(RuntimeError, match="^transaction: expected an open transaction, got one that is rolled back"):
        tw.commit()
    assert cache.fingerprint() == before and cache.length(a) == 4
    cache.check_invariants()


def test_token_commit_after_rollback_does_not_publish_an_unreserved_slot():
    """A commit after a rollback published length + 1 over a page that had gone back to the pool."""
    rng = np.random.default_rng(6)
    cache = KVCache(num_kv_heads=2, head_dim=3, page_size=4, num_pages=4)
    a = cache.create_sequence()
    cache.append(a, *(rng.standard_normal((4, 2, 3)) for _ in range(2)))
    tw = cache.transaction(a)
    tw.write(0, *(x.astype(np.float32) for x in _one_token(cache, rng)))
    tw.rollback()
    before = cache.fingerprint()
    with pytest.raises(RuntimeError, match="^transaction: expected an open transaction"):
        tw.commit()
    assert cache.fingerprint() == before and cache.length(a) == 4
    cache.check_invariants()


def test_token_write_after_commit_cannot_change_the_committed_token():
    rng = np.random.default_rng(7)
    cache = KVCache(num_kv_heads=2, head_dim=3, page_size=4, num_pages=4)
    a = cache.create_sequence()
    tw = cache.transaction(a)
    tw.write(0, *(x.astype(np.float32) for x in _one_token(cache, rng)))
    tw.commit()
    before = cache.fingerprint()
    with pytest.raises(RuntimeError, match="^transaction: expected an open transaction, got one that is committed"):
        tw.write(0, *(x.astype(np.float32) for x in _one_token(cache, rng)))
    with pytest.raises(RuntimeError, match="^transaction: expected an open transaction, got one that is committed"):
        tw.commit()
    tw.rollback()                                         # a no-op, as for a Transaction
    assert cache.fingerprint() == before and cache.length(a) == 1


# -- 6. The single-token path refused numpy integer layers ------------------------------------------------------
def test_numpy_integer_layer_accepted_on_the_single_token_path():
    """tx.step(np.int64(0), ...) in a one-token multi-layer transaction raised "layer: expected an int in [0, 1],
    got 0" while every other path (Transaction.write, gather, k_pages) accepts numpy integers."""
    rng = np.random.default_rng(8)
    dec, ref = (Decoder(4, 2, 8, page_size=4, max_tokens=16, num_layers=2, dtype="float64") for _ in range(2))
    for t in range(3):
        tokens = [_token(rng, dec) for _ in range(2)]
        with dec.transaction(1) as tx:
            outs = [tx.step(np.int64(layer), *tokens[layer]) for layer in range(2)]
        with ref.transaction(1) as tx:
            np.testing.assert_array_equal(outs, [tx.step(layer, *tokens[layer]) for layer in range(2)])
    assert dec.cache.fingerprint() == ref.cache.fingerprint()
    cache = dec.cache
    for layer, error, message in [(True, TypeError, "layer: expected an integer, got bool True"),
                                  (2, ValueError, "layer: expected an integer in [0, 1], got 2"),
                                  (np.int8(-1), ValueError, "layer: expected an integer in [0, 1], got -1"),
                                  (0.0, TypeError, "layer: expected an integer, got float 0.0")]:
        before = cache.fingerprint()
        tw = cache.transaction(dec.seq)
        with pytest.raises(error) as info:
            tw.write(layer, *(x.astype(np.float64) for x in _one_token(cache, rng)))
        assert str(info.value) == message and cache.fingerprint() == before   # the failed write rolled back


# -- 7. CacheFullError.could_ever_fit for a request over forked siblings -----------------------------------------
def _siblings(tokens):
    """A 4-page pool of 2-token pages: a with ``tokens`` tokens, b = fork(a), x holding one page."""
    cache = KVCache(num_kv_heads=1, head_dim=2, page_size=2, num_pages=4)
    a, x = cache.create_sequence(), cache.create_sequence()
    cache.append(a, np.ones((tokens, 1, 2)), np.ones((tokens, 1, 2)))
    b = cache.fork(a)
    cache.append(x, np.ones((1, 1, 2)), np.ones((1, 1, 2)))
    return cache, a, b, x


@pytest.mark.parametrize("tokens, request_, fits", [
    (4, (1, 1), True),       # 2 shared pages + 1 new page each = 4
    (3, (1, 1), True),       # 2 shared pages (the last one partial: both copy it) + 2 copies = 4
    (4, (1, 3), False),      # 2 shared + 1 + 2 new = 5 > 4
    (3, (2, 2), False),      # 2 shared + 2 copies + 1 + 1 new = 6 > 4
])
def test_could_ever_fit_counts_pages_shared_inside_the_request_once(tokens, request_, fits):
    """`_reserve` summed every sequence's logical pages, counting pages shared by forked siblings of one request
    (beam search advancing all beams) once per sibling: it said "can never fit" for requests that fit as soon
    as other sequences free their pages."""
    from kvcache import CacheFullError
    cache, a, b, x = _siblings(tokens)
    before = cache.fingerprint()
    with pytest.raises(CacheFullError) as info:
        cache.transaction({a: request_[0], b: request_[1]})
    assert info.value.could_ever_fit is fits and cache.fingerprint() == before
    cache.free(x)
    if fits:
        cache.transaction({a: request_[0], b: request_[1]}).rollback()
    else:
        with pytest.raises(CacheFullError) as info:
            cache.transaction({a: request_[0], b: request_[1]})
        assert not info.value.could_ever_fit


# -- 8. A fault while a sliding window gives pages back, after the step committed --------------------------------
def test_window_release_failure_does_not_fail_the_committed_step():
    """The step committed its token, then gave back the pages outside the window; a failure there propagated,
    so the caller saw a failed step although its token was in the cache (a retry would append it twice).
    Now the release is best effort after the commit: the step returns its output and the next step gives the
    pages back."""
    from kvcache.testing import FaultInjector, InjectedFault
    from kvcache.faults import no_fault

    def build():
        rng = np.random.default_rng(9)
        dec = Decoder(4, 2, 8, page_size=2, max_tokens=16, window=3, dtype="float64")
        for _ in range(7):
            dec.step(*_token(rng, dec))
        return dec, [_token(rng, dec) for _ in range(2)]

    dec, (t1, t2) = build()
    counter = FaultInjector()
    set_fault_hook(dec.cache, counter)
    clean_out = dec.step(*t1)
    set_fault_hook(dec.cache, no_fault)
    clean_after_one = dec.cache.fingerprint()
    clean_out2 = dec.step(*t2)
    clean_after_two = dec.cache.fingerprint()
    observable = (dec.kv(), dec.length, dec.cache.pool.first_position(dec.seq), dec.cache.num_free_pages)
    points = counter.points
    commit = points.index("publish")                       # the token's publish; the release's points follow
    assert "decref" in points[commit + 1:]
    for i, point in enumerate(points):
        dec, (t1, t2) = build()
        before = dec.cache.fingerprint()
        set_fault_hook(dec.cache, FaultInjector(fail_at=i))
        if i <= commit:
            with pytest.raises(InjectedFault):
                dec.step(*t1)
            assert dec.cache.fingerprint() == before and dec.length == 7
            set_fault_hook(dec.cache, no_fault)
            np.testing.assert_array_equal(dec.step(*t1), clean_out)
            assert dec.cache.fingerprint() == clean_after_one
        else:
            np.testing.assert_array_equal(dec.step(*t1), clean_out)
            assert dec.length == 8 and dec.cache.fingerprint() != clean_after_one    # pages not given back yet
            set_fault_hook(dec.cache, no_fault)
        dec.cache.check_invariants()
        np.testing.assert_array_equal(dec.step(*t2), clean_out2)
        if i <= commit:
            assert dec.cache.fingerprint() == clean_after_two, f"fault #{i} at {point!r}"
        else:              # the same K/V, window and free pages (other page ids: the release came one step later)
            np.testing.assert_equal((dec.kv(), dec.length, dec.cache.pool.first_position(dec.seq),
                                     dec.cache.num_free_pages), observable)


# -- 9. paged_decode_attention: a float64 q that overflows the float32 computation --------------------------------
@pytest.mark.parametrize("value", [1e39, -1e39, 3.4028235677973366e38])
def test_wrapper_rejects_q_not_finite_in_the_compute_dtype(value):
    """q was checked finite before its cast to float32 (the compute dtype of float16/float32 pages); 1e39 became
    inf and the kernel returned NaN rows without a word."""
    from decode.attention import paged_decode_attention
    k_pages = np.ones((2, 1, 4, 2), np.float32)
    q = np.ones((1, 2, 2))
    q[0, 1, 1] = value
    out = np.full((1, 2, 2), 7.0, np.float32)
    message = f"q: expected values finite in float32 (|x| <= 3.4028235e+38), got {value} at index (0, 1, 1)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        paged_decode_attention(q, k_pages, k_pages, [0], [0, 1], [0], [3], out=out)
    assert (out == 7.0).all()
    q[0, 1, 1] = 3.4028234e38                                    # rounds to float32 max: finite, accepted
    paged_decode_attention(q, k_pages, k_pages, [0], [0, 1], [0], [3], out=out)


# -- 10. KVCache.transaction with an unhashable sequence id -------------------------------------------------------
@pytest.mark.parametrize("num_tokens", [[[0, 1]], np.array([0]), {0, 1}])
def test_transaction_with_an_unhashable_id_names_seq(num_tokens):
    """`transaction([0, 1])` made the list a dict key: "TypeError: unhashable type: 'list'", no argument named.
    (A list is now the one-token-each shape; a list inside it is the unhashable id.)"""
    cache = KVCache(num_kv_heads=1, head_dim=2, page_size=2, num_pages=4)
    cache.create_sequence()
    before = cache.fingerprint()
    with pytest.raises(TypeError, match=r"^seq: expected an integer sequence id, got "):
        cache.transaction(num_tokens)
    assert cache.fingerprint() == before


# -- 11. Finite inputs whose scores overflow the float32 computation ---------------------------------------------
def _overflowing_case(rng):
    """One float32 decoder and a block whose scores q.k * scale exceed float32 for one key (q, k ~ 1e19..1e21,
    each finite in float32)."""
    n = int(rng.integers(2, 20))
    k, v = rng.standard_normal((n, 1, 4)), rng.standard_normal((n, 1, 4))
    k[rng.integers(0, n)] *= 10.0 ** rng.uniform(18, 21) * rng.choice([-1, 1])
    q = rng.standard_normal((n, 2, 4)) * 10.0 ** rng.uniform(18, 21)
    return q, k, v


def test_overflowing_scores_are_rejected_not_garbage():
    """Finite q and k whose scores overflow float32 went through: the fastmath kernel then returned NaN, raised
    ZeroDivisionError, or (29 of 3000 random cases) returned finite numbers unrelated to the attention. The
    Decoder now bounds |q| * scale and |k|, |v| so that every score, score difference and weighted sum is finite
    in the compute dtype (docs/reliability.md), and rejects larger inputs naming the element."""
    from reference.dense import decode_reference
    rng = np.random.default_rng(11)
    for _ in range(200):
        q, k, v = _overflowing_case(rng)
        dec = Decoder(2, 1, 4, page_size=4, max_tokens=64)
        before = dec.cache.fingerprint()
        try:
            out = dec.extend(q, k, v)
        except ValueError as error:
            assert re.match(r"^[qk]: expected \|x\| < [0-9.e+]+ \(scores q\.k \* scale and the weighted sums of v "
                            r"must stay finite in float32\), got \S+ at index \(\d+, \d+, \d+\)$", str(error)), error
            assert dec.cache.fingerprint() == before
        else:
            ref = decode_reference(q, k.astype(np.float32), v.astype(np.float32), 0)
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", ["step", "step_slow", "extend", "append", "batch_step"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_magnitude_limits_on_every_decoder_path(path, which):
    from decode import batch_step
    from decode.inputs import magnitude_limits
    rng = np.random.default_rng(12)
    cache = KVCache(num_kv_heads=2, head_dim=8, page_size=4, num_pages=8)
    dec, other = Decoder.on_cache(cache, 4), Decoder.on_cache(cache, 4)
    q_limit, kv_limit = magnitude_limits(np.dtype(np.float32), 8, dec.scale)
    assert kv_limit == 2.0 ** 48 and q_limit == 2.0 ** 78 / (8 * dec.scale)
    q, k, v = _token(rng, dec)
    arrays = {"q": q, "k": k, "v": v}
    if which == "q" and path == "append":
        return
    arrays[which][1, 5] = (q_limit if which == "q" else kv_limit) * 1.0000001
    if path == "step_slow":
        arrays = {name: x.astype(np.float16) if name != which else x for name, x in arrays.items()}
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    calls = {"step": lambda: dec.step(q, k, v), "step_slow": lambda: dec.step(q, k, v),
             "extend": lambda: dec.extend(q[None], k[None], v[None]), "append": lambda: dec.append(k[None], v[None]),
             "batch_step": lambda: batch_step([other, dec], np.stack([q * 0, q]), np.stack([k * 0, k]),
                                              np.stack([v * 0, v]))}
    index = {"step": "(1, 5)", "step_slow": "(1, 5)", "batch_step": "(1, 1, 5)"}.get(path, "(0, 1, 5)")
    before = cache.fingerprint()
    with pytest.raises(ValueError, match=rf"^{which}: expected \|x\| < .* at index {re.escape(index)}$"):
        calls[path]()
    assert cache.fingerprint() == before
    arrays[which][1, 5] /= 1.0001                                          # just below the limit: accepted
    calls[path]()


# -- 12. Error messages that did not show what was given ---------------------------------------------------------
def test_layered_kv_of_the_wrong_rank_names_T_not_minus_one():
    """KVCache.append of a 3-d k into a 3-layer pool said "expected ... = (3, -1, 2, 8)": -1 tokens."""
    cache = KVCache(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, num_pages=4)
    seq = cache.create_sequence()
    with pytest.raises(ValueError, match=re.escape("k: expected shape [num_layers, T, num_kv_heads, head_dim] = "
                                                   "(3, T, 2, 8), got (1, 2, 8)")):
        cache.append(seq, np.ones((1, 2, 8)), np.ones((1, 2, 8)))


@pytest.mark.parametrize("path", ["step", "extend"])
def test_magnitude_errors_name_the_value_given(path):
    """The magnitude check ran on the copy cast to the storage dtype: 1e15 was reported as 999999986991104.0."""
    dec = Decoder(4, 2, 8, page_size=4, max_tokens=16)
    k = np.ones((2, 8))
    k[1, 2] = 1e15
    call = (lambda: dec.step(np.ones((4, 8)), k, np.ones((2, 8)))) if path == "step" else \
        (lambda: dec.extend(np.ones((1, 4, 8)), k[None], np.ones((1, 2, 8))))
    with pytest.raises(ValueError, match=r"^k: expected \|x\| < 2\.81475e\+14 .*, got 1000000000000000\.0 at index "
                                         + re.escape("(1, 2)" if path == "step" else "(0, 1, 2)") + "$"):
        call()
