"""`kvengine make-model DIR` writes a checkpoint that transformers loads offline: config + safetensors weights,
a BPE tokenizer trained in process (every byte string round-trips), a chat template."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_make_model_writes_a_checkpoint_transformers_loads_offline(tmp_path):
    out = tmp_path / "ckpt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "decode.app.cli", "make-model", str(out), "--layers", "3",
                             "--hidden", "48", "--heads", "6", "--kv-heads", "2", "--vocab", "300",
                             "--dtype", "float64"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "random-weight" in result.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 3
    assert config["num_key_value_heads"] == 2
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.dtype == torch.float64 and model.config.vocab_size == len(tok) == 300
    text = "Kato rine — naïve café 🎉 <b>\n\ttabs"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(text)])).logits
    assert logits.shape[-1] == 300 and torch.isfinite(logits).all()


def test_make_model_refuses_bad_sizes_by_name(tmp_path):
    result = subprocess.run([sys.executable, "-m", "decode.app.cli", "make-model", str(tmp_path / "x"),
                             "--hidden", "50", "--heads", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "hidden: expected a multiple of heads" in result.stderr
    assert not (tmp_path / "x").exists()
