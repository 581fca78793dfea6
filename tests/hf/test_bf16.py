"""bfloat16 models through generate()'s forwards (issue 20's hf row): the pagedkv run (bfloat16 pages, the
default for a bfloat16 model) against DynamicCache + "sdpa" on the same bfloat16 model,
teacher-forced so both see the same tokens. Greedy choices are identical wherever the reference's top-2 margin
exceeds 8x its own bfloat16 rounding error (`precision.token_identity`); the counts are printed (run with -s)
and reported in docs/transformers.md."""
import pytest

from .models import ARCHS
from .precision import bfloat16_runs, token_identity

@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_model_token_identity(arch):
    """The default storage of a bfloat16 model: bfloat16 pages."""
    exact, plain, ours, cache, model = bfloat16_runs(arch, steps=12, storage=None, batch=3)
    assert cache.pool.config.storage == "bfloat16"
    assert cache.stats["kernel_calls"] == cache.stats["forwards"] * model.config.num_hidden_layers
    r = token_identity(exact, plain, ours)
    print(f"\n{arch} {cache.pool.config.storage} pages: identical where decided {r['identical_where_decided']}/"
          f"{r['decided']} (of {r['positions']} positions; identical overall {r['identical']}); max logit error "
          f"plain {r['plain_error']:.2e} / paged {r['paged_error']:.2e}")
    assert r["identical_where_decided"] == r["decided"] > 0
    assert r["paged_error"] <= 3 * r["plain_error"] + 1e-6
