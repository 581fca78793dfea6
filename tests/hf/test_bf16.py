"""bfloat16 models through generate()'s forwards (issue 20's hf row): the pagedkv run (bfloat16 pages, the
default for a bfloat16 model) against DynamicCache + "sdpa" on the same bfloat16 model,
teacher-forced so both see the same tokens. Greedy choices are identical wherever the reference's top-2 margin
exceeds 8x its own bfloat16 rounding error (`precision.token_identity`); the counts are printed (run with -s)
and reported in docs/transformers.md. The same through generate() itself (greedy, both caches generating their
own tokens): identical tokens at every decided step up to the first near-tie where the runs part.
"""
import pytest

from .models import ARCHS
from .precision import bfloat16_generate, bfloat16_runs, generate_identity, token_identity

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


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_generate_token_identity(arch):
    """generate() on a bfloat16 model, PagedCache (bfloat16 pages) against DynamicCache + "sdpa": token by token
    identical wherever the reference's top-2 margin exceeds 8x its bfloat16 rounding (`generate_identity`)."""
    exact, plain, ours, ref, got, cache, model = bfloat16_generate(arch)
    assert cache.pool.config.storage == "bfloat16"
    assert cache.stats["kernel_calls"] == cache.stats["forwards"] * model.config.num_hidden_layers > 0
    r = generate_identity(exact, plain, ours, ref.sequences, got.sequences, prompt=8)
    print(f"\n{arch} generate, {cache.pool.config.storage} pages: {r['compared']} steps compared, {r['decided']} "
          f"decided, {r['near_ties']} near-ties ({r['flips_at_near_ties']} flipped), "
          f"{r['mismatches_where_decided']} mismatches where decided")
    assert r["mismatches_where_decided"] == 0 and r["decided"] > 0
