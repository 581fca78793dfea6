"""PagedCache's own semantics: crop (transformers v5 convention), reorder / select / repeat, fork and deepcopy
sharing pages copy-on-write, reset; and every bad input leaving the pool byte-identical (fingerprint)."""
import copy
import gc

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Gemma2Config

from decode.hf import PagedCache, UnsupportedFeatureError
from kvcache import CacheFullError

from .models import generate, model_pair, paged_cache, prompts


def forward(model, ids, mask, cache):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits


@pytest.fixture
def llama():
    return model_pair("llama-gqa", torch.float64)


def test_crop_semantics(llama):
    """crop(0) changes nothing; crop(-n) drops n columns and the next forward equals a fresh prefill of the
    kept prefix; a positive count and one past the start are refused with the pool unchanged."""
    ref, model = llama
    ids, mask = prompts(2, 9, seed=11, pad_lengths=[0, 4])
    cache = paged_cache(model, "float64")
    forward(model, ids, mask, cache)
    before = cache.fingerprint()
    cache.crop(0)
    assert cache.fingerprint() == before and cache.get_seq_length() == 9
    for bad in (3, -10):
        with pytest.raises(ValueError, match="tokens_to_remove"):
            cache.crop(bad)
        assert cache.fingerprint() == before
    cache.crop(-3)
    assert cache.get_seq_length() == 6 and cache.lengths() == [6, 2]
    nxt = forward(model, ids[:, 6:], mask, cache)                 # the dropped columns again
    fresh = forward(ref, ids, mask, DynamicCache(config=ref.config))
    torch.testing.assert_close(nxt[0], fresh[0, 6:], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(nxt[1, 1:], fresh[1, 7:], atol=1e-10, rtol=1e-10)   # row 1: pads before 4


def test_reorder_shares_pages_and_copies_on_write(llama):
    ref, model = llama
    ids, mask = prompts(3, 6, seed=12)
    cache = paged_cache(model, "float64")
    forward(model, ids, mask, cache)
    free = cache.pool.num_free_pages
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert cache.pool.num_free_pages == free + 2                     # row 1's pages freed, none copied
    dyn = DynamicCache(config=ref.config)
    forward(ref, ids, mask, dyn)
    dyn.reorder_cache(torch.tensor([2, 2, 0]))
    nxt = torch.tensor([[5], [6], [7]])
    full = torch.ones(3, 7, dtype=torch.long)
    torch.testing.assert_close(forward(model, nxt, full, cache), forward(ref, nxt, full, dyn), atol=1e-10,
                               rtol=1e-10)
    cache.pool.check_invariants()


def test_reorder_bad_index_unchanged(llama):
    _, model = llama
    ids, mask = prompts(2, 5, seed=13)
    cache = paged_cache(model, "float64")
    forward(model, ids, mask, cache)
    before = cache.fingerprint()
    for bad in (torch.tensor([0, 2]), torch.tensor([[0, 1]]), torch.tensor([0.0, 1.0]), torch.tensor([-1, 0])):
        with pytest.raises(ValueError, match="beam_idx"):
            cache.reorder_cache(bad)
        assert cache.fingerprint() == before


def test_select_and_repeat(llama):
    ref, model = llama
    ids, mask = prompts(2, 5, seed=14, pad_lengths=[0, 2])
    cache, dyn = paged_cache(model, "float64"), DynamicCache(config=ref.config)
    forward(model, ids, mask, cache)
    forward(ref, ids, mask, dyn)
    for c in (cache, dyn):
        c.batch_repeat_interleave(2)
        c.batch_select_indices(torch.tensor([3, 0, 1]))
    assert cache.lengths() == [3, 5, 5]
    nxt, full = torch.tensor([[9], [8], [7]]), torch.cat([mask[[1, 0, 0]], torch.ones(3, 1, dtype=torch.long)], 1)
    torch.testing.assert_close(forward(model, nxt, full, cache), forward(ref, nxt, full, dyn), atol=1e-10,
                               rtol=1e-10)


@pytest.mark.parametrize("how", ["fork", "deepcopy"])
def test_prompt_cache_forks_share_pages(llama, how):
    """A prompt cache reused for several requests: each copy shares the prompt's pages (no pool copy) and
    continues exactly like a fresh run."""
    ref, model = llama
    ids, mask = prompts(1, 11, seed=15)
    prompt = paged_cache(model, "float64")
    forward(model, ids[:, :-1], mask[:, :-1], prompt)
    free = prompt.pool.num_free_pages
    copies = [prompt.fork() if how == "fork" else copy.deepcopy(prompt) for _ in range(4)]
    assert prompt.pool.num_free_pages == free                        # no page taken, no byte copied
    assert all(c.pool is prompt.pool for c in copies)
    for i, c in enumerate(copies):
        out = generate(model, ids, mask, cache=c, max_new_tokens=4 + i, do_sample=False)
        fresh = generate(ref, ids, mask, max_new_tokens=4 + i, do_sample=False)
        assert torch.equal(out.sequences, fresh.sequences)
    assert prompt.lengths() == [10]
    assert prompt.pool.num_free_pages < free                         # the copies wrote pages of their own
    del copies, c, out
    gc.collect()
    assert prompt.pool.num_free_pages == free                        # dropped copies gave their pages back
    last = forward(model, ids[:, -1:], mask, prompt)                # the copies never wrote into the prompt's pages
    fresh = forward(ref, ids, mask, DynamicCache(config=ref.config))
    torch.testing.assert_close(last[0, -1], fresh[0, -1], atol=1e-10, rtol=1e-10)
    assert prompt.lengths() == [11]


def test_reset_takes_any_batch(llama):
    _, model = llama
    cache = paged_cache(model, "float64")
    forward(model, *prompts(2, 4), cache)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.pool.num_free_pages == cache.pool.config.num_pages
    forward(model, *prompts(3, 4), cache)
    assert cache.lengths() == [4, 4, 4]


# -- bad input: clear error, pool byte-identical -------------------------------------------------------------
def prefilled(model):
    ids, mask = prompts(2, 6, seed=16)
    cache = paged_cache(model, "float64", max_tokens=64)
    forward(model, ids, mask, cache)
    return cache, cache.fingerprint()


def test_batch_change_without_reorder(llama):
    _, model = llama
    cache, before = prefilled(model)
    with pytest.raises(ValueError, match="input batch: expected 2 rows"):
        forward(model, torch.tensor([[1], [2], [3]]), torch.ones(3, 7, dtype=torch.long), cache)
    assert cache.fingerprint() == before


def test_cache_for_another_config(llama):
    _, model = llama
    cache, before = prefilled(model)
    other = model_pair("llama-mqa", torch.float64)[1]                # 1 kv head instead of 2
    with pytest.raises(ValueError, match="kv heads"):
        forward(other, torch.tensor([[1], [2]]), torch.ones(2, 7, dtype=torch.long), cache)
    assert cache.fingerprint() == before
    window = model_pair("mistral-window", torch.float64)[1]
    cache2 = PagedCache(model.config, max_tokens=64, dtype="float64")   # built for llama, used by mistral
    with pytest.raises(ValueError, match="sliding_window|kv heads"):
        forward(window, torch.tensor([[1, 2]]), None, cache2)
    assert cache2.lengths() == [0] or cache2.lengths() == []


def test_pool_too_small(llama):
    _, model = llama
    cache, before = prefilled(model)                                 # 12 of 64 tokens used
    with pytest.raises(CacheFullError):
        forward(model, torch.ones(2, 40, dtype=torch.long), torch.ones(2, 46, dtype=torch.long), cache)
    assert cache.fingerprint() == before


def test_failure_in_a_later_layer_rolls_back_every_layer():
    """A token lands in every layer or in none: non-finite K in layer 1 is refused after layer 0 was written."""
    ref, model = model_pair("llama-gqa", torch.float64)
    model = copy.deepcopy(model)
    cache, before = prefilled(model)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.fill_(float("inf"))
    with pytest.raises(ValueError, match="finite"):
        forward(model, torch.tensor([[1], [2]]), torch.ones(2, 7, dtype=torch.long), cache)
    assert cache.fingerprint() == before and cache.get_seq_length() == 6


def test_failure_outside_our_code_is_rolled_back(llama):
    _, model = llama
    cache, before = prefilled(model)

    def boom(*args):
        raise RuntimeError("injected")
    handle = model.model.layers[0].mlp.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            forward(model, torch.tensor([[1], [2]]), torch.ones(2, 7, dtype=torch.long), cache)
    finally:
        handle.remove()
    assert cache.fingerprint() == before and cache.get_seq_length() == 6


# -- refused by name ---------------------------------------------------------------------------------------
def test_refuses_output_attentions(llama):
    _, model = llama
    cache, before = prefilled(model)
    with pytest.raises(UnsupportedFeatureError, match="output_attentions"):
        with torch.no_grad():
            model(input_ids=torch.tensor([[1], [2]]), past_key_values=cache, output_attentions=True)
    assert cache.fingerprint() == before


def test_refuses_output_attentions_gpt2():
    _, model = model_pair("gpt2", torch.float32)
    cache = paged_cache(model)
    with pytest.raises(UnsupportedFeatureError, match="output_attentions"):
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2]]), past_key_values=cache, output_attentions=True)
    assert cache.lengths() == [] and cache.pool.num_free_pages == cache.pool.config.num_pages


def test_refuses_soft_capping():
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_logit_softcapping=50.0)
    with pytest.raises(UnsupportedFeatureError, match="soft-capping"):
        PagedCache(cfg, max_tokens=64)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="pagedkv").eval()
    with pytest.raises(UnsupportedFeatureError, match="soft-capping"):
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2]]))


def test_refuses_additive_4d_mask(llama):
    _, model = llama
    cache, before = prefilled(model)
    bias = torch.zeros(2, 1, 1, 7, dtype=torch.float64)
    with pytest.raises(UnsupportedFeatureError, match="4-D"):
        with torch.no_grad():
            model(input_ids=torch.tensor([[1], [2]]), attention_mask=bias, past_key_values=cache)
    assert cache.fingerprint() == before


def test_refuses_cross_attention_config():
    from transformers import GPT2Config
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, add_cross_attention=True, vocab_size=64)
    with pytest.raises(UnsupportedFeatureError, match="cross-attention"):
        PagedCache(cfg, max_tokens=64)


def test_needs_a_paged_cache(llama):
    _, model = llama
    with pytest.raises(TypeError, match="PagedCache"):
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2]]), past_key_values=DynamicCache(config=model.config))


def test_refuses_autograd(llama):
    _, model = llama
    cache = paged_cache(model, "float64")
    with pytest.raises(UnsupportedFeatureError, match="no_grad"):
        model(input_ids=torch.tensor([[1, 2]]), past_key_values=cache)
    assert cache.lengths() == []


def test_import_decode_imports_no_torch():
    import subprocess
    import sys
    code = "import sys, decode, kvcache; print('torch' in sys.modules or 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_sliding_window_refuses_padding_after_real_tokens():
    """Windows count columns in transformers but pool positions here: only left padding keeps them equal."""
    _, model = model_pair("mistral-window", torch.float64)
    cache = paged_cache(model, "float64")
    ids = torch.tensor([[3, 4, 0, 5]])
    with pytest.raises(UnsupportedFeatureError, match="left padding only"):
        forward(model, ids, torch.tensor([[1, 1, 0, 1]]), cache)
    assert cache.lengths() == [] and cache.pool.num_free_pages == cache.pool.config.num_pages
    forward(model, ids, torch.tensor([[0, 1, 1, 1]]), cache)             # left padding is fine
    before = cache.fingerprint()
    with pytest.raises(UnsupportedFeatureError, match="left padding only"):
        forward(model, torch.tensor([[7]]), torch.tensor([[0, 1, 1, 1, 0]]), cache)
    assert cache.fingerprint() == before
