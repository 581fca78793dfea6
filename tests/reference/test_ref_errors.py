"""Every illegal input raises, with a message naming the argument, what was expected and what was given."""
import re

import numpy as np
import pytest

from reference import dense
from reference.example import example_qkv

Q, K, V = example_qkv()


def with_value(arr, index, value):
    arr = arr.copy()
    arr[index] = value
    return arr


def test_nan_message_is_exact():
    with pytest.raises(ValueError) as info:
        dense.attention(with_value(Q, (1, 2), np.nan), K, V)
    assert str(info.value) == "q: expected finite values, got nan at index (1, 2)"


@pytest.mark.parametrize("name, args, given", [
    ("k", (Q, with_value(K, (0, 3), np.inf), V), "got inf at index (0, 3)"),
    ("v", (Q, K, with_value(V, (2, 1), -np.inf)), "got -inf at index (2, 1)"),
    ("q", (with_value(Q, (0, 0), np.nan).astype(np.float32), K, V), "got nan at index (0, 0)"),
])
def test_non_finite_values(name, args, given):
    with pytest.raises(ValueError, match=re.escape(f"{name}: expected finite values, {given}")):
        dense.attention(*args)


@pytest.mark.parametrize("dtype, name", [(np.int64, "int64"), (np.bool_, "bool"), (np.complex128, "complex128"),
                                         (object, "object"), (np.int8, "int8")])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_non_float_dtypes_are_type_errors(dtype, name, position):
    args = [Q, K, V]
    args[position] = args[position].astype(dtype)
    argument = "qkv"[position]
    with pytest.raises(TypeError, match=re.escape(f"{argument}: expected a float dtype")) as info:
        dense.attention(*args)
    assert f"got {name}" in str(info.value)


def test_python_lists_of_ints_are_rejected_as_int():
    with pytest.raises(TypeError, match="q: expected a float dtype .*got int64"):
        dense.scaled_scores([[1, 2]], [[1.0, 2.0]])


def test_fully_masked_row_is_rejected_not_nan():
    with pytest.raises(ValueError) as info:
        dense.attention(Q, K, V, key_padding_mask=np.array([False, True, True]))
    message = str(info.value)
    assert message.startswith("key_padding_mask: expected at least one visible key for every query row, got 0")
    assert "query row (0,)" in message and "absolute position 0" in message


def test_fully_masked_row_in_a_batch_names_batch_and_row():
    q = np.zeros((2, 1, 2, 4))
    k = np.zeros((2, 1, 3, 4))
    v = np.zeros((2, 1, 3, 2))
    pad = np.array([[True, True, True], [False, False, True]])
    with pytest.raises(ValueError, match=re.escape("got 0 for query row (1, 0, 0)")):
        dense.attention(q, k, v, query_start=0, key_padding_mask=pad)
    # with query_start=1, row 0 of sequence 1 sits at position 1 and sees keys 0, 1: both padded
    with pytest.raises(ValueError, match="absolute position 1"):
        dense.attention(q, k, v, query_start=1, key_padding_mask=pad)


def test_softmax_rejects_a_row_of_only_minus_inf():
    with pytest.raises(ValueError, match=re.escape("masked_scores: expected at least one visible (finite) key "
                                                   "per query row, got none in row (1,)")):
        dense.softmax_over_keys(np.array([[0.0, -np.inf], [-np.inf, -np.inf]]))
    with pytest.raises(ValueError, match=re.escape("masked_scores: expected finite values or -inf, got inf")):
        dense.softmax_over_keys(np.array([[0.0, np.inf]]))


@pytest.mark.parametrize("args, pattern", [
    ((Q[0], K, V), "q: expected 2 dimensions [Lq, head_dim] or 4 dimensions [B, H, Lq, head_dim], got shape (4,)"),
    ((Q, K[None], V), "k: expected 2 dimensions like q, got shape (1, 3, 4)"),
    ((Q, K[:, :3], V), "k: expected head_dim 4 (q's last axis), got 3"),
    ((Q, K, V[:2]), "v: expected 3 keys (k's axis -2), got 2"),
    ((Q, K, V[None]), "v: expected 2 dimensions like k, got shape (1, 3, 2)"),
    ((Q[:0], K, V), "q: expected every dimension >= 1, got shape (0, 4)"),
    ((np.zeros((2, 3, 3, 4)), np.zeros((2, 2, 3, 4)), np.zeros((2, 2, 3, 2))),
     "k: expected leading dimensions (B, H) = (2, 3) like q, got (2, 2)"),
])
def test_wrong_shapes(args, pattern):
    with pytest.raises(ValueError, match=re.escape(pattern)):
        dense.attention(*args)


@pytest.mark.parametrize("query_start, q_rows, pattern", [
    (-1, 3, "query_start: expected a non-negative int, got -1"),
    (1.0, 1, "query_start: expected a non-negative int, got 1.0 of type float"),
    (True, 1, "query_start: expected a non-negative int, got True of type bool"),
    (np.bool_(False), 1, "query_start: expected a non-negative int, got"),
    ("2", 1, "query_start: expected a non-negative int, got '2' of type str"),
    (2, 2, "query_start: expected query_start + Lq <= Lk = 3, got 2 + 2 = 4"),
    (3, 1, "query_start: expected query_start + Lq <= Lk = 3, got 3 + 1 = 4"),
])
def test_illegal_query_start(query_start, q_rows, pattern):
    with pytest.raises(ValueError, match=re.escape(pattern)):
        dense.attention(Q[:q_rows], K, V, query_start=query_start)


def test_numpy_integer_query_start_is_accepted():
    out = dense.attention_context(Q[2:], K, V, query_start=np.int64(2))
    np.testing.assert_allclose(out[0], dense.attention_context(Q, K, V)[2], rtol=0, atol=1e-15)


@pytest.mark.parametrize("pad, error, pattern", [
    (np.array([1, 1, 1]), TypeError, "key_padding_mask: expected dtype bool (True = key may be attended), got int64"),
    (np.array([True, True]), ValueError, "key_padding_mask: expected shape (3,), got (2,)"),
    (np.ones((1, 3), dtype=bool), ValueError, "key_padding_mask: expected shape (3,), got (1, 3)"),
])
def test_bad_padding_masks(pad, error, pattern):
    with pytest.raises(error, match=re.escape(pattern)):
        dense.attention(Q, K, V, key_padding_mask=pad)


def test_bad_batched_padding_mask_shape():
    q = np.zeros((2, 1, 2, 4))
    k = np.zeros((2, 1, 3, 4))
    with pytest.raises(ValueError, match=re.escape("key_padding_mask: expected shape (3,) or (2, 3), got (3, 3)")):
        dense.attention_weights(q, k, key_padding_mask=np.ones((3, 3), dtype=bool))


@pytest.mark.parametrize("scale, error, pattern", [
    (0.0, ValueError, "scale: expected a finite positive number, got 0.0"),
    (-1.0, ValueError, "scale: expected a finite positive number, got -1.0"),
    (float("nan"), ValueError, "scale: expected a finite positive number, got nan"),
    (True, TypeError, "scale: expected None or a real number, got True of type bool"),
    ("0.5", TypeError, "scale: expected None or a real number, got '0.5' of type str"),
])
def test_bad_scale(scale, error, pattern):
    with pytest.raises(error, match=re.escape(pattern)):
        dense.scaled_scores(Q, K, scale=scale)
