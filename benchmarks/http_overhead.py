"""What the HTTP layer costs: the same greedy workload through `Engine.step()` directly and through
`kvengine serve`'s app (in-process uvicorn on 127.0.0.1, httpx2 async client, whole responses and SSE streams),
rounds interleaved so all three see the same machine load; medians and ratios.

    python -m benchmarks.http_overhead [--requests 64] [--prompt 64] [--new 32] [--rounds 3] [--threads 1]

Not collected by pytest (no test_ prefix); needs the serve and hf extras.
"""
import argparse
import asyncio
import json
import random
import statistics
import time

import httpx2
import torch

from decode.app.make_model import ModelSpec, random_model
from decode.serve import Engine, SamplingParams
from decode.serve.http import ServedModel, Server


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def run_engine(engine: Engine, items, new: int) -> float:
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for prompt in items:
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


async def _post_all(url: str, items, new: int, stream: bool) -> None:
    async with httpx2.AsyncClient(base_url=url, timeout=600, limits=httpx2.Limits(max_connections=len(items))) as c:
        async def one(prompt):
            body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": stream}
            if not stream:
                r = await c.post("/v1/completions", json=body)
                assert r.json()["usage"]["completion_tokens"] == new
                return
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        json.loads(line[6:])
        await asyncio.gather(*(one(p) for p in items))


def run_server(server: Server, items, new: int, stream: bool) -> float:
    start = time.perf_counter()
    asyncio.run(_post_all(server.url, items, new, stream))
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = ModelSpec()
    model, tokenizer = random_model(spec)
    direct = Engine(model, tokenizer, max_tokens=65536, max_num_seqs=args.requests)
    model2, tokenizer2 = random_model(spec)
    server = Server(Engine(model2, tokenizer2, max_tokens=65536, max_num_seqs=args.requests),
                    ServedModel(("bench",), True, "benchmark"), port=0, log_level="warning").start()
    times = {"engine": [], "http": [], "http-stream": []}
    try:
        run_engine(direct, prompts(4, args.prompt, len(tokenizer), 999), 2)             # warm-up
        run_server(server, prompts(4, args.prompt, len(tokenizer), 998), 2, False)
        for r in range(args.rounds):
            items = prompts(args.requests, args.prompt, len(tokenizer), r)       # fresh prompts: no prefix hits
            times["engine"].append(run_engine(direct, items, args.new))
            times["http"].append(run_server(server, prompts(args.requests, args.prompt, len(tokenizer), 100 + r),
                                            args.new, False))
            times["http-stream"].append(run_server(server, prompts(args.requests, args.prompt, len(tokenizer),
                                                                   200 + r), args.new, True))
    finally:
        server.stop()
    tokens = args.requests * args.new
    base = statistics.median(times["engine"])
    print(f"{args.requests} requests x ({args.prompt} prompt + {args.new} new) tokens, {spec.layers}-layer hidden-"
          f"{spec.hidden} random Llama, torch threads {args.threads}, {args.rounds} interleaved rounds (medians):")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:12s} {median:7.2f} s  {tokens / median:8.1f} generated tok/s  x{median / base:.2f} of "
              f"engine time  (rounds: {', '.join(f'{v:.2f}' for v in values)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
