"""Helpers for tests of the engine (and of what is built on it): tiny random Llama models, the reference run
(``model.generate`` with DynamicCache + "sdpa", one request alone), and a byte-level toy tokenizer.
"""
import copy

import torch


def tiny_llama(dtype=torch.float64, *, layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, max_position=1024,
               seed=0):
    """``(reference, served)``: a random-weight Llama with "sdpa" and a deep copy of it for the engine (the
    same weights), both in eval mode and ``dtype``; no eos token (generations run to max_tokens)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_position,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").to(dtype).eval()
    return reference, copy.deepcopy(reference)


def reference_greedy(model, prompt: list, max_new_tokens: int) -> tuple[list, list]:
    """``(tokens, margins)``: ``model.generate`` alone (DynamicCache, greedy) and, per generated token, the
    reference's top-1 minus top-2 float32 logit (how close that choice was to a tie)."""
    from transformers import DynamicCache

    with torch.no_grad():
        ids = torch.tensor([prompt])                    # an explicit mask: a token equal to pad_token_id is no pad
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             past_key_values=DynamicCache(config=model.config), return_dict_in_generate=True,
                             output_logits=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = []
    for step in out.logits:
        top = torch.topk(step[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return tokens, margins


def random_prompts(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list:
    """``count`` prompts of random token ids with lengths in [low, high)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


class ByteTokenizer:
    """A toy tokenizer: token id t < 256 is the byte t, so multi-byte UTF-8 characters span several tokens
    (decoding a partial one gives "\\ufffd", as with real byte-level BPE); ids >= 256 decode to nothing
    (special tokens)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list:
        return list(text.encode("utf-8"))


class AsciiTokenizer:
    """A toy tokenizer: token id t is the printable ASCII character ``chr(32 + t % 95)`` (one character per
    token, so expected texts are easy to derive from token ids)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(32 + t % 95) for t in ids)

    def encode(self, text: str) -> list:
        return [ord(c) - 32 for c in text]
