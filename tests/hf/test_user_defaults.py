"""What a transformers user reaches for (issue 19, part 3): torch dtypes for the storage, a default storage that
follows the model's dtype, and a sizing helper for generate()."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from decode.hf import PagedCache
from decode.hf.sizing import pages_for_generate

from .test_misuse import build, forward, llama
from .models import generate, prompts


@pytest.mark.parametrize("given,stored", [
    (torch.float16, "float16"), (torch.float32, "float32"), (torch.float64, "float64"), ("float16", "float16"),
    ("int8", "int8"), (np.float32, "float32"), (np.dtype("float64"), "float64")])
def test_storage_dtype_accepts_names_numpy_and_torch_dtypes(given, stored):
    assert PagedCache(llama(), max_tokens=32, dtype=given).pool.config.storage == stored


@pytest.mark.parametrize("given", [torch.bfloat16, "bfloat16"])
def test_bfloat16_storage(given):
    assert PagedCache(llama(), max_tokens=32, dtype=given).pool.config.storage == "bfloat16"


@pytest.mark.parametrize("given", [torch.int32, "fp16", "float", object()])
def test_other_dtypes_are_refused_by_name(given):
    with pytest.raises(TypeError, match="dtype: expected None .*torch.bfloat16"):
        PagedCache(llama(), max_tokens=32, dtype=given)


def test_default_storage_follows_a_moved_model_at_its_first_forward():
    """``model.to(float64)`` leaves config.dtype None: the pool takes float64 at the first forward, and the
    tokens are DynamicCache's to float64 precision (a float32 pool would not give them)."""
    paged, ref = build(llama(), "pagedkv"), build(llama(), "sdpa")
    assert paged.config.dtype is None
    cache = PagedCache(paged.config, max_tokens=256, page_size=4)
    ids, mask = prompts(2, 7, seed=1, pad_lengths=[0, 2])
    got = generate(paged, ids, mask, cache=cache, max_new_tokens=6, do_sample=False)
    want = generate(ref, ids, mask, max_new_tokens=6, do_sample=False)
    assert cache.pool.config.storage == "float64"
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(want.logits, got.logits):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10)


def test_default_storage_of_a_bfloat16_model():
    """bfloat16 pages for a bfloat16 model, whether its config says so or its first forward does."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama(), attn_implementation="pagedkv", dtype=torch.bfloat16).eval()
    assert model.config.dtype == torch.bfloat16                       # known at construction
    expected = "bfloat16"
    assert PagedCache(model.config, max_tokens=32).pool.config.storage == expected
    moved = build(llama(), "pagedkv", dtype=torch.bfloat16)          # config.dtype None: known at the first forward
    cache = PagedCache(moved.config, max_tokens=64, page_size=4)
    forward(moved, *prompts(1, 5), cache)
    assert cache.pool.config.storage == expected


def test_a_failed_first_forward_leaves_the_provisional_pool():
    paged = build(llama(), "pagedkv")                                  # float64
    cache = PagedCache(paged.config, max_tokens=8, page_size=4)
    before = cache.fingerprint()
    with pytest.raises(Exception, match="needs max_tokens"):
        forward(paged, *prompts(1, 20), cache)
    assert cache.fingerprint() == before and cache.pool.config.storage == "float32"


def test_match_prefix_before_the_first_forward_needs_an_explicit_dtype():
    paged = build(llama(), "pagedkv")                                  # float64, config.dtype None
    cache = PagedCache(paged.config, max_tokens=64, page_size=4, prefix_caching=True)
    ids, mask = prompts(1, 9)
    cache.match_prefix(ids, mask)
    before = cache.fingerprint()
    with pytest.raises(ValueError, match="dtype: expected an explicit dtype.*dtype=torch.float64"):
        forward(paged, ids, mask, cache)
    assert cache.fingerprint() == before
    explicit = PagedCache(paged.config, max_tokens=64, page_size=4, prefix_caching=True, dtype=torch.float64)
    explicit.match_prefix(ids, mask)
    ref = build(llama(), "sdpa")
    torch.testing.assert_close(forward(paged, ids, mask, explicit),
                               forward(ref, ids, mask, DynamicCache(config=ref.config)), atol=1e-10, rtol=1e-10)


def test_for_generate_sizes_rows_beams_and_pages():
    cache = PagedCache.for_generate(llama(), batch_size=2, max_length=18, num_beams=3, page_size=4)
    assert cache.pool.config.num_pages == pages_for_generate(2, 18, 4, 3) == 2 * 3 * (5 + 1)
    with pytest.raises(TypeError, match="for_generate: expected no max_tokens"):
        PagedCache.for_generate(llama(), 1, 8, max_tokens=64)
    with pytest.raises(ValueError, match="num_beams: expected an int >= 1"):
        PagedCache.for_generate(llama(), 1, 8, num_beams=0)


@pytest.mark.parametrize("amx_cpu", [False, True])
def test_kernel_threads_auto_follows_the_cpu(monkeypatch, amx_cpu):
    """``kernel_threads="auto"`` (the default) is numba's setting (None) on a CPU with AMX, where a second kernel
    thread measured faster beside torch, and 1 elsewhere; forks keep it; explicit values stay as given."""
    from decode import attention_plan

    monkeypatch.setattr(attention_plan, "AMX_CPU", amx_cpu)
    want = None if amx_cpu else 1
    assert PagedCache(llama(), max_tokens=32).kernel_threads == want
    cache = PagedCache(llama(), max_tokens=32, kernel_threads="auto")
    assert cache.kernel_threads == want and cache.fork().kernel_threads == want
    assert PagedCache(llama(), max_tokens=32, kernel_threads=2).kernel_threads == 2
    assert PagedCache(llama(), max_tokens=32, kernel_threads=None).kernel_threads is None


@pytest.mark.parametrize("given", ["two", "AUTO", 0, True, 1.5])
def test_bad_kernel_threads_are_refused_by_name(given):
    with pytest.raises(ValueError, match="kernel_threads: expected None, 'auto' or an int >= 1"):
        PagedCache(llama(), max_tokens=32, kernel_threads=given)
