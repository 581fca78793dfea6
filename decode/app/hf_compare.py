"""`kvengine generate`: a tiny random-weight model generating both ways, DynamicCache + "sdpa" (transformers'
default) and PagedCache + "pagedkv" (this engine), same weights and prompts; prints tokens/s, whether the
tokens agree and the largest logit difference.

    kvengine generate [--arch llama|gpt2|mistral|qwen2] [--batch 2] [--prompt 32] [--new-tokens 64]
                      [--model-dtype float32] [--storage model] [--json]
"""
import json
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from decode.hf import PagedCache

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def tiny_config(arch: str, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int):
    """A small config of ``arch`` (no download); eos disabled so every run generates its full length."""
    common = dict(vocab_size=vocab, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=4096,
                          scale_attn_by_inverse_layer_idx=True, **common)
    kw = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv_heads, max_position_embeddings=4096, **common)
    if arch == "mistral":
        return MistralConfig(sliding_window=64, **kw)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=layers // 2, **kw)
    return LlamaConfig(**kw)


def _generate(model, ids, mask, cache, new_tokens):
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                             do_sample=False, return_dict_in_generate=True, output_logits=True)
        return out, time.perf_counter() - start


def compare(arch="llama", layers=4, hidden=128, heads=8, kv_heads=2, vocab=512, batch=2, prompt=32,
            new_tokens=64, model_dtype="float32", storage="float32", page_size=16, seed=0) -> dict:
    """Run both ways (each once to warm up, then timed) and return the figures."""
    torch.manual_seed(seed)
    config = tiny_config(arch, layers, hidden, heads, kv_heads, vocab)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(_DTYPES[model_dtype]).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, vocab, (batch, prompt), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(1, batch):                                   # left padding: rows of different lengths
        mask[row, : min(prompt - 1, 3 * row)] = 0
    ids[mask == 0] = 0
    runs = {}
    for impl in ("sdpa", "pagedkv"):
        model.set_attn_implementation(impl)
        for _ in range(2):                                        # the first run compiles / warms up
            cache = (DynamicCache(config=model.config) if impl == "sdpa" else
                     PagedCache.for_generate(model.config, batch, prompt + new_tokens, page_size=page_size,
                                             dtype=None if storage == "model" else storage))
            out, seconds = _generate(model, ids, mask, cache, new_tokens)
        runs[impl] = (out, seconds, cache)
    (ref, ref_s, _), (got, got_s, cache) = runs["sdpa"], runs["pagedkv"]
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(ref.logits, got.logits))
    same = (ref.sequences == got.sequences).all(dim=1)
    return {"arch": arch, "layers": layers, "batch": batch, "prompt": prompt, "new_tokens": new_tokens,
            "model_dtype": model_dtype, "storage": cache.pool.config.storage, "sdpa_seconds": ref_s,
            "pagedkv_seconds": got_s,
            "divergences": divergences(ref, got, prompt, coarser(model_dtype, cache.pool.config.storage)),
            "sdpa_tokens_per_s": batch * new_tokens / ref_s, "pagedkv_tokens_per_s": batch * new_tokens / got_s,
            "rows_with_identical_tokens": int(same.sum()), "token_agreement": float(
                (ref.sequences[:, prompt:] == got.sequences[:, prompt:]).double().mean()),
            "max_logit_difference": diff, "kernel_calls": cache.stats["kernel_calls"],
            "forwards": cache.stats["forwards"], "pool_pages_used": cache.pool.config.num_pages
            - cache.pool.num_free_pages}


# unit roundoff of each dtype (int8 pages: their float16 scales' precision is not the error; ~1e-2, docs/int8.md)
_EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "int8": 2.0 ** -7, "float32": 2.0 ** -24, "float64": 2.0 ** -53}


def coarser(model_dtype: str, storage: str) -> str:
    return max(model_dtype, storage, key=lambda name: _EPS.get(name, 0.0))


def divergences(ref, got, prompt: int, dtype: str = "bfloat16") -> list[dict]:
    """Where each row's tokens first differ (the runs saw the same tokens until then): the reference's top-2
    logit margin there against the largest logit difference the runs show up to it. By rounding when the margin
    is within that difference and the difference within ``dtype``'s rounding (8 unit roundoffs of the largest
    logit): a near-tie decided by rounding, not an error."""
    found = []
    for row in range(ref.sequences.shape[0]):
        differ = (ref.sequences[row, prompt:] != got.sequences[row, prompt:]).nonzero()
        if not len(differ):
            continue
        step = int(differ[0])
        top2 = ref.logits[step][row].double().topk(2).values
        noise = max(float((ref.logits[s][row].double() - got.logits[s][row].double()).abs().max())
                    for s in range(step + 1))
        margin = float(top2[0] - top2[1])
        bound = 8 * _EPS.get(dtype, 0.0) * float(ref.logits[step][row].double().abs().max())
        found.append({"row": row, "step": step, "margin": margin, "logit_difference": noise, "rounding": bound,
                      "by_rounding": margin <= noise <= bound})
    return found


def format_report(r: dict) -> str:
    speed = r["pagedkv_tokens_per_s"] / r["sdpa_tokens_per_s"]
    notes = [f"  row {d['row']} diverges at new token {d['step']}: the reference's top-2 margin {d['margin']:.3g} "
             + (f"<= the {d['logit_difference']:.3g} logit difference the runs already show ({r['model_dtype']} "
                f"rounding: at most {d['rounding']:.3g}): a near-tie decided by rounding, not an error"
                if d["by_rounding"] else f"vs the {d['logit_difference']:.3g} logit difference the runs show "
                f"(rounding: at most {d['rounding']:.3g}): beyond rounding")
             for d in r["divergences"]]
    return "\n".join([
        f"{r['arch']}: {r['layers']} layers, batch {r['batch']} (left-padded), prompt {r['prompt']}, "
        f"{r['new_tokens']} new tokens, {r['model_dtype']} model, {r['storage']} storage",
        f"  DynamicCache + sdpa     : {r['sdpa_tokens_per_s']:8.1f} tokens/s ({r['sdpa_seconds']:.3f} s)",
        f"  PagedCache   + pagedkv  : {r['pagedkv_tokens_per_s']:8.1f} tokens/s ({r['pagedkv_seconds']:.3f} s), "
        f"{speed:.2f}x; {r['kernel_calls']} kernel calls over {r['forwards']} forwards",
        f"  identical tokens in {r['rows_with_identical_tokens']}/{r['batch']} rows (agreement "
        f"{100 * r['token_agreement']:.1f}%), max |logit difference| {r['max_logit_difference']:.3g}"] + notes)


def main(args) -> int:
    result = compare(arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
                     kv_heads=args.kv_heads, batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens,
                     model_dtype=args.model_dtype, storage=args.storage, page_size=args.page_size, seed=args.seed)
    print(json.dumps(result) if args.json else format_report(result))
    if result["storage"] == args.model_dtype != "bfloat16":   # equal precision: the tokens must be the same
        # (a bfloat16 model's sdpa computes in bfloat16, the kernels in float32 over bfloat16 pages)
        return 1 if result["rows_with_identical_tokens"] != args.batch else 0
    return 1 if any(not d["by_rounding"] for d in result["divergences"]) and args.storage != "int8" else 0


__all__ = ["compare", "format_report", "main", "tiny_config"]
