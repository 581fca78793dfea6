"""Prefix reuse across generate() calls: `PagedCache(prefix_caching=True)` + `match_prefix` gives the same
tokens as DynamicCache + "sdpa" (logits within the float32 tolerance) while computing only the uncached
columns; generated tokens' pages are registered through `track_token_ids`."""
import numpy as np
import pytest
import torch

from decode.hf import PagedCache

from .models import VOCAB, generate, model_pair
from .test_generate import assert_same


def requests(system_len=24, user_lens=(5, 9, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(1, VOCAB, (system_len,), generator=g)
    return [torch.cat([system, torch.randint(1, VOCAB, (n,), generator=g)])[None] for n in user_lens]


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2"])
def test_reuse_across_generate_calls_same_tokens(arch):
    ref_model, model = model_pair(arch)
    cache = PagedCache(model.config, max_tokens=1024, page_size=4, prefix_caching=True)
    handle = cache.track_token_ids(model)
    try:
        reused = []
        for ids in requests():
            mask = torch.ones_like(ids)
            ref = generate(ref_model, ids, mask, max_new_tokens=6, do_sample=False)
            cache.reset()
            reused.append(cache.match_prefix(ids, mask))
            before = cache.stats["tokens"]
            got = generate(model, ids, mask, cache=cache, max_new_tokens=6, do_sample=False)
            assert_same(ref, got, torch.float32)
            assert cache.stats["tokens"] - before == ids.shape[1] - reused[-1] + 5     # only the uncached columns
            cache.pool.check_invariants()
        assert reused[0] == 0 and reused[1] == reused[2] == 24                         # the system prompt's pages
    finally:
        handle.remove()
    # the generated tokens were registered too: the first request's whole output is found again
    full = got.sequences
    cache.reset()
    assert cache.match_prefix(full) == (full.shape[1] - 1) // 4 * 4


def test_left_padded_batch_reuses_the_same_columns_for_every_row():
    ref_model, model = model_pair("llama-gqa")
    cache = PagedCache(model.config, max_tokens=1024, page_size=4, prefix_caching=True)
    first = requests(user_lens=(6,))[0]
    mask = torch.ones_like(first)
    cache.match_prefix(first, mask)
    generate(model, first, mask, cache=cache, max_new_tokens=2, do_sample=False)
    a, b = requests(user_lens=(7, 3), seed=0)
    ids = torch.zeros((2, a.shape[1]), dtype=torch.long)
    ids[0], ids[1, 4:] = a[0], b[0]
    mask = (ids != 0).long()
    mask[0] = 1
    ref = generate(ref_model, ids, mask, max_new_tokens=4, do_sample=False)
    cache.reset()
    reused = cache.match_prefix(ids, mask)
    assert reused > 0 and cache.lengths() == [reused, reused - 4]
    got = generate(model, ids, mask, cache=cache, max_new_tokens=4, do_sample=False)
    assert_same(ref, got, torch.float32)
    cache.pool.check_invariants()


def test_match_prefix_refusals():
    _, model = model_pair("llama-gqa")
    plain = PagedCache(model.config, max_tokens=64, page_size=4)
    with pytest.raises(ValueError, match="prefix_caching=True"):
        plain.match_prefix(torch.ones((1, 4), dtype=torch.long))
    cache = PagedCache(model.config, max_tokens=64, page_size=4, prefix_caching=True)
    with pytest.raises(ValueError, match="input_ids: expected integer ids"):
        cache.match_prefix(np.ones((4,), dtype=np.int64))
    ids = torch.ones((1, 4), dtype=torch.long)
    cache.match_prefix(ids)
    with pytest.raises(ValueError, match="expected an empty cache"):
        cache.match_prefix(ids)
