"""`kvengine make-model DIR`: a small random-weight Llama checkpoint that loads offline with transformers.

    kvengine make-model DIR [--layers 2] [--hidden 128] [--heads 4] [--kv-heads 2] [--vocab 512]
                            [--max-position 2048] [--dtype float32] [--seed 0]

What it writes (``save_pretrained`` of both halves): ``config.json`` + ``model.safetensors`` (a
``LlamaForCausalLM`` built from a ``LlamaConfig``, random weights, NOT a trained model) and a byte-level BPE
tokenizer trained here, in process, with the ``tokenizers`` package on a synthetic corpus (pseudo-words drawn
from a fixed syllable list with ``random.Random(seed)``), wrapped by ``PreTrainedTokenizerFast`` with a
ChatML-style chat template. ``AutoModelForCausalLM.from_pretrained(DIR)`` / ``AutoTokenizer.from_pretrained(DIR)``
load it with no network. Every byte string encodes (the byte-level alphabet is in the vocabulary).

`random_model(...)` builds the same pair in memory: ``kvengine serve`` without ``--model`` serves it.
Needs the ``hf`` extra (torch, transformers; tokenizers comes with transformers).
"""
from __future__ import annotations

import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SYLLABLES = ("ka", "to", "ri", "ne", "so", "la", "mi", "du", "pe", "an", "el", "or", "is", "um", "the", "and",
              "ing", "er", "st", "qu", "ch", "sh", "ow", "ai", "ty", "on", "ex", "re", "de", "co")
DTYPES = ("float32", "float64", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelSpec:
    """The sizes of the random model (a Llama: RMSNorm, RoPE, GQA, SwiGLU)."""
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 0             # 0: 2 x hidden (rounded to a multiple of 8)
    vocab: int = 512                  # the BPE vocabulary asked for (the byte alphabet + specials + merges)
    max_position: int = 2048
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "kv_heads", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden: expected a multiple of heads ({self.heads}), got {self.hidden}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: expected a divisor of heads ({self.heads}), got {self.kv_heads}")
        if self.vocab < 260 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab: expected >= {260 + len(SPECIAL_TOKENS)} (the byte alphabet, the special "
                             f"tokens and a few merges), got {self.vocab}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")


def synthetic_corpus(seed: int, sentences: int = 2000) -> list[str]:
    """Deterministic pseudo-text for the tokenizer trainer (no data files, no network)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(400)]
    lines = []
    for _ in range(sentences):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        lines.append(sentence.capitalize() + rng.choice((".", ".", "?", "!", ",")))
    return lines


def build_tokenizer(vocab: int = 512, seed: int = 0):
    """A byte-level BPE trained in process, wrapped as a ``PreTrainedTokenizerFast`` with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   chat_template=CHAT_TEMPLATE)


def build_model(spec: ModelSpec, vocab_size: int, eos_token_id: int):
    """A ``LlamaForCausalLM`` with random weights (``torch.manual_seed(spec.seed)``), cast to ``spec.dtype``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                         num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                         intermediate_size=spec.intermediate or (2 * spec.hidden + 7) // 8 * 8,
                         max_position_embeddings=spec.max_position, bos_token_id=eos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype)).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id
    return model


def random_model(spec: ModelSpec | None = None):
    """(model, tokenizer): the random-weight checkpoint, in memory."""
    spec = spec or ModelSpec()
    tokenizer = build_tokenizer(spec.vocab, spec.seed)
    model = build_model(spec, len(tokenizer), tokenizer.eos_token_id)
    return model, tokenizer


def make_model(out_dir, spec: ModelSpec | None = None) -> Path:
    """Write the checkpoint (config, safetensors weights, tokenizer, chat template) to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = random_model(spec)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def describe(spec: ModelSpec) -> str:
    return (f"a random-weight Llama (NOT a trained model: {spec.layers} layers, hidden {spec.hidden}, "
            f"{spec.heads} q / {spec.kv_heads} kv heads, BPE vocab ~{spec.vocab}, {spec.dtype}, seed {spec.seed})")


def add_spec_arguments(parser, defaults: ModelSpec = ModelSpec()) -> None:
    """The model-size flags, shared by ``make-model`` and ``serve`` (for the random default)."""
    for name in ("layers", "hidden", "heads", "kv_heads", "vocab", "max_position", "seed"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))


def spec_from_args(args, dtype: str) -> ModelSpec:
    fields = {k: getattr(args, k) for k in asdict(ModelSpec()) if k not in ("dtype", "intermediate")}
    return ModelSpec(dtype=dtype, **fields)


def main(args) -> int:
    """The ``make-model`` subcommand (argparse namespace from `decode.app.serve_cli`)."""
    try:
        spec = spec_from_args(args, args.dtype)
    except ValueError as exc:
        print(f"kvengine make-model: {exc}", file=sys.stderr)
        return 2
    out = make_model(args.dir, spec)
    print(f"wrote {out}: {describe(spec)}")
    return 0
