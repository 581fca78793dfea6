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

from .models import ARCHS, model_pair, paged_cache, prompts


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
