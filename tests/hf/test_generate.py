"""generate() through PagedCache + "pagedkv" against DynamicCache + "sdpa" with the same weights, for every
architecture and decoding mode (ports, in our words, of transformers' GenerationTesterMixin checks that apply to
a custom cache). float32: identical tokens, logits within 1e-5; float64: identical tokens, logits within 1e-10.
Every test checks that the paged path ran: one kernel call per layer per forward."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from .models import ARCHS, VOCAB, generate, model_pair, paged_cache, prompts

# logits tolerance atol + rtol * |ref| per model/storage dtype
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-10, 1e-10)}
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")]
STORAGE = {torch.float32: "float32", torch.float64: "float64"}


def assert_same(ref, got, dtype, what="logits"):
    assert torch.equal(ref.sequences, got.sequences), f"tokens differ:\n{ref.sequences}\n{got.sequences}"
    atol, rtol = TOL[dtype]
    assert len(ref.logits) == len(got.logits)
    for step, (a, b) in enumerate(zip(ref.logits, got.logits)):
        err = (a.double() - b.double()).abs()
        bound = atol + rtol * a.double().abs()
        assert bool((err <= bound).all()), f"{what} step {step}: max error {err.max().item():.3g}"


def assert_ran(cache, model, forwards=None):
    """The paged path ran: one kernel call per layer for every forward (and ``forwards`` of them)."""
    layers = model.config.num_hidden_layers
    assert cache.stats["forwards"] > 0
    assert cache.stats["kernel_calls"] == cache.stats["forwards"] * layers
    if forwards is not None:
        assert cache.stats["forwards"] == forwards
    cache.pool.check_invariants()


def run_both(arch, dtype, ids, mask, page_size=4, **kw):
    ref_model, paged_model = model_pair(arch, dtype)
    ref = generate(ref_model, ids, mask, **kw)
    cache = paged_cache(paged_model, STORAGE[dtype], page_size=page_size)
    got = generate(paged_model, ids, mask, cache=cache, **kw)
    return ref, got, cache, paged_model


def record(cache, method):
    """Wrap ``cache.method`` to record its arguments."""
    calls, original = [], getattr(cache, method)

    def wrapper(arg, *a, **k):
        calls.append(arg.clone() if isinstance(arg, torch.Tensor) else arg)
        return original(arg, *a, **k)
    setattr(cache, method, wrapper)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
class TestGenerate:
    def test_greedy(self, arch, dtype):
        ids, mask = prompts(2, 9, seed=1)
        ref, got, cache, model = run_both(arch, dtype, ids, mask, max_new_tokens=12, do_sample=False)
        assert_same(ref, got, dtype)
        assert_ran(cache, model, forwards=12)
        assert cache.lengths() == [9 + 11, 9 + 11]           # the last token is returned, never forwarded

    def test_seeded_sampling(self, arch, dtype):
        ids, mask = prompts(2, 7, seed=2)
        ref, got, cache, model = run_both(arch, dtype, ids, mask, max_new_tokens=10, do_sample=True, top_k=0,
                                          temperature=1.3, seed=77)
        assert_same(ref, got, dtype)
        assert_ran(cache, model, forwards=10)

    def test_beam_search(self, arch, dtype):
        ids, mask = prompts(2, 6, seed=3, pad_lengths=[0, 2])
        ref_model, paged_model = model_pair(arch, dtype)
        kw = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False, output_scores=True)
        ref = generate(ref_model, ids, mask, **kw)
        cache = paged_cache(paged_model, STORAGE[dtype])
        reorders = record(cache, "reorder_cache")
        got = generate(paged_model, ids, mask, cache=cache, **kw)
        assert torch.equal(ref.sequences, got.sequences)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(got.sequences_scores.double(), ref.sequences_scores.double(), atol=atol,
                                   rtol=rtol)
        assert reorders, "reorder_cache never called"
        identity = torch.arange(len(reorders[0]))
        assert any(not torch.equal(r, identity) for r in reorders), "no non-trivial beam reorder happened"
        assert_ran(cache, paged_model)

    def test_assistant_model(self, arch, dtype):
        """Assisted decoding matches the reference and plain greedy (transformers'
        test_assisted_decoding_matches_greedy_search); rejected candidates are cropped from the pool."""
        ids, mask = prompts(1, 8, seed=4)
        ref_model, paged_model = model_pair(arch, dtype)
        torch.manual_seed(99)
        assistant = AutoModelForCausalLM.from_config(
            LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, eos_token_id=None, bos_token_id=None,
                        pad_token_id=0), attn_implementation="sdpa").to(dtype).eval()
        kw = dict(max_new_tokens=12, do_sample=False)
        greedy = generate(ref_model, ids, mask, **kw)
        ref = generate(ref_model, ids, mask, assistant_model=assistant, **kw)
        cache = paged_cache(paged_model, STORAGE[dtype])
        crops = record(cache, "crop")
        got = generate(paged_model, ids, mask, cache=cache, assistant_model=assistant, **kw)
        assert torch.equal(got.sequences, greedy.sequences)
        assert_same(ref, got, dtype)
        assert any(c < 0 for c in crops), f"no candidate was rejected and cropped: {crops}"
        assert_ran(cache, paged_model)
        assert cache.get_seq_length() == got.sequences.shape[1] - 1 or cache.get_seq_length() <= \
            got.sequences.shape[1]

    def test_prompt_lookup(self, arch, dtype):
        """Prompt-lookup decoding matches greedy (test_prompt_lookup_decoding_matches_greedy_search)."""
        pattern = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(5))
        ids = pattern.repeat(1, 4)
        mask = torch.ones_like(ids)
        ref_model, paged_model = model_pair(arch, dtype)
        kw = dict(max_new_tokens=12, do_sample=False)
        greedy = generate(ref_model, ids, mask, **kw)
        ref = generate(ref_model, ids, mask, prompt_lookup_num_tokens=3, **kw)
        cache = paged_cache(paged_model, STORAGE[dtype])
        crops = record(cache, "crop")
        got = generate(paged_model, ids, mask, cache=cache, prompt_lookup_num_tokens=3, **kw)
        assert torch.equal(got.sequences, greedy.sequences)
        assert_same(ref, got, dtype)
        assert any(c < 0 for c in crops), f"no lookup candidate was rejected and cropped: {crops}"
        assert_ran(cache, paged_model)

    def test_left_padded_batch(self, arch, dtype):
        """Three prompt lengths in one left-padded batch; each row also equals its unpadded run
        (test_left_padding_compatibility, test_cache_batched)."""
        ids, mask = prompts(3, 10, seed=6, pad_lengths=[0, 3, 6])
        ref, got, cache, model = run_both(arch, dtype, ids, mask, max_new_tokens=9, do_sample=False)
        assert_same(ref, got, dtype)
        assert_ran(cache, model, forwards=9)
        assert cache.lengths() == [10 + 8, 7 + 8, 4 + 8]     # pads never enter the pool
        for row, pads in enumerate([0, 3, 6]):
            alone = generate(model, ids[row:row + 1, pads:], mask[row:row + 1, pads:],
                             cache=paged_cache(model, STORAGE[dtype]), max_new_tokens=9, do_sample=False)
            assert torch.equal(alone.sequences[0, 10 - pads:], got.sequences[row, 10:])
            atol, rtol = TOL[dtype]
            for a, b in zip(alone.logits, got.logits):
                torch.testing.assert_close(b[row].double(), a[0].double(), atol=atol, rtol=rtol)

    def test_extra_left_padding(self, arch, dtype):
        """Adding pad columns to every row changes nothing (test_cache_extra_left_padding)."""
        ids, mask = prompts(2, 8, seed=7, pad_lengths=[0, 3])
        ref_model, paged_model = model_pair(arch, dtype)
        extra_ids = torch.cat([torch.zeros(2, 5, dtype=ids.dtype), ids], dim=1)
        extra_mask = torch.cat([torch.zeros(2, 5, dtype=mask.dtype), mask], dim=1)
        kw = dict(max_new_tokens=8, do_sample=False)
        plain = generate(paged_model, ids, mask, cache=paged_cache(paged_model, STORAGE[dtype]), **kw)
        ref = generate(ref_model, extra_ids, extra_mask, **kw)
        cache = paged_cache(paged_model, STORAGE[dtype])
        got = generate(paged_model, extra_ids, extra_mask, cache=cache, **kw)
        assert_same(ref, got, dtype)
        assert torch.equal(got.sequences[:, 13:], plain.sequences[:, 8:])
        assert cache.lengths() == [8 + 7, 5 + 7]
        assert_ran(cache, paged_model, forwards=8)

    def test_two_call_continuation(self, arch, dtype):
        """Generating 6 then 6 more from the returned cache equals generating 12 at once
        (test_generate_continue_from_past_key_values)."""
        ids, mask = prompts(2, 7, seed=8, pad_lengths=[2, 0])
        ref_model, paged_model = model_pair(arch, dtype)
        once = generate(ref_model, ids, mask, max_new_tokens=12, do_sample=False)
        cache = paged_cache(paged_model, STORAGE[dtype])
        first = generate(paged_model, ids, mask, cache=cache, max_new_tokens=6, do_sample=False)
        seq = first.sequences
        mask2 = torch.cat([mask, torch.ones(2, seq.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
        second = generate(paged_model, seq, mask2, cache=first.past_key_values, max_new_tokens=6, do_sample=False)
        assert second.past_key_values is cache
        assert torch.equal(second.sequences, once.sequences)
        atol, rtol = TOL[dtype]
        for a, b in zip(once.logits, first.logits + second.logits):
            torch.testing.assert_close(b.double(), a.double(), atol=atol, rtol=rtol)
        assert_ran(cache, paged_model, forwards=12)

    def test_many_pages(self, arch, dtype):
        """A generation crossing many pages (page_size 2); with every layer sliding, old pages go back."""
        ids, mask = prompts(1, 5, seed=9)
        ref, got, cache, model = run_both(arch, dtype, ids, mask, page_size=2, max_new_tokens=40, do_sample=False)
        assert_same(ref, got, dtype)
        assert_ran(cache, model, forwards=40)
        held = cache.pool.config.num_pages - cache.pool.num_free_pages
        window = cache.layout.release_window
        if window:
            assert held <= -(-window // 2) + 1, f"{held} pages held with a window of {window}"
        else:
            assert held == -(-(5 + 39) // 2)
