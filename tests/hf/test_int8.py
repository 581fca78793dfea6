"""An int8 PagedCache against a float32 PagedCache (same weights, "pagedkv" attention) on the random Llamas of
these tests, 256 tokens: greedy token agreement over 240 generated tokens after a 16-token prompt, and the max
logit error of a 256-token teacher-forced forward (the int8 cache quantizes every K/V row it stores; the float32
one is exact against "sdpa", test_generate.py). The figures are printed and reported in docs/int8.md."""
import pytest
import torch

from .models import generate, model_pair, paged_cache, prompts


@pytest.mark.parametrize("arch", ["llama-gqa", pytest.param("llama-mha", marks=pytest.mark.slow)])
def test_int8_cache_against_float32_cache(arch):
    _, model = model_pair(arch)
    ids, mask = prompts(1, 16, seed=3)
    exact = generate(model, ids, mask, cache=paged_cache(model, "float32", max_tokens=512), max_new_tokens=240,
                     do_sample=False)
    int8 = generate(model, ids, mask, cache=paged_cache(model, "int8", max_tokens=512), max_new_tokens=240,
                    do_sample=False)
    new_exact, new_int8 = exact.sequences[0, 16:], int8.sequences[0, 16:]
    agree = (new_exact == new_int8).float().mean().item()
    diverge = next((i for i in range(240) if new_exact[i] != new_int8[i]), 240)

    full = exact.sequences                                          # [1, 256]: teacher-forced on the same tokens
    with torch.no_grad():
        ref = model(full, past_key_values=paged_cache(model, "float32", max_tokens=512)).logits
        got = model(full, past_key_values=paged_cache(model, "int8", max_tokens=512)).logits
    err = (got.double() - ref.double()).abs().max().item()
    spread = (ref.max() - ref.min()).item()
    print(f"\n{arch}: greedy agreement {agree:.4f} over 240 tokens (first difference at {diverge}), "
          f"max logit error {err:.3e} (logit range {spread:.3f})")
    assert full.shape == (1, 256)
    assert err <= 0.02 * spread                                     # int8 K/V: ~1e-2 relative attention error
