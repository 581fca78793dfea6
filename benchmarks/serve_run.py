"""One system serving one workload in this process; prints one JSON object (used by `python -m benchmarks.serve`).

    python -m benchmarks.serve_run --system engine|hf_cb|static|vllm --checkpoint DIR --workload FILE.json
        --kv-budget BYTES [--threads 2] [--block-size 16] [--max-batched-tokens 2048] [--max-seqs 64]

Systems (greedy, ``ignore_eos``, every request runs to its ``max_tokens``):
* engine: `decode.serve.Engine` (continuous batching over the paged pool, ``kv_cache_memory`` = the budget);
* hf_cb:  transformers' continuous batching (``init_continuous_batching`` with attention "sdpa"; its KV blocks
          bounded to the budget: ``num_blocks = budget / (page_size x bytes per token)``);
* static: padded static batching: when idle, every request that has arrived (at most as many as fit the budget
          at the batch's longest prompt + longest output) goes through one left-padded `generate()` with a
          `DynamicCache`; a row's tokens count as delivered at the step that produced them (streaming);
* vllm:   vLLM's V1 engine (`LLM` in this process, prompt token ids, ``kv_cache_memory_bytes`` = the budget,
          ``enforce_eager``), driven step by step through ``llm.llm_engine`` so arrivals and token times are
          observed the same way (must run under the vLLM venv's python).
Requests are added when their arrival time has passed; token delivery times are taken when the system hands the
tokens back. Peak RSS: VmHWM reset after loading and a warm-up request, read at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.generate import peak_rss_bytes, rss_bytes
from benchmarks.hf_generate import Stamps, reset_peak_rss
from benchmarks.serve_workload import figures


def kv_bytes_per_token(config, itemsize: int) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize


class Clock:
    """The run's start: wall time (token times are relative to it) and this process's CPU time (all threads)."""

    last = None

    def __init__(self):
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        Clock.last = self

    def now(self) -> float:
        return time.perf_counter() - self.t0


def drive(workload, add, step, busy, clock: Clock) -> dict:
    """The arrival loop shared by the step-driven systems: ``add(request)``; ``step() -> [(id, new tokens)]``;
    ``busy()`` -> unfinished requests exist. Returns token delivery times per request id."""
    pending = sorted(workload, key=lambda r: r["arrival"])
    times = {r["id"]: [] for r in workload}
    i = 0
    while i < len(pending) or busy():
        now = clock.now()
        while i < len(pending) and pending[i]["arrival"] <= now:
            add(pending[i])
            i += 1
        if not busy():
            time.sleep(max(0.0, pending[i]["arrival"] - clock.now()))
            continue
        for rid, n in step():
            t = clock.now()
            times[rid].extend([t] * n)
    return times


def run_engine(args, workload, warm) -> tuple[dict, dict]:
    from decode.serve import Engine, SamplingParams

    eng = Engine(args.checkpoint, kv_cache_memory=args.kv_budget, block_size=args.block_size,
                 max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_seqs)
    eng.generate([warm], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    reset_peak_rss()
    clock = Clock()

    def add(r):
        eng.add_request(r["prompt"], SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True),
                        request_id=r["id"])

    def step():
        return [(o.request_id, len(o.new_token_ids)) for o in eng.step()]

    outputs = {}
    times = drive(workload, add, step, eng.has_unfinished_requests, clock)
    return times, {"stats": eng.stats(), "kv_cache_dtype": str(eng.kv_cache_dtype), "model_dtype": eng.model_dtype,
                   **outputs}


def run_vllm(args, workload, warm) -> tuple[dict, dict]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")      # keep torch.set_num_threads(--threads)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    max_len = max(len(r["prompt"]) + r["max_tokens"] for r in workload) + 16
    with open(os.path.join(args.checkpoint, "config.json")) as f:            # vLLM's "auto" downcasts float32
        config = json.load(f)                                                 # checkpoints to bfloat16
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    llm = LLM(model=args.checkpoint, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_len,
              kv_cache_memory_bytes=args.kv_budget, block_size=max(32, args.block_size),
              max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_seqs, enforce_eager=True)
    llm.generate([TokensPrompt(prompt_token_ids=warm)], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    engine = llm.llm_engine
    reset_peak_rss()
    clock = Clock()
    seen: dict = {}

    def add(r):
        engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]),
                           SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True))

    def step():
        out = []
        for o in engine.step():
            n = len(o.outputs[0].token_ids)
            out.append((o.request_id, n - seen.get(o.request_id, 0)))
            seen[o.request_id] = n
        return out

    times = drive(workload, add, step, engine.has_unfinished_requests, clock)
    return times, {"vllm": vllm.__version__, "vllm_dtype": dtype, "block_size": max(32, args.block_size), "enforce_eager": True,
                   "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"]}


def load_hf(args, attn="sdpa"):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    return AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype="auto", attn_implementation=attn).eval()


def run_hf_cb(args, workload, warm) -> tuple[dict, dict]:
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = load_hf(args)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    page = args.hf_page_size
    num_blocks = max(1, args.kv_budget // (page * kv_bytes_per_token(model.config, itemsize)))
    gen = GenerationConfig(max_new_tokens=max(r["max_tokens"] for r in workload), do_sample=False,
                           eos_token_id=-1, pad_token_id=0)
    cbc = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=args.max_batched_tokens,
                                   max_requests_per_batch=args.max_seqs)
    with torch.no_grad():
        model.generate_batch([warm], generation_config=GenerationConfig(max_new_tokens=4, do_sample=False,
                                                                        eos_token_id=-1, pad_token_id=0),
                             continuous_batching_config=cbc)
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
        manager.start()
        reset_peak_rss()
        clock = Clock()
        pending = sorted(workload, key=lambda r: r["arrival"])
        results, i = {}, 0
        while len(results) < len(workload):
            while i < len(pending) and pending[i]["arrival"] <= clock.now():
                r = pending[i]
                manager.add_request(r["prompt"], request_id=r["id"], max_new_tokens=r["max_tokens"],
                                    record_timestamps=True)
                i += 1
            res = manager.get_result(timeout=0.01)
            if res is not None and res.is_finished():
                results[res.request_id] = res
            elif res is None and manager.background_thread_status.fatal_error is not None:
                raise RuntimeError(f"continuous batching failed: {manager.background_thread_status.fatal_error}")
        manager.stop(block=True)
    times = {rid: [t - clock.t0 for t in (res.timestamps or [])] for rid, res in results.items()}
    return times, {"hf_page_size": page, "num_blocks": int(num_blocks), "attention": "sdpa"}


def run_static(args, workload, warm) -> tuple[dict, dict]:
    import torch
    from transformers import DynamicCache

    model = load_hf(args)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    per_token = kv_bytes_per_token(model.config, itemsize)

    def generate(batch, stamps=None):
        width = max(len(r["prompt"]) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):                         # left padding
            ids[row, width - len(r["prompt"]):] = torch.tensor(r["prompt"])
            mask[row, width - len(r["prompt"]):] = 1
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config),
                           max_new_tokens=max(r["max_tokens"] for r in batch), do_sample=False, pad_token_id=0,
                           eos_token_id=None, streamer=stamps)

    generate([{"prompt": warm, "max_tokens": 4}])
    reset_peak_rss()
    clock = Clock()
    pending = sorted(workload, key=lambda r: r["arrival"])
    times, i, batches = {}, 0, []
    while i < len(pending):
        if pending[i]["arrival"] > clock.now():
            time.sleep(pending[i]["arrival"] - clock.now())
        batch = []
        while i < len(pending) and pending[i]["arrival"] <= clock.now() and len(batch) < args.max_seqs:
            trial = batch + [pending[i]]
            need = len(trial) * (max(len(r["prompt"]) for r in trial) + max(r["max_tokens"] for r in trial))
            if batch and need * per_token > args.kv_budget:
                break
            batch = trial
            i += 1
        stamps = Stamps()
        generate(batch, stamps)
        steps = [t - clock.t0 for t in stamps.times[1:]]        # the first put is the prompt
        for r in batch:
            times[r["id"]] = steps[:r["max_tokens"]]
        batches.append(len(batch))
    return times, {"batches": batches}


SYSTEMS = {"engine": run_engine, "hf_cb": run_hf_cb, "static": run_static, "vllm": run_vllm}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--workload", required=True, help="a JSON file of requests (benchmarks.serve_workload)")
    p.add_argument("--kv-budget", type=int, required=True, help="KV cache bytes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hf-page-size", type=int, default=256, help="transformers' continuous batching page size")
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--max-seqs", type=int, default=64)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.system == "engine":
        import numba

        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    with open(args.workload) as f:
        workload = json.load(f)
    warm = workload[0]["prompt"][:32]
    rss0 = rss_bytes()
    t0, cpu0 = time.perf_counter(), time.process_time()
    times, extra = SYSTEMS[args.system](args, workload, warm)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    run_cpu = time.process_time() - Clock.last.cpu0          # CPU seconds of the serving phase, every thread
    result = {"system": args.system, "threads": args.threads, "kv_budget": args.kv_budget,
              **figures(workload, times), "peak_rss_bytes": peak_rss_bytes(), "rss_at_start_bytes": rss0,
              "process_wall_s": wall, "process_cpu_s": cpu,
              "run_cpu_s": run_cpu, "output_tokens_per_cpu_s": sum(map(len, times.values())) / max(run_cpu, 1e-9),
              "loadavg": os.getloadavg(), "torch": torch.__version__, **extra}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
