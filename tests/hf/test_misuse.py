"""Combinations a transformers user can build that once returned plausible, wrong tokens (issue 19, part 1):
each is now refused by name before anything changes, or computes exactly what DynamicCache + "sdpa" does.
float64 models and storage, so "the same" means identical tokens and logits within 1e-10."""
import torch
import pytest
from transformers import DynamicCache, GPT2Config, LlamaConfig, StaticCache

from decode.hf import PagedAttentionRequired, PagedCache, UnsupportedFeatureError

from .models import VOCAB, build, generate, prompts

TOL = dict(atol=1e-10, rtol=1e-10)


def llama(layers=2, kv_heads=2, head_dim=None, heads=4):
    extra = {} if head_dim is None else {"head_dim": head_dim}
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                       eos_token_id=None, bos_token_id=None, pad_token_id=0, **extra)


def forward(model, ids, mask, cache):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits


def cache_for(config_or_model, **kw):
    config = getattr(config_or_model, "config", config_or_model)
    return PagedCache(config, max_tokens=kw.pop("max_tokens", 256), dtype=kw.pop("dtype", "float64"),
                      page_size=kw.pop("page_size", 4), **kw)


def assert_untouched(cache, before):
    assert cache.fingerprint() == before and cache.lengths() == [] and not cache.is_initialized


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_paged_cache_on_a_model_not_on_pagedkv_is_refused(impl, layers):
    """PagedCache.update returns only the new K/V: sdpa / eager attending over them alone must not run."""
    model = build(llama(layers), impl)
    ids, mask = prompts(1, 6, seed=1)
    assert generate(model, ids, mask, cache=DynamicCache(config=model.config), max_new_tokens=4,
                    do_sample=False).sequences.shape == (1, 10)                       # the reference runs
    cache = cache_for(model)
    before = cache.fingerprint()
    with pytest.raises(PagedAttentionRequired, match="attn_implementation='pagedkv'"):
        generate(model, ids, mask, cache=cache, max_new_tokens=4, do_sample=False)
    assert_untouched(cache, before)


def test_a_filled_cache_given_to_an_sdpa_model_is_refused_at_its_first_layer():
    """The cache holds a prompt (pagedkv); the same weights on sdpa must not continue from it."""
    paged, plain = build(llama(1), "pagedkv"), build(llama(1), "sdpa")
    ids, mask = prompts(1, 6, seed=2)
    cache = cache_for(paged)
    forward(paged, ids, mask, cache)
    before = cache.fingerprint()
    with pytest.raises(PagedAttentionRequired):
        forward(plain, ids[:, :1], torch.ones(1, 7, dtype=torch.long), cache)
    assert cache.fingerprint() == before and cache.lengths() == [6]


@pytest.mark.parametrize("model_layers,cache_layers", [(2, 4), (6, 4)])
def test_a_cache_built_for_a_deeper_or_shallower_model_is_refused(model_layers, cache_layers):
    model = build(llama(model_layers), "pagedkv")
    cache = cache_for(llama(cache_layers))
    before = cache.fingerprint()
    ids, mask = prompts(1, 5, seed=3)
    with pytest.raises(ValueError, match=f"built for this model \\({model_layers} layers.*built for {cache_layers} "
                                         f"layers"):
        forward(model, ids, mask, cache)
    assert_untouched(cache, before)


@pytest.mark.parametrize("other", [dict(kv_heads=4), dict(kv_heads=2, head_dim=12), dict(heads=8, kv_heads=2)],
                         ids=["kv-heads", "head-dim", "q-heads"])
def test_a_cache_of_another_shape_is_refused_and_stays_empty(other):
    """The 4-kv-head model on a fresh 2-kv-head cache: refused, and the cache is left as new (not `rows [0]`),
    so the model it was built for then runs a batch of 2 on it exactly like DynamicCache."""
    right = build(llama(), "pagedkv")
    wrong = build(llama(**other), "pagedkv")
    cache = cache_for(right)
    before = cache.fingerprint()
    with pytest.raises(ValueError, match="expected a PagedCache built for this model"):
        forward(wrong, *prompts(1, 5, seed=4), cache)
    assert_untouched(cache, before)
    ids, mask = prompts(2, 5, seed=5)
    ref = build(llama(), "sdpa")
    torch.testing.assert_close(forward(right, ids, mask, cache),
                               forward(ref, ids, mask, DynamicCache(config=ref.config)), **TOL)


@pytest.mark.parametrize("config", [llama(), GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                                        vocab_size=VOCAB, eos_token_id=None, bos_token_id=None,
                                                        pad_token_id=0)], ids=["llama", "gpt2"])
def test_right_and_inner_padding_match_sdpa_and_eager(config):
    """A right-padded row's last column is a pad: its query attends the row's real tokens in sdpa and eager,
    and so in pagedkv; then generation continues after the pad columns (inner padding)."""
    ids, mask = prompts(3, 8, seed=6)
    mask[0, 5:] = 0                           # right padding
    mask[1, 2:4] = 0                          # inner padding
    mask[2, :3] = 0                           # left padding
    ids[mask == 0] = 0
    paged = build(config, "pagedkv")
    cache = cache_for(paged)
    got = generate(paged, ids, mask, cache=cache, max_new_tokens=6, do_sample=False)
    # eager: only the rows without left padding (a left pad's empty softmax is NaN there); its float64 sums are
    # ordered otherwise, and generate() casts logits to float32: within 1e-6
    for impl, rows, tol in (("sdpa", [0, 1, 2], 1e-10), ("eager", [0, 1], 1e-6)):
        ref = generate(build(config, impl), ids, mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(got.sequences[rows], ref.sequences[rows]), impl
        for a, b in zip(ref.logits, got.logits):
            torch.testing.assert_close(b[rows], a[rows], atol=tol, rtol=tol)
    assert cache.lengths() == [5 + 5, 6 + 5, 5 + 5]                     # pads never enter the pool


def test_a_row_of_padding_only_is_refused():
    model = build(llama(), "pagedkv")
    cache = cache_for(model)
    before = cache.fingerprint()
    ids, mask = prompts(2, 4, seed=7)
    mask[1] = 0
    with pytest.raises(UnsupportedFeatureError, match=r"rows \[1\] all padding"):
        forward(model, ids, mask, cache)
    assert_untouched(cache, before)


def test_a_cache_reused_across_two_models_continues_like_dynamic_cache():
    """Same layout, other weights: the second model attends over the first one's K/V, as with DynamicCache."""
    a_paged, b_paged = build(llama(), "pagedkv", seed=1), build(llama(), "pagedkv", seed=2)
    a_ref, b_ref = build(llama(), "sdpa", seed=1), build(llama(), "sdpa", seed=2)
    ids, mask = prompts(2, 9, seed=8, pad_lengths=[0, 3])
    cache, dyn = cache_for(a_paged), DynamicCache(config=a_ref.config)
    forward(a_paged, ids[:, :6], mask[:, :6], cache)
    forward(a_ref, ids[:, :6], mask[:, :6], dyn)
    torch.testing.assert_close(forward(b_paged, ids[:, 6:], mask, cache), forward(b_ref, ids[:, 6:], mask, dyn),
                               **TOL)


def test_torch_compile_is_refused_by_name():
    model = build(llama(1), "pagedkv")
    cache = cache_for(model)
    before = cache.fingerprint()
    with pytest.raises(Exception, match="torch.compile: decode.hf.PagedCache"):
        with torch.no_grad():
            torch.compile(model)(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=cache)
    assert_untouched(cache, before)


@pytest.mark.parametrize("how", ["cache_implementation", "StaticCache"])
def test_static_cache_on_a_pagedkv_model_is_refused_as_such(how):
    model = build(llama(), "pagedkv")
    ids, mask = prompts(1, 4, seed=9)
    kw = ({"cache_implementation": "static"} if how == "cache_implementation" else
          {"past_key_values": StaticCache(config=model.config, max_cache_len=16)})
    with pytest.raises(TypeError, match="past_key_values: attn_implementation='pagedkv' expected a "
                                        "decode.hf.PagedCache.*StaticCache"):
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, **kw)


def test_batch_size_change_is_refused_then_reset_takes_any():
    paged, ref = build(llama(), "pagedkv"), build(llama(), "sdpa")
    cache = cache_for(paged)
    forward(paged, *prompts(2, 5, seed=10), cache)
    before = cache.fingerprint()
    three = prompts(3, 5, seed=11)
    longer = torch.ones(3, 10, dtype=torch.long)                      # past + new columns
    with pytest.raises(ValueError, match="input batch: expected 2 rows"):
        forward(paged, three[0], longer, cache)
    assert cache.fingerprint() == before and cache.lengths() == [5, 5]
    dyn = DynamicCache(config=ref.config)
    forward(ref, *prompts(2, 5, seed=10), dyn)
    with pytest.raises(RuntimeError):                                  # DynamicCache fails too (torch.cat)
        forward(ref, three[0], longer, dyn)
    cache.reset()
    torch.testing.assert_close(forward(paged, *three, cache),
                               forward(ref, *three, DynamicCache(config=ref.config)), **TOL)


def test_model_forward_called_directly_matches_dynamic_cache():
    """Prefill and single steps through model.forward (no generate, default positions), and a forward with
    use_cache=False on a cache transformers still passes to the layers: the same as DynamicCache."""
    paged, ref = build(llama(), "pagedkv"), build(llama(), "sdpa")
    ids, _ = prompts(2, 9, seed=12)
    cache, dyn = cache_for(paged), DynamicCache(config=ref.config)
    with torch.no_grad():
        for lo, hi in ((0, 6), (6, 7), (7, 9)):
            got = paged.forward(input_ids=ids[:, lo:hi], past_key_values=cache).logits
            want = ref.forward(input_ids=ids[:, lo:hi], past_key_values=dyn).logits
            torch.testing.assert_close(got, want, **TOL)
    assert cache.lengths() == [9, 9] and cache.get_seq_length() == dyn.get_seq_length() == 9
