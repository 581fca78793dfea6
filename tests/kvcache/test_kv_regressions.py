"""Regression tests for bugs found (and fixed) in kvcache while writing this suite; one section per fix."""
import numpy as np
import pytest

import kvcache
from kvcache.checks import check_storage_dtype


# -- 1. check_storage_dtype accepted unknown dtype names ---------------------------------------------------
# `np.dtype("float64") == None` is True, so a name numpy does not know (resolved to None) passed the
# `resolved not in STORAGE_DTYPES` test and the pool silently became float64 (np.zeros(dtype=None)).
@pytest.mark.parametrize("dtype", ["bfloat16", "foo", None, "float8"])
def test_unknown_dtype_names_are_rejected(dtype):
    with pytest.raises(TypeError, match=r"dtype: expected one of float16, float32, float64, got"):
        check_storage_dtype("dtype", dtype)
    with pytest.raises(TypeError, match="dtype: expected one of"):
        kvcache.KVCache(num_kv_heads=1, head_dim=2, num_pages=1, dtype=dtype)
