"""float16 storage: not identical to the float32 reference, so the error is judged against a plain computation at
the same precision (within 3x of its error, the project's rule for low-precision paths); token agreement is
reported in docs/transformers.md (`python -m tests.hf.precision`). bfloat16 models: tests/hf/test_bf16.py (the
same 3x rule and token identity)."""
import pytest

from .models import ARCHS
from .precision import float16_storage


@pytest.mark.parametrize("arch", ARCHS)
def test_float16_storage_within_3x_of_plain(arch):
    r = float16_storage(arch)
    assert r["kernel_calls"] == r["forwards"] * r["layers"] and r["forwards"] == 13
    assert r["paged_error"] <= 3 * r["plain_error"] + 1e-6, r
