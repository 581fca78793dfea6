"""A failed call leaves a PagedCache as it was (issue 19, part 2): the pool byte for byte (`fingerprint`, the
sequence-id counter included) and the cache's own rows and columns.

The fault-injection sweep follows tests/reliability/test_cache_faults.py: a clean run with a counting `FaultInjector`
on the pool lists the fault points an entry point passes; then, for each index i, a fresh identical cache runs
it with ``FaultInjector(fail_at=i)``: `InjectedFault` propagates (through transformers when it is a forward),
the state is what it was, the pool's invariants hold, and the same call then succeeds with the state of the
clean run."""
import torch
import pytest
from transformers import DynamicCache

from decode.hf import PagedCache
from kvcache import CacheFullError
from kvcache.testing import FaultInjector, InjectedFault, set_fault_hook
from kvcache.faults import no_fault

from .models import model_pair, prompts
from .test_misuse import build, forward, llama


def state(cache):
    return cache.fingerprint(), tuple(cache.lengths()), cache.get_seq_length(), cache.batch_size


@pytest.fixture(scope="module")
def gqa():
    return model_pair("llama-gqa", torch.float64)


def new_cache(model, **kw):
    return PagedCache(model.config, max_tokens=kw.pop("max_tokens", 96), dtype="float64", page_size=4, **kw)


# -- the three cases of the issue ---------------------------------------------------------------------------------
def test_kv_head_mismatch_leaves_a_fresh_cache_fresh(gqa):
    _, model = gqa
    cache = PagedCache(model_pair("llama-mha", torch.float64)[1].config, max_tokens=64, dtype="float64")
    before = state(cache)
    with pytest.raises(ValueError, match="kv heads"):
        forward(model, *prompts(1, 4), cache)
    assert state(cache) == before == (before[0], (), 0, -1) and not cache.is_initialized


def test_deeper_model_commits_nothing():
    model = build(llama(6), "pagedkv")
    cache = PagedCache(llama(4), max_tokens=64, dtype="float64", page_size=4)
    before = state(cache)
    with pytest.raises(ValueError, match="6 layers.*built for 4 layers"):
        forward(model, *prompts(1, 5), cache)
    assert state(cache) == before and cache.pool.num_free_pages == cache.pool.config.num_pages


@pytest.mark.parametrize("filled", [False, True], ids=["fresh", "filled"])
def test_prompt_longer_than_the_pool_changes_nothing(gqa, filled):
    _, model = gqa
    cache = new_cache(model, max_tokens=32)
    if filled:
        forward(model, *prompts(2, 6), cache)
    before = state(cache)
    width = 40
    mask = torch.ones(2, cache.get_seq_length() + width, dtype=torch.long)
    with pytest.raises(CacheFullError, match="needs max_tokens >= .*PagedCache.for_generate"):
        forward(model, torch.ones(2, width, dtype=torch.long), mask, cache)
    assert state(cache) == before
    cache.pool.check_invariants()


def test_cache_full_mid_generation_says_what_fits(gqa):
    """Sized for the prompt alone: the error names the tokens generated and the max_tokens that would fit; the
    cache sized by for_generate (beams included) runs the same call like DynamicCache."""
    ref, model = gqa
    ids, mask = prompts(2, 6, pad_lengths=[0, 2])
    small = new_cache(model, max_tokens=16)
    with pytest.raises(CacheFullError, match=r"after \d+ generated token\(s\) per row \(6 rows.*needs max_tokens >= "
                                             r"\d+"):
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, past_key_values=small, max_new_tokens=12, num_beams=3,
                           do_sample=False)
    sized = PagedCache.for_generate(model.config, batch_size=2, max_length=6 + 12, num_beams=3, page_size=4,
                                    dtype="float64")
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, past_key_values=sized, max_new_tokens=12, num_beams=3,
                             do_sample=False)
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=12, num_beams=3, do_sample=False)
    assert torch.equal(got, want)


# -- fault-injection sweep ----------------------------------------------------------------------------------------
def sweep(build_case, op):
    """The protocol of the module docstring; returns the fault points of ``op``."""
    cache, ctx = build_case()
    counter = FaultInjector()
    set_fault_hook(cache.pool, counter)
    op(cache, ctx)
    set_fault_hook(cache.pool, no_fault)
    expected = state(cache)
    points = list(counter.points)
    assert points, "the entry point passed no fault point"
    for i, point in enumerate(points):
        cache, ctx = build_case()
        before = state(cache)
        set_fault_hook(cache.pool, FaultInjector(fail_at=i))
        with pytest.raises(InjectedFault, match=f"^injected fault #{i} at '{point}'$"):
            op(cache, ctx)
        set_fault_hook(cache.pool, no_fault)
        assert state(cache) == before, f"fault #{i} at {point!r} changed the cache"
        cache.pool.check_invariants()
        op(cache, ctx)
        assert state(cache) == expected, f"retry after fault #{i} at {point!r} differs from a clean run"
    return points


def prefilled(model, batch=2, length=6, pads=(0, 3), **kw):
    cache = new_cache(model, **kw)
    forward(model, *prompts(batch, length, seed=5, pad_lengths=list(pads)[:batch]), cache)
    return cache


def test_sweep_first_forward(gqa):
    _, model = gqa
    ids, mask = prompts(2, 7, seed=1, pad_lengths=[0, 2])
    points = sweep(lambda: (new_cache(model), None), lambda cache, _: forward(model, ids, mask, cache))
    assert "allocate" in points and "write_k" in points and points[-1] == "publish"


def test_sweep_step_with_copy_on_write(gqa):
    """A decode step after a beam reorder shares a partly filled page: the write copies it first."""
    _, model = gqa

    def case():
        cache = prefilled(model)
        cache.reorder_cache(torch.tensor([0, 0]))
        return cache, None
    step = torch.tensor([[3], [4]]), torch.ones(2, 7, dtype=torch.long)
    points = sweep(case, lambda cache, _: forward(model, *step, cache))
    assert "cow_copy" in points


@pytest.mark.parametrize("name,op", [
    ("reorder", lambda c: c.reorder_cache(torch.tensor([1, 1, 0]))),
    ("select", lambda c: c.batch_select_indices(torch.tensor([2, 0]))),
    ("repeat", lambda c: c.batch_repeat_interleave(2)),
    ("crop", lambda c: c.crop(-3)),
    ("fork", lambda c: c.fork()),
    ("reset", lambda c: c.reset()),
])
def test_sweep_row_operations(gqa, name, op):
    _, model = gqa
    held = []                                       # a fork must outlive the call (its __del__ frees its rows)
    sweep(lambda: (prefilled(model, batch=3, pads=(0, 3, 1)), None), lambda cache, _: held.append(op(cache)))


def test_sweep_crop_releasing_window_pages():
    _, model = model_pair("mistral-window", torch.float64)       # every layer slides: crop(0) releases pages

    def case():
        cache = new_cache(model)
        cache.activate_past_recording()
        forward(model, *prompts(2, 15, seed=2, pad_lengths=[0, 4]), cache)
        return cache, None
    points = sweep(case, lambda cache, _: cache.crop(0))
    assert "decref" in points


def test_sweep_match_prefix(gqa):
    """Prefix reuse for a batch: every row's match in one group (the pools differ in their random salt, so
    each run is judged against its own state)."""
    _, model = gqa
    ids = prompts(2, 13, seed=3)[0]

    def case():
        cache = new_cache(model, prefix_caching=True)
        cache.match_prefix(ids)                                   # registers the prompt's ids
        forward(model, ids, None, cache)
        cache.reset()
        return cache, None
    cache, _ = case()
    counter = FaultInjector()
    set_fault_hook(cache.pool, counter)
    cache.match_prefix(ids)
    points = list(counter.points)
    assert points
    for i in range(len(points)):
        cache, _ = case()
        before = state(cache)
        set_fault_hook(cache.pool, FaultInjector(fail_at=i))
        with pytest.raises(InjectedFault):
            cache.match_prefix(ids)
        set_fault_hook(cache.pool, no_fault)
        assert state(cache) == before
        assert cache.match_prefix(ids) == 12 and cache.lengths() == [12, 12]


def test_fault_after_commit_keeps_the_forward_and_releases_later():
    """A fault while giving back sliding-window pages after a forward landed: the forward stands (no error,
    logits of DynamicCache), the pages go back at the next forward."""
    ref, model = model_pair("mistral-window", torch.float64)
    ids, mask = prompts(1, 15, seed=4)        # window 7, pages of 4: the step to 14 frees page 1
    cache, dyn = new_cache(model), DynamicCache(config=ref.config)
    forward(model, ids[:, :13], mask[:, :13], cache)
    forward(ref, ids[:, :13], mask[:, :13], dyn)
    seen = []

    def fail_first_release(point):
        seen.append(point)
        if point == "decref" and seen.count("decref") == 1:
            raise InjectedFault("injected")
    set_fault_hook(cache.pool, fail_first_release)
    got = forward(model, ids[:, 13:14], mask[:, :14], cache)
    set_fault_hook(cache.pool, no_fault)
    torch.testing.assert_close(got, forward(ref, ids[:, 13:14], mask[:, :14], dyn), atol=1e-10, rtol=1e-10)
    assert "decref" in seen and cache.lengths() == [14] and cache.stats["deferred_releases"] == 1
    kept = cache.pool.config.num_pages - cache.pool.num_free_pages
    torch.testing.assert_close(forward(model, ids[:, 14:15], mask, cache), forward(ref, ids[:, 14:15], mask, dyn),
                               atol=1e-10, rtol=1e-10)
    assert cache.pool.config.num_pages - cache.pool.num_free_pages < kept     # released now
