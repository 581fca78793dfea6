"""Low-precision paths measured against a plain computation at the same precision (shared by the tests and
`python -m tests.hf.precision`, which prints the table of docs/transformers.md).

* float16 storage: PagedCache(dtype="float16") against DynamicCache holding K/V rounded to float16 (the plain
  computation at that precision), both judged against the float32 DynamicCache run;
* bfloat16 models: "pagedkv" against "sdpa" on the same bfloat16 model, both judged against a float64 copy of
  the bfloat16 weights.
Logits come from teacher forcing (one prefill, then one token per forward), so both runs see the same tokens.
"""
import copy

import torch
from transformers import DynamicCache

from .models import ARCHS, generate, model_pair, paged_cache, prompts


class Float16KV(DynamicCache):
    """DynamicCache whose stored K/V are rounded to float16 (computed in the model's dtype)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(key_states.half().to(key_states.dtype), value_states.half().to(value_states.dtype),
                              layer_idx, *args, **kwargs)


def teacher_forced(model, cache, ids, prefill: int) -> torch.Tensor:
    """Logits ``[steps, batch, vocab]`` (float64): the prefill's last position, then one forward per token."""
    outs = []
    with torch.no_grad():
        logits = model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True).logits
        outs.append(logits[:, -1])
        for t in range(prefill, ids.shape[1]):
            outs.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(outs).double()


def float16_storage(arch: str, steps: int = 12) -> dict:
    ref_model, paged_model = model_pair(arch, torch.float32)
    ids, _ = prompts(2, 8 + steps, seed=21)
    exact = teacher_forced(ref_model, DynamicCache(config=ref_model.config), ids, 8)
    plain = teacher_forced(ref_model, Float16KV(config=ref_model.config), ids, 8)
    cache = paged_cache(paged_model, "float16")
    ours = teacher_forced(paged_model, cache, ids, 8)
    return summary(exact, plain, ours, cache, paged_model)


def bfloat16_runs(arch: str, steps: int = 12, storage=None, batch: int = 2, seed: int = 22):
    """Teacher-forced logits of a bfloat16 model: (exact, sdpa + DynamicCache, pagedkv + PagedCache, cache).
    ``storage`` None: the PagedCache default for the model (bfloat16 pages where the kernels read them)."""
    ref32, paged32 = model_pair(arch, torch.float32)
    ref, paged = copy.deepcopy(ref32).to(torch.bfloat16), copy.deepcopy(paged32).to(torch.bfloat16)
    exact_model = copy.deepcopy(ref).to(torch.float64)             # the bfloat16 weights, computed in float64
    ids, _ = prompts(batch, 8 + steps, seed=seed)
    exact = teacher_forced(exact_model, DynamicCache(config=exact_model.config), ids, 8)
    plain = teacher_forced(ref, DynamicCache(config=ref.config), ids, 8)
    cache = paged_cache(paged, storage)
    ours = teacher_forced(paged, cache, ids, 8)
    return exact, plain, ours, cache, paged


def bfloat16_generate(arch: str, new_tokens: int = 12, batch: int = 3, seed: int = 23):
    """Greedy generate() of a bfloat16 model, twice: DynamicCache + "sdpa" (the reference) and PagedCache +
    "pagedkv" (bfloat16 pages, the default), same weights and prompts. Returns (exact, plain, ours, ref, got,
    cache, model): exact [steps, batch, vocab] the float64 copy of the bfloat16 weights teacher-forced on the
    reference's tokens (its logits at each generated position), plain / ours the two runs' logits (float64)."""
    ref32, paged32 = model_pair(arch, torch.float32)
    ref_model, paged_model = copy.deepcopy(ref32).to(torch.bfloat16), copy.deepcopy(paged32).to(torch.bfloat16)
    exact_model = copy.deepcopy(ref_model).to(torch.float64)
    ids, mask = prompts(batch, 8, seed=seed)
    kw = dict(max_new_tokens=new_tokens, do_sample=False)
    ref = generate(ref_model, ids, mask, **kw)
    cache = paged_cache(paged_model, None)
    got = generate(paged_model, ids, mask, cache=cache, **kw)
    exact = teacher_forced(exact_model, DynamicCache(config=exact_model.config), ref.sequences, 8)[:new_tokens]
    plain = torch.stack(ref.logits).double()
    ours = torch.stack(got.logits).double()
    return exact, plain, ours, ref, got, cache, paged_model


def generate_identity(exact, plain, ours, ref_tokens, our_tokens, prompt: int) -> dict:
    """Token identity of two greedy generate() runs, row by row: at each step where both rows still hold the
    same tokens, the choices must agree wherever the reference's top-2 margin exceeds 8x its own rounding error
    there (max |plain - exact| over the vocabulary, as `token_identity`); a row is compared up to the first
    step where the two choose differently (that step must be a near-tie; the sequences differ after it).
    Counts: compared steps, decided (margin above the rounding), near-ties, flips at near-ties, and the
    mismatches where decided (must be 0)."""
    top2 = plain.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > 8 * (plain - exact).abs().amax(dim=-1)       # [steps, batch]
    counts = dict(compared=0, decided=0, near_ties=0, flips_at_near_ties=0, mismatches_where_decided=0)
    for row in range(plain.shape[1]):
        for step in range(plain.shape[0]):
            counts["compared"] += 1
            counts["decided" if bool(decided[step, row]) else "near_ties"] += 1
            if int(ref_tokens[row, prompt + step]) != int(our_tokens[row, prompt + step]):
                counts["mismatches_where_decided" if bool(decided[step, row]) else "flips_at_near_ties"] += 1
                break
    return counts


def bfloat16_model(arch: str, steps: int = 12) -> dict:
    exact, plain, ours, cache, paged = bfloat16_runs(arch, steps, storage="float32")
    return summary(exact, plain, ours, cache, paged)


def token_identity(exact, plain, ours) -> dict:
    """Greedy choices of the paged run against the reference (``plain``) at every teacher-forced position: where
    the reference's top-2 margin exceeds 8x its own rounding error there (max |plain - exact|; the paged error
    is within 3x of it, so no flip is possible), the choices must be identical. Counts of those positions."""
    top2 = plain.topk(2, dim=-1).values                                   # [steps, batch, 2]
    margin = top2[..., 0] - top2[..., 1]
    rounding = (plain - exact).abs().amax(dim=-1)                         # [steps, batch]
    decided = margin > 8 * rounding
    same = plain.argmax(-1) == ours.argmax(-1)
    return {"positions": int(margin.numel()), "decided": int(decided.sum()),
            "identical_where_decided": int((same & decided).sum()), "identical": int(same.sum()),
            "paged_error": float((ours - exact).abs().max()), "plain_error": float(rounding.max())}


def summary(exact, plain, ours, cache, model) -> dict:
    return {"plain_error": float((plain - exact).abs().max()), "paged_error": float((ours - exact).abs().max()),
            "plain_argmax_agreement": float((plain.argmax(-1) == exact.argmax(-1)).double().mean()),
            "paged_argmax_agreement": float((ours.argmax(-1) == exact.argmax(-1)).double().mean()),
            "paged_vs_plain_argmax_agreement": float((ours.argmax(-1) == plain.argmax(-1)).double().mean()),
            "kernel_calls": cache.stats["kernel_calls"], "forwards": cache.stats["forwards"],
            "layers": model.config.num_hidden_layers}


def main() -> None:
    print("| architecture | path | max logit error: plain / paged | argmax agreement with exact: plain / paged |")
    print("|---|---|---|---|")
    for arch in ARCHS:
        for name, fn in (("float16 storage", float16_storage), ("bfloat16 model", bfloat16_model)):
            r = fn(arch)
            print(f"| {arch} | {name} | {r['plain_error']:.2e} / {r['paged_error']:.2e} | "
                  f"{100 * r['plain_argmax_agreement']:.0f}% / {100 * r['paged_argmax_agreement']:.0f}% |")


if __name__ == "__main__":
    main()
