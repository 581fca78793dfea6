"""Unit tests of each KVCache operation and each error it raises (type and message), with the failure
guarantee: after every failed call the fingerprint (pool bytes + metadata) and the free-page count are
exactly what they were."""
import numpy as np
import pytest

from kvcache import CacheFullError, testing
from .kv_helpers import DenseModel, assert_bitwise_equal, assert_fails_unchanged, assert_matches_model, \
    make_cache, random_kv


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def filled(rng, tokens=(5,), **kwargs):
    """A cache with one sequence per entry of ``tokens``, and the model of it."""
    cache = make_cache(**kwargs)
    model = DenseModel(cache)
    seqs = []
    for count in tokens:
        seq = cache.create_sequence()
        model.create(seq)
        k, v = random_kv(cache, count, rng)
        cache.append(seq, k, v)
        model.append(seq, k, v)
        seqs.append(seq)
    return cache, model, seqs


# -- create_sequence, reading ------------------------------------------------------------------------------
def test_create_sequence():
    cache = make_cache(num_kv_heads=2, head_dim=3, head_dim_v=5)
    a, b = cache.create_sequence(), cache.create_sequence()
    assert a != b and cache.sequences == (a, b)
    assert cache.length(a) == 0 and cache.pool.first_position(a) == 0
    assert cache.pool.page_table(a).dtype == np.int32 and cache.pool.page_table(a).shape == (0,)
    k, v = cache.gather(a)
    assert k.shape == (0, 2, 3) and v.shape == (0, 2, 5) and k.dtype == v.dtype == np.float32
    assert cache.num_free_pages == 8
    cache.check_invariants()


@pytest.mark.parametrize("bad, error, message", [
    (99, ValueError, r"seq: expected a live sequence id \[0\], got 99 \(freed or never created\)"),
    (-1, ValueError, "seq: expected a live sequence id"),
    (True, TypeError, "seq: expected an integer sequence id, got bool True"),
    (0.0, TypeError, "seq: expected an integer sequence id, got float 0.0"),
    ("0", TypeError, "seq: expected an integer sequence id, got str '0'"),
    (None, TypeError, "seq: expected an integer sequence id, got NoneType None"),
])
def test_unknown_sequence_ids(rng, bad, error, message):
    cache, model, [seq] = filled(rng)
    k, v = random_kv(cache, 1, rng)
    calls = [lambda: cache.append(bad, k, v), lambda: cache.truncate(bad, 0), lambda: cache.fork(bad),
             lambda: cache.free(bad), lambda: cache.release_before(bad, 0), lambda: cache.gather(bad),
             lambda: cache.length(bad), lambda: cache.pool.page_table(bad), lambda: cache.pool.first_position(bad),
             lambda: cache.transaction({bad: 1}), lambda: cache.transaction({bad: 1, seq: 1})]   # 0.0 == 0: first key kept
    for call in calls:
        assert_fails_unchanged(cache, call, error, message)


def test_freed_sequence_id_is_unknown(rng):
    cache, model, [a, b] = filled(rng, (5, 3))
    cache.free(a)
    for call in (lambda: cache.free(a), lambda: cache.gather(a), lambda: cache.append(a, *random_kv(cache, 1, rng)),
                 lambda: cache.truncate(a, 0), lambda: cache.fork(a)):
        assert_fails_unchanged(cache, call, ValueError, rf"seq: expected a live sequence id \[{b}\], got {a} "
                                                        r"\(freed or never created\)")


def test_numpy_integer_ids_accepted(rng):
    cache, model, [seq] = filled(rng)
    assert cache.length(np.int64(seq)) == 5
    cache.truncate(np.int32(seq), np.int64(2))
    assert cache.length(seq) == 2


def test_gather_layer_checked(rng):
    cache, model, [seq] = filled(rng, num_layers=2)
    with pytest.raises(ValueError, match=r"^layer: expected an integer in \[0, 1\], got 2$"):
        cache.gather(seq, 2)
    with pytest.raises(ValueError, match=r"^layer: expected an integer in \[0, 1\], got -1$"):
        cache.gather(seq, -1)
    with pytest.raises(TypeError, match="^layer: expected an integer, got bool"):
        cache.gather(seq, True)


# -- append ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
@pytest.mark.parametrize("num_layers", [1, 3])
def test_append_multi_layer_matches_model(rng, dtype, num_layers):
    cache = make_cache(num_layers=num_layers, head_dim_v=5, dtype=dtype, page_size=4, num_pages=8)
    model = DenseModel(cache)
    seq = cache.create_sequence()
    model.create(seq)
    for count in (1, 2, 3, 4, 7, 1):                   # crosses pages at every offset
        k, v = random_kv(cache, count, rng)
        cache.append(seq, k, v)
        model.append(seq, k, v)
        assert_matches_model(cache, model)
        assert len(cache.pool.page_table(seq)) == -(-model.length(seq) // 4)
        cache.check_invariants()
    assert cache.num_free_pages == 8 - 5


def test_append_single_layer_accepts_3d(rng):
    cache = make_cache()
    seq = cache.create_sequence()
    k, v = random_kv(cache, 3, rng)
    cache.append(seq, k[0], v[0])
    assert_bitwise_equal(cache.gather(seq)[0], k[0].astype(np.float32))
    assert_bitwise_equal(cache.gather(seq)[1], v[0].astype(np.float32))


def test_append_accepts_lists_and_other_float_dtypes(rng):
    cache = make_cache(num_kv_heads=1, head_dim=2, dtype="float64")
    seq = cache.create_sequence()
    cache.append(seq, [[[[1.5, 2.5]]]], np.array([[[[3.0, 4.0]]]], dtype=np.float16))
    k, v = cache.gather(seq)
    assert k.tolist() == [[[1.5, 2.5]]] and v.tolist() == [[[3.0, 4.0]]] and k.dtype == np.float64


def test_append_zero_tokens_changes_nothing(rng):
    cache, model, [seq] = filled(rng, (3,))
    before = cache.fingerprint()
    cache.append(seq, *random_kv(cache, 0, rng))
    assert cache.fingerprint() == before


def test_float16_cast_rounds_like_numpy(rng):
    cache = make_cache(num_kv_heads=1, head_dim=4, dtype="float16")
    seq = cache.create_sequence()
    k = np.array([[[[65504.0, -65504.0, 1e-8, 0.1]]]])
    cache.append(seq, k, k)
    assert_bitwise_equal(cache.gather(seq)[0], k[0].astype(np.float16))


@pytest.mark.parametrize("k_shape, v_shape, message", [
    ((2, 3, 2, 3), (2, 3, 2, 3), r"^k: expected shape \[num_layers, T, num_kv_heads, head_dim\] = "
                                 r"\(1, 3, 2, 3\), got \(2, 3, 2, 3\)$"),
    ((1, 3, 1, 3), (1, 3, 2, 3), r"^k: expected shape .* = \(1, 3, 2, 3\), got \(1, 3, 1, 3\)$"),
    ((1, 3, 2, 4), (1, 3, 2, 3), r"^k: expected shape .* = \(1, 3, 2, 3\), got \(1, 3, 2, 4\)$"),
    ((1, 3, 2, 3), (1, 2, 2, 3), r"^v: expected shape \[num_layers, T, num_kv_heads, head_dim_v\] = "
                                 r"\(1, 3, 2, 3\), got \(1, 2, 2, 3\)$"),
    ((1, 3, 2, 3), (1, 3, 2, 4), r"^v: expected shape .* = \(1, 3, 2, 3\), got \(1, 3, 2, 4\)$"),
    ((3, 2, 3), (3, 2), r"^v: expected shape"),
    ((2, 3), (2, 3), r"^k: expected shape"),
    ((), (), r"^k: expected shape"),
])
def test_append_bad_shapes(rng, k_shape, v_shape, message):
    cache, model, [seq] = filled(rng, (5,))
    assert_fails_unchanged(cache, lambda: cache.append(seq, np.ones(k_shape), np.ones(v_shape)),
                           ValueError, message)


def test_append_3d_into_multi_layer_cache_rejected(rng):
    cache, model, [seq] = filled(rng, (2,), num_layers=2)
    assert_fails_unchanged(cache, lambda: cache.append(seq, np.ones((1, 2, 3)), np.ones((1, 2, 3))),
                           ValueError, r"^k: expected shape \[num_layers, T, num_kv_heads, head_dim\]")


@pytest.mark.parametrize("bad", [np.ones((1, 1, 2, 3), dtype=np.int64), np.ones((1, 1, 2, 3), dtype=np.int8),
                                 np.ones((1, 1, 2, 3), dtype=bool), np.ones((1, 1, 2, 3), dtype=np.complex128),
                                 np.ones((1, 1, 2, 3), dtype=object), np.full((1, 1, 2, 3), "1"),
                                 [[[[1, 2, 3], [4, 5, 6]]]]])
@pytest.mark.parametrize("which", ["k", "v"])
def test_append_non_float_dtypes_rejected(rng, bad, which):
    cache, model, [seq] = filled(rng, (3,))
    good = np.ones((1, 1, 2, 3))
    k, v = (bad, good) if which == "k" else (good, bad)
    dtype = np.asarray(bad).dtype
    assert_fails_unchanged(cache, lambda: cache.append(seq, k, v), TypeError,
                           rf"^{which}: expected a real floating-point array, got dtype {dtype}$")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("which", ["k", "v"])
def test_append_non_finite_rejected(rng, dtype, value, which):
    cache, model, [seq] = filled(rng, (3,), dtype=dtype)
    k, v = random_kv(cache, 4, rng)
    (k if which == "k" else v)[0, 2, 1, 0] = value
    assert_fails_unchanged(cache, lambda: cache.append(seq, k, v), ValueError,
                           rf"^{which}: expected finite values, got -?{value} at index \(0, 2, 1, 0\)$")


@pytest.mark.parametrize("value", [1e6, -1e6, 65520.0, 1e300])
def test_float16_overflow_rejected_not_stored_as_inf(rng, value):
    cache, model, [seq] = filled(rng, (3,), dtype="float16")
    k, v = random_kv(cache, 2, rng)
    v[0, 1, 0, 2] = value
    info = assert_fails_unchanged(cache, lambda: cache.append(seq, k, v), ValueError,
                                  r"^v: expected values finite in float16 storage \(\|x\| <= 65504\.0\), got ")
    assert f"got {value} at index (0, 1, 0, 2)" in str(info.value)
    assert np.isfinite(cache.gather(seq)[1]).all()


def test_float32_overflow_rejected(rng):
    cache, model, [seq] = filled(rng, (1,), dtype="float32")
    k, v = random_kv(cache, 1, rng)
    k[0, 0, 0, 0] = 1e39
    assert_fails_unchanged(cache, lambda: cache.append(seq, k, v), ValueError, "in float32 storage")


def test_float16_input_inf_is_named_as_non_finite(rng):
    cache, model, [seq] = filled(rng, (1,), dtype="float64")
    k = np.full((1, 1, 2, 3), np.inf, dtype=np.float16)
    assert_fails_unchanged(cache, lambda: cache.append(seq, k, k), ValueError,
                           r"^k: expected finite values, got inf at index \(0, 0, 0, 0\)$")


def test_append_to_busy_sequence_rejected(rng):
    cache, model, [a, b] = filled(rng, (3, 3))
    tx = cache.transaction({a: 1})
    k, v = random_kv(cache, 1, rng)
    msg = rf"^seq: expected a sequence with no open transaction, got {a} \(in a transaction\)$"
    for call in (lambda: cache.append(a, k, v), lambda: cache.transaction({a: 2}),
                 lambda: cache.transaction({b: 1, a: 1}), lambda: cache.truncate(a, 1), lambda: cache.fork(a),
                 lambda: cache.free(a), lambda: cache.release_before(a, 2)):
        assert_fails_unchanged(cache, call, RuntimeError, msg)
    cache.append(b, k, v)                           # other sequences are not blocked
    model.append(b, k, v)
    tx.rollback()
    assert_matches_model(cache, model)


# -- pool exhaustion ---------------------------------------------------------------------------------------------
def test_pool_exhaustion_then_success_after_free(rng):
    cache, model, [a, b] = filled(rng, (8, 12), page_size=4, num_pages=6)   # 2 + 3 pages, 1 free
    assert cache.num_free_pages == 1
    k, v = random_kv(cache, 6, rng)                                        # a needs 2 more pages
    info = assert_fails_unchanged(cache, lambda: cache.append(a, k, v), CacheFullError,
                                  r"^append: needs 2 free pages, 1 of 6 are free; it fits once other sequences "
                                  r"free pages$")
    err = info.value
    assert (err.pages_needed, err.pages_free, err.num_pages, err.could_ever_fit) == (2, 1, 6, True)
    assert_matches_model(cache, model)
    cache.free(b)
    model.free(b)
    cache.append(a, k, v)
    model.append(a, k, v)
    assert_matches_model(cache, model)
    cache.check_invariants()


def test_pool_exhaustion_could_never_fit(rng):
    cache, model, [a] = filled(rng, (5,), page_size=4, num_pages=6)          # a holds 2 pages
    k, v = random_kv(cache, 20, rng)                                       # 25 tokens = 7 pages > 6
    info = assert_fails_unchanged(cache, lambda: cache.append(a, k, v), CacheFullError,
                                  r"^append: needs 5 free pages, 4 of 6 are free; it can never fit: the pool has "
                                  r"only 6 pages$")
    assert info.value.could_ever_fit is False
    k, v = random_kv(cache, 19, rng)                                       # 24 tokens = 6 pages: fits
    cache.append(a, k, v)
    assert cache.num_free_pages == 0


def test_released_pages_count_for_could_ever_fit(rng):
    cache, model, [a] = filled(rng, (8,), page_size=4, num_pages=3)
    assert cache.release_before(a, 8) == 2
    k, v = random_kv(cache, 12, rng)                                       # positions 8..19: 3 pages
    cache.append(a, k, v)
    k, v = random_kv(cache, 1, rng)                                        # a alone would need 4 live pages
    info = assert_fails_unchanged(cache, lambda: cache.append(a, k, v), CacheFullError, "it can never fit")
    assert info.value.could_ever_fit is False
    cache.release_before(a, 12)                                            # the released pages do not count
    cache.append(a, k, v)
    assert cache.length(a) == 21 and cache.pool.first_position(a) == 12
    cache.check_invariants()


def test_multi_sequence_transaction_needs_all_pages(rng):
    cache, model, [a, b] = filled(rng, (4, 4), page_size=4, num_pages=4)   # 2 free pages
    assert_fails_unchanged(cache, lambda: cache.transaction({a: 4, b: 5}), CacheFullError,
                           r"^append: needs 3 free pages, 2 of 4 are free")
    tx = cache.transaction({a: 4, b: 4})
    assert cache.num_free_pages == 0
    tx.rollback()
    assert cache.num_free_pages == 2


# -- transactions ---------------------------------------------------------------------------------------------
def test_transaction_reserves_then_publishes(rng):
    cache, model, [a, b] = filled(rng, (3, 6), num_layers=2, page_size=4, num_pages=8)
    ka, va = random_kv(cache, 2, rng)
    kb, vb = random_kv(cache, 3, rng)
    with cache.transaction({a: 2, b: 3}) as tx:
        assert cache.num_free_pages == 8 - 2 - 3             # a: 3+2 -> 2 pages; b: 6+3 -> 3 pages
        assert len(tx.pages(a)) == 2 and len(tx.pages(b)) == 3
        assert cache.length(a) == 3 and cache.length(b) == 6  # not published yet
        assert tx.positions.tolist() == [3, 6] and tx.seqs == [a, b]
        for layer in range(2):
            tx.write(layer, a, ka[layer], va[layer])
            tx.write(layer, b, kb[layer], vb[layer])
        assert_matches_model(cache, model)                    # readers see the old lengths
        cache.check_invariants()
    assert tx.state == "committed"
    model.append(a, ka, va)
    model.append(b, kb, vb)
    assert_matches_model(cache, model)
    cache.check_invariants()


def test_transaction_single_id_means_one_token(rng):
    cache, model, [a] = filled(rng, (3,))
    tx = cache.transaction(a)
    assert tx.num_tokens == {a: 1}
    k, v = random_kv(cache, 1, rng)
    tx.write(0, a, k[0], v[0])
    tx.commit()
    model.append(a, k, v)
    assert_matches_model(cache, model)


def test_transaction_write_order_and_overwrite(rng):
    cache, model, [a] = filled(rng, (1,), num_layers=3)
    k, v = random_kv(cache, 2, rng)
    junk = random_kv(cache, 2, rng)
    tx = cache.transaction({a: 2})
    tx.write(2, a, junk[0][2], junk[1][2])
    tx.write(2, a, k[2], v[2])                     # a second write of a layer replaces the first
    tx.write(0, a, k[0], v[0])
    tx.write(1, a, k[1], v[1])
    tx.commit()
    model.append(a, k, v)
    assert_matches_model(cache, model)


@pytest.mark.parametrize("written", [[], [0], [0, 2]])
def test_commit_with_missing_layer_rolls_back(rng, written):
    cache, model, [a] = filled(rng, (3,), num_layers=3)
    before, free = cache.fingerprint(), cache.num_free_pages
    k, v = random_kv(cache, 2, rng)
    tx = cache.transaction({a: 2})
    for layer in written:
        tx.write(layer, a, k[layer], v[layer])
    missing = [layer for layer in range(3) if layer not in written]
    with pytest.raises(ValueError, match=rf"^commit: expected every layer written, got layers \{{{a}: "
                                         rf"\[{', '.join(map(str, missing))}\]\}} missing \(seq: layers\)$"):
        tx.commit()
    assert tx.state == "rolled back"
    assert cache.fingerprint() == before and cache.num_free_pages == free


def test_commit_names_missing_layers_of_each_sequence(rng):
    cache, model, [a, b] = filled(rng, (1, 1), num_layers=2)
    before = cache.fingerprint()
    tx = cache.transaction({a: 1, b: 1})
    k, v = random_kv(cache, 1, rng)
    tx.write(0, a, k[0], v[0])
    tx.write(1, a, k[1], v[1])
    tx.write(1, b, k[1], v[1])
    with pytest.raises(ValueError, match=rf"got layers \{{{b}: \[0\]\}} missing"):
        tx.commit()
    assert cache.fingerprint() == before


def test_context_manager_rolls_back_on_exception(rng):
    cache, model, [a, b] = filled(rng, (3, 5), num_layers=2)
    before, free = cache.fingerprint(), cache.num_free_pages
    k, v = random_kv(cache, 6, rng)
    with pytest.raises(KeyError, match="boom"):
        with cache.transaction({a: 6, b: 1}) as tx:
            tx.write(0, a, k[0], v[0])
            tx.write(1, a, k[1], v[1])
            assert cache.num_free_pages < free
            raise KeyError("boom")
    assert tx.state == "rolled back"
    assert cache.fingerprint() == before and cache.num_free_pages == free
    assert_matches_model(cache, model)
    cache.append(a, k, v)                          # the sequence is usable again
    model.append(a, k, v)
    assert_matches_model(cache, model)


def test_write_error_rolls_back_whole_transaction(rng):
    cache, model, [a, b] = filled(rng, (3, 5), num_layers=2, dtype="float16")
    before, free = cache.fingerprint(), cache.num_free_pages
    k, v = random_kv(cache, 2, rng)
    tx = cache.transaction({a: 2, b: 2})
    tx.write(0, a, k[0], v[0])
    tx.write(1, a, k[1], v[1])
    tx.write(0, b, k[0], v[0])
    bad = k[1].copy()
    bad[1, 0, 0] = 1e6
    with pytest.raises(ValueError, match=r"^k: expected values finite in float16 storage"):
        tx.write(1, b, bad, v[1])                  # fails after three layer-writes went in
    assert tx.state == "rolled back"
    assert cache.fingerprint() == before and cache.num_free_pages == free
    for call, error in ((lambda: tx.write(1, b, k[1], v[1]), RuntimeError), (tx.commit, RuntimeError)):
        with pytest.raises(error, match="^transaction: expected an open transaction, got one that is rolled back$"):
            call()
    tx.rollback()                                  # harmless
    assert cache.fingerprint() == before


@pytest.mark.parametrize("case", ["shape", "tokens", "dtype", "nan", "seq"])
def test_transaction_write_errors(rng, case):
    cache, model, [a, b] = filled(rng, (2, 2), num_layers=2)
    before = cache.fingerprint()
    tx = cache.transaction({a: 2})
    k, v = random_kv(cache, 2, rng)
    seq, kk, vv = a, k[0], v[0]
    error, message = ValueError, None
    if case == "shape":
        kk, message = k[0][:, :1], r"^k: expected shape \[T, num_kv_heads, head_dim\] = \(2, 2, 3\), got \(2, 1, 3\)$"
    elif case == "tokens":
        vv, message = v[0][:1], r"^v: expected shape \[T, num_kv_heads, head_dim_v\] = \(2, 2, 3\), got \(1, 2, 3\)$"
    elif case == "dtype":
        error, kk, message = TypeError, k[0].astype(int), "^k: expected a real floating-point array, got dtype int"
    elif case == "nan":
        vv = v[0].copy()
        vv[0, 0, 0] = np.nan
        message = r"^v: expected finite values, got nan at index \(0, 0, 0\)$"
    else:
        seq, message = b, rf"^seq: expected one of the transaction's sequences \[{a}\], got {b}$"
    with pytest.raises(error, match=message):
        tx.write(0, seq, kk, vv)
    assert tx.state == "rolled back" and cache.fingerprint() == before


@pytest.mark.parametrize("count, error, message", [
    (-1, ValueError, r"expected an integer >= 0, got -1"),
    (1.0, TypeError, "expected an integer, got float 1.0"),
    (True, TypeError, "expected an integer, got bool True"),
])
def test_transaction_token_counts_checked(rng, count, error, message):
    cache, model, [a] = filled(rng, (2,))
    assert_fails_unchanged(cache, lambda: cache.transaction({a: count}), error, rf"^num_tokens\[{a}\]: {message}$")


def test_rollback_after_commit_is_a_no_op(rng):
    cache, model, [a] = filled(rng, (2,))
    k, v = random_kv(cache, 1, rng)
    tx = cache.transaction({a: 1})
    tx.write(0, a, k[0], v[0])
    tx.commit()
    after = cache.fingerprint()
    tx.rollback()
    assert cache.fingerprint() == after and tx.state == "committed"
    with pytest.raises(RuntimeError, match="got one that is committed"):
        tx.commit()


def test_failed_begin_leaves_transaction_unopened(rng):
    cache, model, [a] = filled(rng, (4,), page_size=4, num_pages=1)
    with pytest.raises(CacheFullError):
        cache.transaction({a: 1})
    cache.truncate(a, 3)                           # not left busy
    cache.append(a, *random_kv(cache, 1, rng))


# -- truncate ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, pages_left", [(13, 4), (12, 3), (9, 3), (8, 2), (1, 1), (0, 0)])
def test_truncate(rng, n, pages_left):
    cache, model, [a] = filled(rng, (13,), num_layers=2, page_size=4, num_pages=8)
    cache.truncate(a, n)
    model.truncate(a, n)
    assert_matches_model(cache, model)
    assert len(cache.pool.page_table(a)) == pages_left and cache.num_free_pages == 8 - pages_left
    cache.check_invariants()
    k, v = random_kv(cache, 5, rng)               # appending after truncation overwrites the old slots
    cache.append(a, k, v)
    model.append(a, k, v)
    assert_matches_model(cache, model)


@pytest.mark.parametrize("n, error, message", [
    (6, ValueError, r"^n: expected an integer in \[0, 5\], got 6$"),
    (-1, ValueError, r"^n: expected an integer in \[0, 5\], got -1$"),
    (2.0, TypeError, r"^n: expected an integer, got float 2.0$"),
    (True, TypeError, r"^n: expected an integer, got bool True$"),
    (np.True_, TypeError, r"^n: expected an integer, got bool"),
    (None, TypeError, r"^n: expected an integer, got NoneType None$"),
])
def test_truncate_bad_n(rng, n, error, message):
    cache, model, [a] = filled(rng, (5,))
    assert_fails_unchanged(cache, lambda: cache.truncate(a, n), error, message)


def test_truncate_cannot_go_below_released_pages(rng):
    cache, model, [a] = filled(rng, (10,), page_size=4)
    cache.release_before(a, 9)                     # pages 0, 1 released: first position 8
    assert_fails_unchanged(cache, lambda: cache.truncate(a, 7), ValueError,
                           r"^n: expected an integer in \[8, 10\], got 7$")
    cache.truncate(a, 8)
    model.release_before(a, 9)
    model.truncate(a, 8)
    assert_matches_model(cache, model)
    assert cache.num_free_pages == 8
    cache.check_invariants()


# -- fork ------------------------------------------------------------------------------------------------------
def test_fork_shares_pages(rng):
    cache, model, [a] = filled(rng, (9,), num_layers=2, page_size=4)
    free = cache.num_free_pages
    b = cache.fork(a)
    model.fork(a, b)
    assert b not in (a,) and cache.sequences == (a, b)
    assert cache.num_free_pages == free                       # nothing copied
    assert cache.pool.page_table(b).tolist() == cache.pool.page_table(a).tolist()
    assert [cache.pool.allocator.ref_count(p) for p in cache.pool.page_table(a)] == [2, 2, 2]
    assert_matches_model(cache, model)
    cache.check_invariants()


def test_fork_of_empty_sequence(rng):
    cache = make_cache()
    a = cache.create_sequence()
    b = cache.fork(a)
    assert cache.length(b) == 0 and cache.num_free_pages == 8
    cache.append(b, *random_kv(cache, 5, rng))
    assert cache.length(a) == 0 and cache.length(b) == 5
    cache.check_invariants()


def test_fork_ids_are_never_reused(rng):
    cache, model, [a] = filled(rng, (3,))
    b = cache.fork(a)
    cache.free(b)
    c = cache.fork(a)
    d = cache.create_sequence()
    assert len({a, b, c, d}) == 4


# -- free -----------------------------------------------------------------------------------------------------
def test_free_returns_pages(rng):
    cache, model, [a, b] = filled(rng, (9, 2), page_size=4)
    assert cache.num_free_pages == 4
    cache.free(a)
    assert cache.num_free_pages == 7 and cache.sequences == (b,)
    cache.check_invariants()
    cache.free(b)
    assert cache.num_free_pages == 8 and cache.sequences == ()
    cache.check_invariants()


def test_free_shared_pages_keeps_them_for_the_sibling(rng):
    cache, model, [a] = filled(rng, (9,), page_size=4)
    b = cache.fork(a)
    model.fork(a, b)
    cache.free(a)
    model.free(a)
    assert cache.num_free_pages == 5
    assert [cache.pool.allocator.ref_count(p) for p in cache.pool.page_table(b)] == [1, 1, 1]
    assert_matches_model(cache, model)
    cache.check_invariants()


# -- release_before --------------------------------------------------------------------------------------------
def test_release_before(rng):
    cache, model, [a] = filled(rng, (14,), num_layers=2, page_size=4)
    assert cache.release_before(a, 3) == 0                   # page 0 still holds position 3
    assert cache.release_before(a, 9) == 2
    model.release_before(a, 9)
    assert cache.pool.page_table(a).tolist()[:2] == [-1, -1] and cache.pool.first_position(a) == 8
    assert cache.num_free_pages == 8 - 2
    assert_matches_model(cache, model)
    cache.check_invariants()
    assert cache.release_before(a, 5) == 0                   # already released
    k, v = random_kv(cache, 7, rng)
    cache.append(a, k, v)
    model.append(a, k, v)
    assert_matches_model(cache, model)
    b = cache.fork(a)
    model.fork(a, b)
    assert cache.pool.first_position(b) == 8
    assert_matches_model(cache, model)
    cache.free(a)
    cache.free(b)
    assert cache.num_free_pages == 8
    cache.check_invariants()


def test_release_everything_then_append(rng):
    cache, model, [a] = filled(rng, (8,), page_size=4)
    assert cache.release_before(a, 8) == 2
    model.release_before(a, 8)
    assert cache.gather(a)[0].shape == (0, 2, 3) and cache.num_free_pages == 8
    k, v = random_kv(cache, 3, rng)
    cache.append(a, k, v)
    model.append(a, k, v)
    assert_matches_model(cache, model)
    assert cache.pool.page_table(a).tolist()[:2] == [-1, -1]
    cache.check_invariants()


@pytest.mark.parametrize("position, error, message", [
    (6, ValueError, r"^position: expected an integer in \[0, 5\], got 6$"),
    (-1, ValueError, r"^position: expected an integer in \[0, 5\], got -1$"),
    (1.5, TypeError, r"^position: expected an integer, got float 1.5$"),
    (False, TypeError, r"^position: expected an integer, got bool False$"),
])
def test_release_before_bad_position(rng, position, error, message):
    cache, model, [a] = filled(rng, (5,))
    assert_fails_unchanged(cache, lambda: cache.release_before(a, position), error, message)


# -- check_invariants, fingerprint -------------------------------------------------------------------------------
def test_check_invariants_detects_corruption(rng):
    def fresh():
        cache, model, [a] = filled(rng, (9,), page_size=4)
        b = cache.fork(a)
        cache.check_invariants()
        return cache, testing.sequence_record(cache, a), testing.sequence_record(cache, b)

    cache, sa, sb = fresh()
    page = int(sa.table[0])
    testing.set_ref_count(testing.allocator(cache), page, cache.pool.allocator.ref_count(page) + 1)
    with pytest.raises(AssertionError, match="ref count 3 but held by 2"):
        cache.check_invariants()
    cache, sa, sb = fresh()
    sa.length = 4                                         # table has 3 pages, length needs 1
    with pytest.raises(AssertionError, match=r"3 pages for length 4"):
        cache.check_invariants()
    cache, sa, sb = fresh()
    sa.first_live_page = 1                                # entry 0 is not -1
    with pytest.raises(AssertionError):
        cache.check_invariants()
    cache, sa, sb = fresh()
    sa.table[2] = 99
    with pytest.raises(AssertionError):
        cache.check_invariants()
    cache, sa, sb = fresh()
    alloc = testing.allocator(cache)
    testing.set_free_list(alloc, alloc.free_list() + (int(sa.table[1]),))
    with pytest.raises(AssertionError, match="both free and mapped"):
        cache.check_invariants()


def test_fingerprint_sees_bytes_and_metadata(rng):
    cache, model, [a] = filled(rng, (6,), page_size=4)
    fp = cache.fingerprint()
    assert cache.fingerprint() == fp and len(fp) == 64
    testing.pool_arrays(cache)[0][0, 7, 0, 0, 0] = 1.0                         # a byte in a free page
    assert cache.fingerprint() != fp
    testing.pool_arrays(cache)[0][0, 7, 0, 0, 0] = 0.0
    assert cache.fingerprint() == fp
    cache.truncate(a, 5)                                  # metadata only, same pages
    assert cache.fingerprint() != fp
    cache2, _, _ = filled(np.random.default_rng(1234), (6,), page_size=4)
    assert cache2.fingerprint() == fp                     # same operations, same fingerprint
    cache2.create_sequence()
    assert cache2.fingerprint() != fp


def test_pool_nbytes():
    cache = make_cache(num_layers=3, num_kv_heads=2, head_dim=4, head_dim_v=5, page_size=2, num_pages=7,
                       dtype="float16")
    assert cache.pool.nbytes == 3 * 7 * 2 * 2 * (4 + 5) * 2 == 7 * cache.config.bytes_per_page
    assert cache.pool.nbytes == cache.pool.k_pages(0).nbytes * 3 + cache.pool.v_pages(0).nbytes * 3
