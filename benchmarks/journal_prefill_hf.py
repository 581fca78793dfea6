"""The journal A/B of `benchmarks.journal_prefill` through transformers: one `PagedCache` prefill of a random
Llama (8 layers, hidden 512, 8 q / 8 kv heads, head_dim 64), one process per run (needs the hf extra):

    python -m benchmarks.journal_prefill_hf new|old PROMPT float32|bfloat16

"old" patches `Journal.save_bytes` back to copying every overwritten byte. Prints the peak RSS growth of the
forward over the process's RSS before it (VmHWM reset through /proc/self/clear_refs; Linux) and its time.
Alternate new / old runs and take medians."""
import gc
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig
import decode.hf
from decode.hf import PagedCache
from kvcache import journal as J
kind, prompt, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if kind == "old":
    def save_bytes(self, view):
        saved = view.copy()
        self.record(lambda: view.__setitem__(Ellipsis, saved))
    J.Journal.save_bytes = save_bytes
torch.manual_seed(0); torch.set_num_threads(2)
cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, head_dim=64, max_position_embeddings=8192, pad_token_id=0)
model = AutoModelForCausalLM.from_config(cfg, attn_implementation="pagedkv", dtype=getattr(torch, dtype)).eval()
ids = torch.randint(1, 512, (1, prompt))
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"): return int(line.split()[1]) * 1024
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"): return int(line.split()[1]) * 1024
with torch.no_grad():                                   # warm-up (compiles, allocator pools)
    c = PagedCache.for_generate(model.config, batch_size=1, max_length=64); model(ids[:, :32], past_key_values=c, use_cache=True)
    del c; gc.collect()
    cache = PagedCache.for_generate(model.config, batch_size=1, max_length=prompt + 1)
    open("/proc/self/clear_refs", "w").write("5")       # reset VmHWM to the current RSS
    base = rss()
    t = time.perf_counter()
    model(ids, past_key_values=cache, use_cache=True)
    dt = time.perf_counter() - t
print(kind, prompt, dtype, cache.pool.config.storage, f"peak_growth_mib={(hwm() - base) / 2**20:.1f}", f"time_s={dt:.3f}")
