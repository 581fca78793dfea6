"""float16 storage and bfloat16 models: not identical to the float32 reference, so the error is judged against a
plain computation at the same precision (within 3x of its error, the project's rule for low-precision paths);
token agreement is reported in docs/transformers.md (`python -m tests.hf.precision`)."""
import pytest

from .models import ARCHS
from .precision import bfloat16_model, float16_storage


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", [float16_storage, bfloat16_model], ids=["fp16-storage", "bf16-model"])
def test_low_precision_within_3x_of_plain(arch, path):
    r = path(arch)
    assert r["kernel_calls"] == r["forwards"] * r["layers"] and r["forwards"] == 13
    assert r["paged_error"] <= 3 * r["plain_error"] + 1e-6, r
