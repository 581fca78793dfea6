"""Token identity through the server: greedy outputs of 32 concurrent requests of mixed lengths equal each
request generated alone by the model with DynamicCache + "sdpa" (float64 model, so batching cannot flip a
near-tie); the same under pool pressure (a budget for ~4 requests, 32 submitted: all complete, identical,
with preemptions > 0 in /metrics); a float32 model: identical up to the reference's first top-2 logit margin
<= 1e-4 (the count of requests with such a near-tie is printed)."""
import asyncio
import json
import random

import httpx2
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from .harness import completion_body, engine_stats, metric

REQUESTS = 32


NEAR_TIE = 1e-4                 # float32: a top-2 logit margin at or below this may flip under batching


def greedy_alone(model_dir, dtype):
    """``greedy(prompt, n) -> (tokens, margins)``: the checkpoint alone (sdpa, DynamicCache), one request at a
    time, with the top-1 minus top-2 logit of every step."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=dtype,
                                                 local_files_only=True).eval()
    memo = {}

    @torch.no_grad()
    def greedy(prompt, n):
        key = (tuple(prompt), n)
        if key not in memo:
            cache, ids, out, margins = DynamicCache(config=model.config), torch.tensor([prompt]), [], []
            for _ in range(n):
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
                top = torch.topk(logits, 2).values
                out.append(int(logits.argmax()))
                margins.append(float(top[0] - top[1]))
                ids = torch.tensor([[out[-1]]])
            memo[key] = out, margins
        return memo[key]
    return greedy


@pytest.fixture(scope="module")
def reference(model_dir):
    """``greedy(prompt, n)``: the float64 checkpoint alone."""
    greedy = greedy_alone(model_dir, torch.float64)
    return lambda prompt, n: greedy(prompt, n)[0]


def workload(seed: int, prompt_range, new_range, shared_prefix: int = 0, count: int = REQUESTS):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 390) for _ in range(shared_prefix)]
    return [(prefix + [rng.randrange(3, 390) for _ in range(rng.randint(*prompt_range))], rng.randint(*new_range))
            for _ in range(count)]


async def post_all(url: str, items, stream: bool) -> list[list[int]]:
    limits = httpx2.Limits(max_connections=REQUESTS)
    async with httpx2.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async def one(i, prompt, n):
            body = completion_body(prompt, n)
            if i % 2 and stream:                  # half of them streamed
                tokens = []
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            tokens += json.loads(line[6:])["choices"][0]["token_ids"]
                return tokens
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        return await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(items)))


def test_concurrent_greedy_through_the_server_equals_the_model_alone(start_server, reference):
    server = start_server(max_num_batched_tokens=256)       # chunked prefills mixed with decodes
    half = REQUESTS // 2                                   # half of them share a 48-token prefix
    items = workload(0, (1, 120), (1, 24), count=half) + workload(1, (1, 40), (1, 24), shared_prefix=48, count=half)
    got = asyncio.run(post_all(server.url, items, stream=True))
    mismatched = [i for i, ((p, n), tokens) in enumerate(zip(items, got)) if tokens != reference(p, n)]
    assert not mismatched, f"{len(mismatched)} of {len(items)} differ from the model alone: {mismatched}"
    assert engine_stats(server)["prefix_cache_hit_tokens_total"] > 0   # the shared 48-token prefix was reused


def test_pool_pressure_all_complete_identically_with_preemptions(start_server, reference):
    # 20 pages of 16 = 320 tokens; each request needs up to 72 + 24 = 96 tokens (6 pages): ~4 at a time
    server = start_server(max_tokens=320, block_size=16, max_num_seqs=32)
    items = workload(2, (40, 72), (16, 24))
    got = asyncio.run(post_all(server.url, items, stream=True))
    mismatched = [i for i, ((p, n), tokens) in enumerate(zip(items, got)) if tokens != reference(p, n)]
    assert not mismatched, f"{len(mismatched)} of {len(items)} differ under pool pressure: {mismatched}"
    preemptions = metric(server, "kvengine_preemptions_total")
    assert preemptions > 0, "the budget was meant to force preemptions"
    assert metric(server, "kvengine_requests_total{finish_reason=\"length\"}") == REQUESTS
    print(f"pool pressure: {REQUESTS} requests in 20 pages, {preemptions:.0f} preemptions")


def test_float32_identical_wherever_the_reference_has_no_near_tie(tmp_path):
    from decode.app.make_model import ModelSpec, make_model

    from .harness import check_pool_idle, start

    model_dir = make_model(tmp_path / "tiny-f32", ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, vocab=400,
                                                             max_position=512, dtype="float32", seed=7))
    greedy = greedy_alone(model_dir, torch.float32)
    server = start(model_dir)
    try:
        items = workload(3, (1, 120), (1, 24))
        got = asyncio.run(post_all(server.url, items, stream=True))
        check_pool_idle(server)
    finally:
        server.stop()
    near_ties = compared = 0
    for (prompt, n), tokens in zip(items, got):
        expected, margins = greedy(prompt, n)
        tie = next((i for i, m in enumerate(margins) if m <= NEAR_TIE), None)
        upto = n if tie is None else tie          # every token before the first near-tie must be identical
        assert tokens[:upto] == expected[:upto], (prompt, tokens, expected, margins)
        assert len(tokens) == n
        near_ties += tie is not None
        compared += upto
    print(f"float32: {len(items)} requests, {compared} tokens compared, {near_ties} requests with a near-tie "
          f"(top-2 margin <= {NEAR_TIE:g})")
