"""decode.serve.Engine against the reference: each request generated alone by ``model.generate`` with
DynamicCache + "sdpa" on the same weights. Every test ends with the pool idle: pages in use == the prefix
cache's held pages, and the engine's invariant check passes."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from decode.serve import Engine, RequestRejected, SamplingParams  # noqa: E402
from decode.serve.fixtures import random_prompts, reference_greedy, tiny_llama  # noqa: E402

VOCAB = 256
GREEDY = SamplingParams(max_tokens=12, temperature=0)
_MODELS, _REFERENCE = {}, {}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models: torch's intra-op threads only add barrier waits (5-50x slower matmuls on the shared 2-core
    machine, measured); restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def models(dtype=torch.float64):
    """(reference, served) tiny Llama of ``dtype``, built once per module."""
    if dtype not in _MODELS:
        _MODELS[dtype] = tiny_llama(dtype, layers=2, hidden=64, heads=4, kv_heads=2, vocab=VOCAB, seed=3)
    return _MODELS[dtype]


def reference(dtype, prompt, max_new_tokens):
    key = (dtype, tuple(prompt), max_new_tokens)
    if key not in _REFERENCE:
        _REFERENCE[key] = reference_greedy(models(dtype)[0], prompt, max_new_tokens)
    return _REFERENCE[key]


def engine(dtype=torch.float64, **kw):
    kw.setdefault("max_tokens", 4096)
    kw.setdefault("block_size", 8)
    return Engine(models(dtype)[1], **kw)


def record_batches(eng) -> list:
    """Wrap the runner's forward: the list it returns fills with each step's token counts."""
    seen, forward = [], eng.runner.forward

    def recording(batch):
        seen.append(list(batch.counts))
        return forward(batch)
    eng.runner.forward = recording
    return seen


def drain(eng) -> dict:
    """Step until idle; the final output of every request; then the idle-pool checks."""
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    for out in eng.step():                              # outputs of aborts made after the last step
        final[out.request_id] = out
    check_idle(eng)
    return final


def check_idle(eng) -> None:
    eng.check_invariants()
    stats = eng.stats()
    assert stats["requests_running"] == stats["requests_waiting"] == 0, stats
    assert stats["pages_in_use"] == stats["prefix_cached_pages"], stats


def mixed_workload(count=32, seed=0):
    prompts = random_prompts(count, 1, 90, VOCAB, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(1, 17, (count,), generator=g).tolist()
    return prompts, lengths


def test_greedy_32_concurrent_requests_equal_generate_alone_float64():
    prompts, lengths = mixed_workload()
    eng = engine(max_num_batched_tokens=64, max_num_seqs=32)
    batches = record_batches(eng)
    ids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(prompts, lengths)]
    final = drain(eng)
    for rid, prompt, n in zip(ids, prompts, lengths):
        assert final[rid].output_token_ids == reference(torch.float64, prompt, n)[0], rid
        assert final[rid].finish_reason == "length" and final[rid].num_prompt_tokens == len(prompt)
    assert max(sum(c) for c in batches) <= 64                    # the token budget
    mixed = [c for c in batches if 1 in c and max(c) > 1]
    assert mixed, "no step packed decodes together with prefill chunks"
    chunked = sum(p > 64 for p in map(len, prompts))
    assert chunked and len(batches) < sum(len(p) for p in prompts) // 8


def test_greedy_float32_identical_except_at_near_ties():
    prompts, lengths = mixed_workload(seed=5)
    eng = engine(torch.float32, max_num_batched_tokens=96, max_num_seqs=32)
    ids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(prompts, lengths)]
    final = drain(eng)
    near_ties = compared = reference_ties = 0
    for rid, prompt, n in zip(ids, prompts, lengths):
        expected, margins = reference(torch.float32, prompt, n)
        got = final[rid].output_token_ids
        for j, (a, b) in enumerate(zip(got, expected)):
            compared += 1
            reference_ties += margins[j] <= 1e-4
            if a != b:
                assert margins[j] <= 1e-4, f"{rid}: token {j} differs at a top-2 margin of {margins[j]}"
                near_ties += 1
                break                                            # the continuations part ways from here
        else:
            assert len(got) == len(expected)
    print(f"float32: {compared} tokens compared, {reference_ties} of them near-ties in the reference (top-2 margin "
          f"<= 1e-4), {near_ties} divergences (each at such a near-tie)")
    assert compared > 200


@pytest.mark.parametrize("prefix_caching, budget, max_num_seqs", [(True, 128, 64), (False, 128, 64), (True, 20, 16)])
def test_pool_pressure_all_complete_with_the_same_tokens(prefix_caching, budget, max_num_seqs):
    prompts = random_prompts(32, 20, 41, VOCAB, seed=9)
    # each request holds at most 40 + 16 tokens = 7 pages of 8: a pool of 28 pages holds ~4 of them; a budget
    # of 20 tokens chunks every prefill, so requests are also preempted in the middle of their prompts
    eng = engine(max_tokens=28 * 8, enable_prefix_caching=prefix_caching, max_num_batched_tokens=budget,
                 max_num_seqs=max_num_seqs)
    params = SamplingParams(max_tokens=16, temperature=0)
    ids = [eng.add_request(p, params) for p in prompts]
    peak = 0
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        eng.check_invariants()
        peak = max(peak, eng.stats()["pages_in_use"] - eng.stats()["prefix_cached_pages"])
    check_idle(eng)
    stats = eng.stats()
    print(f"prefix_caching={prefix_caching} budget={budget}: {stats['preemptions_total']} preemptions, "
          f"{stats['recomputed_tokens_total']} tokens recomputed, {stats['prompt_tokens_total']} prompt + "
          f"{stats['generation_tokens_total']} generated tokens")
    assert stats["preemptions_total"] > 0 and stats["recomputed_tokens_total"] > 0
    assert peak <= 28
    for rid, prompt in zip(ids, prompts):
        assert final[rid].output_token_ids == reference(torch.float64, prompt, 16)[0], rid


def test_abort_frees_pages_at_once():
    eng = engine(max_num_seqs=2)
    prompts = random_prompts(5, 10, 30, VOCAB, seed=11)
    ids = [eng.add_request(p, SamplingParams(max_tokens=30, temperature=0)) for p in prompts]
    eng.step()
    eng.step()
    running = [r.request_id for r in eng.scheduler.running]
    assert len(running) == 2 and eng.stats()["requests_waiting"] == 3
    before = eng.stats()
    assert eng.abort(running[0]) and eng.abort(ids[-1])
    after = eng.stats()
    assert after["requests_running"] == 1 and after["requests_waiting"] == 2
    held = sum(1 for _ in eng.pool.cache.sequences)
    assert held == 1                                            # the aborted request's sequence is gone
    assert after["pages_in_use"] - after["prefix_cached_pages"] < before["pages_in_use"] - before["prefix_cached_pages"]
    assert not eng.abort(running[0]) and not eng.abort("no-such-request")
    outs = {o.request_id: o for o in eng.step()}
    assert outs[running[0]].finish_reason == "abort" and outs[ids[-1]].finish_reason == "abort"
    assert outs[running[0]].finished
    eng.check_invariants()
    final = drain(eng)
    for rid, prompt in zip(ids, prompts):
        if rid not in (running[0], ids[-1]):
            assert final[rid].output_token_ids == reference(torch.float64, prompt, 30)[0]


def test_shared_system_prompt_is_computed_once():
    system = random_prompts(1, 40, 41, VOCAB, seed=21)[0]               # 5 full pages of 8
    users = random_prompts(7, 3, 12, VOCAB, seed=22)
    eng = engine()
    batches = record_batches(eng)
    first = eng.add_request(system + [7, 8, 9], GREEDY)
    eng.step()                                                          # its prefill (one chunk): pages registered
    ids = [eng.add_request(system + u, GREEDY) for u in users]
    final = drain(eng)
    assert final[first].num_cached_tokens == 0
    for rid, user in zip(ids, users):
        assert final[rid].num_cached_tokens == 40
        assert final[rid].output_token_ids == reference(torch.float64, system + user, 12)[0]
    assert final[first].output_token_ids == reference(torch.float64, system + [7, 8, 9], 12)[0]
    stats = eng.stats()
    assert stats["prefix_cache_hit_tokens_total"] == 7 * 40
    computed = sum(sum(c) for c in batches)
    decodes = 8 * (12 - 1)
    assert computed == len(system) + 3 + sum(len(u) for u in users) + decodes


def test_identical_prompts_share_pages_copy_on_write():
    prompt = random_prompts(1, 35, 36, VOCAB, seed=23)[0]              # 4 full pages + 3 tokens
    eng = engine()
    a = eng.add_request(prompt, GREEDY)
    eng.step()
    b = eng.add_request(prompt, GREEDY)
    eng.step()
    seqs = [r.decoder.seq for r in eng.scheduler.running]
    tables = [eng.pool.cache.pool.page_table(s)[:4].tolist() for s in seqs]
    assert tables[0] == tables[1]                                       # the full prompt pages are shared
    assert all(eng.pool.cache.pool.allocator.ref_count(p) == 2 for p in tables[0])
    final = drain(eng)
    assert final[a].output_token_ids == final[b].output_token_ids == reference(torch.float64, prompt, 12)[0]


def test_seeded_sampling_does_not_depend_on_the_batch():
    prompt = random_prompts(1, 20, 21, VOCAB, seed=31)[0]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    alone = engine()
    rid = alone.add_request(prompt, params)
    solo = drain(alone)[rid].output_token_ids
    crowd = engine(max_num_batched_tokens=32, max_num_seqs=16)
    others = random_prompts(6, 5, 50, VOCAB, seed=32)
    for i, p in enumerate(others[:3]):
        crowd.add_request(p, SamplingParams(max_tokens=10, temperature=1.0, seed=i))
    crowd.add_request(others[3], SamplingParams(max_tokens=10, temperature=1.0))          # the shared generator
    rid = crowd.add_request(prompt, params)
    for p in others[4:]:
        crowd.add_request(p, GREEDY)
    assert drain(crowd)[rid].output_token_ids == solo
    other_seed = engine()
    rid = other_seed.add_request(prompt, SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.95,
                                                        seed=99))
    assert drain(other_seed)[rid].output_token_ids != solo


def test_rejected_requests_leave_the_pool_byte_identical():
    eng = engine(max_model_len=64)
    prompts = random_prompts(3, 10, 30, VOCAB, seed=41)
    for p in prompts:
        eng.add_request(p, GREEDY, request_id=f"r{len(p)}-{p[0]}")
    eng.step()
    eng.step()
    fingerprint, stats = eng.pool.cache.fingerprint(), eng.stats()
    taken = next(iter(r.request_id for r in eng.scheduler.running))
    bad = [
        (lambda: eng.add_request(list(range(64)), GREEDY), "prompt_token_ids", "at most 63"),
        (lambda: eng.add_request([], GREEDY), "prompt_token_ids", "at least one"),
        (lambda: eng.add_request([1, VOCAB], GREEDY), "prompt_token_ids", f"[0, {VOCAB})"),
        (lambda: eng.add_request([1, -1], GREEDY), "prompt_token_ids", f"[0, {VOCAB})"),
        (lambda: eng.add_request("text", GREEDY), "prompt_token_ids", "list of token ids"),
        (lambda: eng.add_request([1, 2], {"max_tokens": 3}), "params", "SamplingParams"),
        (lambda: eng.add_request([1, 2], GREEDY, request_id=taken), "request_id", "not in use"),
        (lambda: eng.add_request([1, 2], SamplingParams(stop=["x"])), "stop", "tokenizer"),
    ]
    for call, param, words in bad:
        with pytest.raises(RequestRejected) as info:
            call()
        assert info.value.param == param and words in str(info.value), str(info.value)
        assert isinstance(info.value, ValueError)
        assert eng.pool.cache.fingerprint() == fingerprint and eng.stats() == stats
    drain(eng)


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"seed": -1}, "seed"), ({"seed": "7"}, "seed"), ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"stop": [""]}, "stop"), ({"stop": 5}, "stop"), ({"ignore_eos": 1}, "ignore_eos"),
])
def test_sampling_params_name_the_bad_field(kwargs, param):
    with pytest.raises(RequestRejected) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and str(info.value).startswith(f"{param}: expected")


def test_stop_token_ids_eos_and_max_model_len():
    prompt = random_prompts(1, 12, 13, VOCAB, seed=51)[0]
    expected = reference(torch.float64, prompt, 20)[0]
    k = next(j for j in range(3, 20) if expected[j] not in expected[:j])
    eng = engine(max_model_len=len(prompt) + 8)
    stop = eng.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[expected[k]]))
    capped = eng.add_request(prompt, SamplingParams(max_tokens=20, temperature=0))
    final = drain(eng)
    assert final[stop].output_token_ids == expected[:k + 1]
    assert (final[stop].finish_reason, final[stop].stop_reason) == ("stop", expected[k])
    assert final[capped].output_token_ids == expected[:8] and final[capped].finish_reason == "length"
    eng = engine()
    eng.eos_token_ids = frozenset({expected[k]})
    eos = eng.add_request(prompt, SamplingParams(max_tokens=20, temperature=0))
    ignored = eng.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    final = drain(eng)
    assert final[eos].output_token_ids == expected[:k + 1]
    assert (final[eos].finish_reason, final[eos].stop_reason) == ("stop", None)
    assert final[ignored].output_token_ids == expected and final[ignored].finish_reason == "length"


def test_stream_yields_every_token_and_keeps_other_outputs():
    prompt = random_prompts(1, 15, 16, VOCAB, seed=61)[0]
    eng = engine()
    other = eng.add_request(random_prompts(1, 9, 10, VOCAB, seed=62)[0], SamplingParams(max_tokens=3, temperature=0))
    outs = list(eng.stream(prompt, GREEDY))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].output_token_ids
    assert outs[-1].output_token_ids == reference(torch.float64, prompt, 12)[0]
    assert outs[-1].first_token_time >= outs[-1].arrival_time
    kept = [o for o in eng.step() if o.request_id == other]
    assert kept and kept[-1].finished and len(kept[-1].output_token_ids) == 3
    check_idle(eng)


def test_closing_a_stream_aborts_its_request():
    eng = engine()
    stream = eng.stream(random_prompts(1, 15, 16, VOCAB, seed=63)[0], SamplingParams(max_tokens=50, temperature=0))
    next(stream)
    assert eng.stats()["requests_running"] == 1
    stream.close()
    assert eng.stats()["requests_running"] == 0
    assert not eng.step()                              # its abort output was meant for the closed stream only
    check_idle(eng)


def test_max_num_seqs_and_token_budget_bound_every_step():
    prompts, lengths = mixed_workload(count=12, seed=71)
    eng = engine(max_num_seqs=3, max_num_batched_tokens=16)
    batches = record_batches(eng)
    ids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(prompts, lengths)]
    final = drain(eng)
    assert max(map(len, batches)) == 3 and max(map(sum, batches)) <= 16
    for rid, p, n in zip(ids, prompts, lengths):
        assert final[rid].output_token_ids == reference(torch.float64, p, n)[0]


def test_engine_from_a_checkpoint_directory(tmp_path):
    reference_model = models()[0]
    reference_model.save_pretrained(tmp_path)
    eng = Engine(str(tmp_path), max_tokens=1024, block_size=8)
    assert eng.model_name == str(tmp_path) and eng.model_dtype == "float64" and eng.tokenizer is None
    assert eng.kv_cache_dtype == "float64" and eng.max_model_len == 1024
    prompt = random_prompts(1, 17, 18, VOCAB, seed=81)[0]
    out = eng.generate([prompt], GREEDY)[0]
    assert out.output_token_ids == reference(torch.float64, prompt, 12)[0]
    check_idle(eng)
    with pytest.raises(ValueError, match="max_model_len: expected at most 1024"):
        Engine(str(tmp_path), max_tokens=1024, block_size=8, max_model_len=2048)


def test_a_forward_that_fails_changes_nothing_and_the_engine_goes_on():
    prompts = random_prompts(4, 5, 40, VOCAB, seed=91)
    eng = engine(max_num_batched_tokens=32, max_num_seqs=8)
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    while eng.stats()["requests_waiting"] or any(r.num_to_compute > 1 for r in eng.scheduler.running):
        eng.step()                                              # until every request decodes: the next step
    assert eng.stats()["requests_running"] == 4                 # admits and preempts nothing
    fingerprint, stats = eng.pool.cache.fingerprint(), eng.stats()
    computed = [r.num_computed for r in eng.scheduler.running]
    mlp = eng.model.model.layers[1].mlp
    forward = mlp.forward

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure in layer 1's MLP")
    mlp.forward = broken
    extra = eng.add_request(prompts[0], GREEDY)
    assert eng.abort(extra)                                     # its "abort" output waits for the next step
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    mlp.forward = forward
    assert eng.pool.cache.fingerprint() == fingerprint and eng.stats() == stats
    assert [r.num_computed for r in eng.scheduler.running] == computed
    eng.check_invariants()
    final = drain(eng)
    assert final[extra].finish_reason == "abort"                 # not lost with the failed step
    for rid, p in zip(ids, prompts):
        assert final[rid].output_token_ids == reference(torch.float64, p, 12)[0]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=5),
                                    SamplingParams(max_tokens=12, temperature=0.7, top_p=1e-9)])
def test_sampling_down_to_one_candidate_is_greedy(params):
    prompt = random_prompts(1, 25, 26, VOCAB, seed=92)[0]
    eng = engine()
    rid = eng.add_request(prompt, params)
    assert drain(eng)[rid].output_token_ids == reference(torch.float64, prompt, 12)[0]


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "int8", "float32"])
def test_other_storage_dtypes_run_to_completion(kv_cache_dtype):
    prompts, lengths = mixed_workload(count=8, seed=93)
    eng = engine(kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=48, max_num_seqs=16)
    assert eng.kv_cache_dtype == kv_cache_dtype and eng.model_dtype == "float64"
    ids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(prompts, lengths)]
    final = drain(eng)
    assert [len(final[rid].output_token_ids) for rid in ids] == lengths
    firsts = [final[rid].output_token_ids[0] == reference(torch.float64, p, n)[0][0]
              for rid, p, n in zip(ids, prompts, lengths)]
    assert sum(firsts) >= 6                    # rounding of the stored K/V may flip a near-tie, not most tokens


def test_a_bfloat16_model_stores_float32_by_default():
    reference_model = models()[0]
    model = tiny_llama(torch.float64, layers=2, hidden=64, heads=4, kv_heads=2, vocab=VOCAB, seed=3)[1]
    eng = Engine(model.to(torch.bfloat16), max_tokens=1024, block_size=8)
    assert (eng.model_dtype, eng.kv_cache_dtype) == ("bfloat16", "float32")
    prompt = random_prompts(1, 20, 21, VOCAB, seed=94)[0]
    out = eng.generate([prompt], GREEDY)[0]
    assert len(out.output_token_ids) == 12 and reference_model is not model
    check_idle(eng)


def test_what_the_engine_cannot_compute_is_refused_by_name():
    from transformers import AutoModelForCausalLM, MistralConfig

    from decode.hf import UnsupportedFeatureError

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=7, max_position_embeddings=256)
    with pytest.raises(UnsupportedFeatureError, match="sliding-window"):
        Engine(AutoModelForCausalLM.from_config(cfg), max_tokens=256)
    eng = engine()                                  # its model's attention is "kvengine" now: only inside a step
    with pytest.raises(TypeError, match="Engine.step"), torch.no_grad():
        eng.model(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="kv_cache_memory: expected bytes like"):
        Engine(models()[1], kv_cache_memory="lots")
    with pytest.raises(ValueError, match="max_num_batched_tokens: expected >= max_num_seqs"):
        Engine(models()[1], max_tokens=256, max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="kv_cache_dtype: expected"):
        Engine(models()[1], max_tokens=256, kv_cache_dtype="bfloat16")
    check_idle(eng)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_arrivals_aborts_and_pressure_keep_the_pool_exact(seed):
    """Requests arrive between steps, some are aborted at random moments, the pool is small: after every step
    the invariants hold, and every request that was not aborted ends with the reference's tokens."""
    import random

    rng = random.Random(seed)
    prompts = random_prompts(20, 1, 50, VOCAB, seed=100 + seed)
    lengths = [rng.randint(1, 12) for _ in prompts]
    eng = engine(max_tokens=24 * 8, max_num_batched_tokens=rng.choice([8, 24, 64]), max_num_seqs=8)
    pending, live, aborted, final = list(zip(prompts, lengths)), {}, set(), {}
    while pending or eng.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                prompt, n = pending.pop()
                live[eng.add_request(prompt, SamplingParams(max_tokens=n, temperature=0))] = (prompt, n)
        if live and rng.random() < 0.1:
            rid = rng.choice(sorted(live))
            if eng.abort(rid):
                aborted.add(rid)
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
                live.pop(out.request_id, None)
        eng.check_invariants()
    check_idle(eng)
    assert len(final) == len(prompts)                           # none lost: every request ended
    for rid, out in final.items():
        if rid in aborted:
            assert out.finish_reason == "abort"
        else:
            prompt, n = out.prompt_token_ids, len(out.output_token_ids)
            assert out.output_token_ids == reference(torch.float64, prompt, n)[0] and out.finish_reason == "length"


def _arch_configs():
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=512)
    return {
        "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common),     # learned positions
        "qwen2": Qwen2Config(num_key_value_heads=2, **small, **common),                   # q/k/v biases
        "mistral-no-window": MistralConfig(num_key_value_heads=2, sliding_window=None, **small, **common),
        "llama-mqa-head-dim-12": LlamaConfig(num_key_value_heads=1, head_dim=12, **small, **common),
    }


@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "mistral-no-window", "llama-mqa-head-dim-12"])
def test_other_architectures_equal_generate_alone(arch):
    import copy

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(_arch_configs()[arch]), attn_implementation="sdpa")
    ref = ref.to(torch.float64).eval()
    eng = Engine(copy.deepcopy(ref), max_tokens=2048, block_size=8, max_num_batched_tokens=32, max_num_seqs=8)
    prompts = random_prompts(6, 1, 60, VOCAB, seed=1)
    outs = eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    for out, prompt in zip(outs, prompts):
        assert out.output_token_ids == reference_greedy(ref, prompt, 8)[0]
    check_idle(eng)


def test_per_layer_attention_scales_are_refused():
    from transformers import AutoModelForCausalLM, GPT2Config

    from decode.hf import UnsupportedFeatureError

    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, scale_attn_by_inverse_layer_idx=True,
                     vocab_size=VOCAB)
    with pytest.raises(UnsupportedFeatureError, match="per-layer attention scales"):
        Engine(AutoModelForCausalLM.from_config(cfg), max_tokens=256)


@pytest.mark.parametrize("budget, kv_cache_dtype", [("1MiB", "auto"), ("512KiB", "auto"), (65536, "auto"),
                                                    ("1MiB", "float16"), ("0.5MB", "int8")])
def test_the_memory_budget_sizes_the_pool_by_the_raw_kv_formula(budget, kv_cache_dtype):
    from decode.serve.loading import parse_memory

    eng = engine(kv_cache_memory=budget, max_tokens=None, kv_cache_dtype=kv_cache_dtype)
    layers, kv_heads, head_dim = 2, 2, 16
    itemsize = {"auto": 8, "float16": 2, "int8": 1}[kv_cache_dtype]
    per_token = 2 * layers * kv_heads * head_dim * itemsize                  # raw K/V bytes of one token
    if kv_cache_dtype == "int8":
        per_token += 2 * layers * kv_heads * 1 * 2                           # one float16 scale per 32 values
    pages = parse_memory("budget", budget) // (per_token * 8)
    assert eng.stats()["pages_total"] == pages
    assert eng.pool.cache.pool.nbytes <= parse_memory("budget", budget) < eng.pool.cache.pool.nbytes + per_token * 8


def test_torch_keeps_its_thread_count_across_parallel_kernel_launches():
    """A prefill of >= 256 tokens runs the attention kernel on numba's threads; numba's OpenMP layer, at its
    first launch, resets the process's OpenMP thread count (torch's too): the runner puts torch's back."""
    assert torch.get_num_threads() == 1                          # the module's setting
    eng = engine(max_num_batched_tokens=600, max_num_seqs=8)
    prompts = random_prompts(2, 280, 300, VOCAB, seed=95)
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=3, temperature=0))
    drain(eng)
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("amx_cpu", [False, True])
def test_kernel_threads_follow_the_cpu_as_paged_caches_do(monkeypatch, amx_cpu):
    """The runner's decode forwards take numba's thread count on a CPU with AMX (measured faster there: a 16-request
    decode step 77 against 87 ms) and one thread elsewhere: `decode.hf.plan.auto_kernel_threads`, PagedCache's
    default too; the greedy tokens are the reference's either way."""
    from decode import attention_plan

    monkeypatch.setattr(attention_plan, "AMX_CPU", amx_cpu)
    eng = engine()
    assert eng.runner.kernel_threads == (None if amx_cpu else 1)
    prompts = random_prompts(3, 4, 40, VOCAB, seed=5)
    got = eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    for out, prompt in zip(got, prompts):
        assert out.output_token_ids == reference(torch.float64, prompt, 6)[0]


@pytest.mark.parametrize("given", ["two", 0, True])
def test_bad_kernel_threads_are_refused_by_name(given):
    from decode.serve.runner import ModelRunner

    eng = engine()
    with pytest.raises(ValueError, match="kernel_threads: expected None, 'auto' or an int >= 1"):
        ModelRunner(eng.model, eng.pool, kernel_threads=given)
