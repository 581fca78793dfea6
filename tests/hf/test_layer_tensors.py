"""`decode.hf.layer_tensors.check_finite`: every non-finite value is refused and named at its (b, h, t, d) index, in
every float dtype a model hands over and in every layout (transformers' transposed q / k / v, contiguous tensors,
a range of columns, a strided one that the bits pass does not take), and every finite value passes, the largest and
the subnormals included."""
import numpy as np
import pytest
import torch

from decode.hf.layer_tensors import check_finite

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
SHAPE = (2, 4, 7, 8)                                   # [B, H, T, D]


def _layouts(x):
    """``x [B, H, T, D]`` (contiguous) as the layouts the checks see, each a [B, H, T, D] tensor of the same
    values: contiguous; transformers' ``view(B, T, H, D).transpose(1, 2)``; every other column of a wider tensor
    (not a permutation of a contiguous layout)."""
    transposed = x.transpose(1, 2).contiguous().transpose(1, 2)
    wide = torch.zeros(x.shape[:2] + (2 * x.shape[2], x.shape[3]), dtype=x.dtype)
    wide[:, :, ::2] = x
    return {"contiguous": x, "transposed": transposed, "strided": wide[:, :, ::2]}


def _extremes(dtype):
    info = torch.finfo(dtype)
    return [info.max, -info.max, info.tiny, info.tiny / 4 if dtype != torch.bfloat16 else info.tiny / 2, -0.0, 0.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_values_pass_in_every_layout(dtype):
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal(SHAPE)).to(dtype)
    x.view(-1)[:6] = torch.tensor(_extremes(dtype), dtype=dtype)
    for name, t in _layouts(x).items():
        check_finite("query", t)
        check_finite("key", t, rows=[(0, slice(1, 6)), (1, slice(0, 7))])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_value_is_named_in_every_layout(dtype, bad):
    rng = np.random.default_rng(5)
    for trial in range(4):
        index = tuple(int(rng.integers(n)) for n in SHAPE)
        x = torch.from_numpy(rng.standard_normal(SHAPE)).to(dtype)
        x[index] = bad
        for name, t in _layouts(x).items():
            with pytest.raises(ValueError, match=rf"value: expected finite values, got {bad} at index "
                                                 rf"\({', '.join(map(str, index))}\)"):
                check_finite("value", t)
            b, _, col, _ = index
            with pytest.raises(ValueError, match=r"key: expected finite values"):
                check_finite("key", t, rows=[(b, slice(col, col + 1))])
            other = slice(0, col) if col else slice(col + 1, SHAPE[2])    # the row's other columns: finite
            check_finite("key", t, rows=[(b, other), (1 - b, slice(0, SHAPE[2]))])
