"""`decode.hf.plan.ForwardPlan` (issue 17: one planning layer): a forward is planned once, whatever its number of
layers (one `AttentionPlan` per query chunk and distinct window), each layer checks only its own tensors and a bad
one raises before that layer writes anything; chunked attention (`decode.hf.query_chunks`) computes what one call
does, bit for bit; bfloat16 K/V reach bfloat16 pages as their own bits. Outputs are checked against
`reference.dense` (float64)."""
import numpy as np
import pytest
import torch

import decode.attention
from decode.attention_plan import AttentionPlan
from decode.hf import query_chunks
from decode.hf.plan import ForwardPlan
from kvcache import KVCache
from kvcache.testing import FaultInjector
from reference.dense import attention_context

from .models import CONFIGS, build, generate, prompts
from .test_misuse import cache_for, forward, llama


@pytest.fixture
def plans_made(monkeypatch):
    """Every `AttentionPlan` constructed, by window; the checked wrapper (which re-plans) must not be reached."""
    made = []
    init = AttentionPlan.__init__

    def counting(self, query_seq, query_pos, window, *args, **kwargs):
        made.append(window)
        init(self, query_seq, query_pos, window, *args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("the checked wrapper re-validates and re-plans: ForwardPlan must not call it")
    monkeypatch.setattr(AttentionPlan, "__init__", counting)
    monkeypatch.setattr(decode.attention, "paged_decode_attention", refused)
    return made


@pytest.mark.parametrize("layers", [1, 5])
def test_a_forward_is_planned_once_whatever_its_layers(plans_made, layers):
    model = build(llama(layers), "pagedkv")
    ids, mask = prompts(2, 7, seed=3)
    cache = cache_for(model)
    generate(model, ids, mask, cache=cache, max_new_tokens=4, do_sample=False)
    assert cache.stats["forwards"] == 4 and cache.stats["kernel_calls"] == 4 * layers
    assert plans_made == [0] * cache.stats["forwards"]          # both rows in one chunk, one window: one plan


def test_mixed_windows_plan_once_per_window(plans_made):
    """Qwen2 with full and sliding layers: one plan per distinct window per forward, not per layer."""
    model = build(CONFIGS["qwen2"](), "pagedkv")
    cache = cache_for(model)
    windows = sorted(set(cache.layout.windows))
    assert len(windows) == 2 and len(cache.layout.windows) > len(windows)
    generate(model, *prompts(1, 9, seed=4), cache=cache, max_new_tokens=3, do_sample=False)
    assert sorted(plans_made) == sorted(windows * cache.stats["forwards"])


def test_chunked_attention_is_one_call_bit_for_bit(monkeypatch):
    """Chunks of one tile (the smallest `chunk_limit` gives) against the default single chunk: the same logits,
    bit for bit, on left-padded rows of a long prompt (several chunks per row, the tiles of each run kept)."""
    model = build(llama(2, kv_heads=1, heads=4), "pagedkv")            # group 4: tiles of 32 queries
    ids, mask = prompts(2, 75, seed=5, pad_lengths=[0, 9])
    whole = forward(model, ids, mask, cache_for(model))
    monkeypatch.setattr(query_chunks, "CHUNK_BYTES", 1)
    cache = cache_for(model)
    chunked = forward(model, ids, mask, cache)
    assert torch.equal(chunked, whole)


def test_chunks_cover_every_query_once():
    first = np.array([0, 0, 5, 0, 64], dtype=np.int64)
    got = query_chunks.chunks(first, 66, 32)
    assert got[:2] == [(0, 1, 0, 32, 0), (0, 1, 32, 66, 32)]     # a long row is cut; its 2-column tail stays
    covered = []
    for b0, b1, t0, t1, q0 in got:
        assert b1 - b0 == 1 or (t0, t1) == (0, 66)
        covered += [(b, t) for b in range(b0, b1) for t in range(t0, t1)]
        assert q0 == len(covered) - (b1 - b0) * (t1 - t0)
    assert covered == [(b, t) for b in range(5) for t in range(first[b], 66)]
    assert query_chunks.chunks(np.zeros(3, np.int64), 10, 32) == [(0, 3, 0, 10, 0)]   # whole rows together
    assert query_chunks.chunks(np.zeros(4, np.int64), 1, 32) == [(0, 4, 0, 1, 0)]   # decode: one call


# -- ForwardPlan on its own: per-layer checks before any write, values against the float64 reference -----------
def _pool(dtype="float32", layers=3):
    return KVCache(num_layers=layers, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=4, max_tokens=256)


def _tensors(batch, width, seed, dtype=torch.float32, heads=4):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, width, 8, generator=g).to(dtype) for h in (heads, 2, 2))
    return q, k, v


def test_each_layer_attends_its_rows_as_the_reference():
    pool = _pool()
    seqs = [pool.create_sequence() for _ in range(2)]
    real = np.ones((2, 6), dtype=bool)
    real[1, :2] = False                                               # row 1 left-padded
    plan = ForwardPlan(pool, seqs, real)
    for layer in range(3):
        q, k, v = _tensors(2, 6, seed=layer)
        out = plan.run_layer(layer, q, k, v, None, 0)                 # [B, T, Hq, Dv]
        for b, start in ((0, 0), (1, 2)):
            kk, vv = (x[b, :, start:].repeat_interleave(2, dim=0).double().numpy() for x in (k, v))
            want = attention_context(q[b, :, start:].double().numpy()[None], kk[None], vv[None])[0]
            np.testing.assert_allclose(out[b, start:].transpose(0, 1).numpy(), want, atol=1e-5, rtol=1e-5)
        assert not out[1, :2].any()                                   # pads before the first token: zeros
    plan.commit()
    assert [pool.length(s) for s in seqs] == [6, 4]


@pytest.mark.parametrize("bad", ["q heads", "q width", "k heads", "v dtype", "q nan", "k inf", "scale"])
def test_a_bad_later_layer_raises_before_it_writes(bad):
    pool = _pool()
    seqs = [pool.create_sequence() for _ in range(2)]
    pool.fault_hook = points = FaultInjector()
    plan = ForwardPlan(pool, seqs, np.ones((2, 5), dtype=bool))
    plan.run_layer(0, *_tensors(2, 5, seed=0), None, 0)
    written = len(points.points)
    before = [pool.pool.k_pages(1).copy(), pool.pool.v_pages(1).copy()]
    q, k, v = _tensors(2, 5, seed=1)
    scale = None
    if bad == "q heads":
        q = q[:, :2]
    elif bad == "q width":
        q = q[:, :, :4]
    elif bad == "k heads":
        k = k[:, :1]
    elif bad == "v dtype":
        v = v.to(torch.int32)
    elif bad == "q nan":
        q[1, 3, 4, 5] = float("nan")
    elif bad == "k inf":
        k[0, 1, 2, 3] = float("inf")
    else:
        scale = float("nan")
    with pytest.raises((ValueError, TypeError)) as err:
        plan.run_layer(1, q, k, v, scale, 0)
    assert len(points.points) == written                              # no fault point passed: nothing written
    assert all(np.array_equal(a, b) for a, b in zip(before, (pool.pool.k_pages(1), pool.pool.v_pages(1))))
    expected = {"q nan": "query: expected finite values, got nan at index (1, 3, 4, 5)",
                "k inf": "key: expected finite values, got inf at index (0, 1, 2, 3)"}
    assert expected.get(bad, "expected") in str(err.value)
    plan.rollback()
    assert [pool.length(s) for s in seqs] == [0, 0]


def test_pad_columns_are_not_checked_nor_stored():
    """A non-finite K/V of a pad column never reaches the pool (nor the checks); of a real column it is refused."""
    pool = _pool(layers=1)
    seq = pool.create_sequence()
    real = np.array([[True, False, True, True]])                      # inner padding
    q, k, v = _tensors(1, 4, seed=2)
    k[0, 1, 1, 0] = float("nan")
    plan = ForwardPlan(pool, [seq], real)
    plan.run_layer(0, q, k, v, None, 0)
    plan.commit()
    stored, _ = pool.gather(seq)
    np.testing.assert_array_equal(stored, k[0][:, [0, 2, 3]].transpose(0, 1).numpy())
    k[0, 0, 2, 0] = float("inf")
    plan = ForwardPlan(pool, [seq], real)
    with pytest.raises(ValueError, match=r"key: expected finite values, got inf at index \(0, 0, 2, 0\)"):
        plan.run_layer(0, q, k, v, None, 0)
    plan.rollback()


def test_bfloat16_kv_reach_bfloat16_pages_as_their_bits():
    pool = _pool("bfloat16", layers=1)
    seq = pool.create_sequence()
    q, k, v = _tensors(1, 7, seed=3, dtype=torch.bfloat16)
    plan = ForwardPlan(pool, [seq], np.ones((1, 7), dtype=bool))
    out = plan.run_layer(0, q, k, v, 0.3, 0)
    plan.commit()
    assert out.dtype == torch.bfloat16
    for stored, x in zip(pool.gather(seq), (k, v)):                   # widened to float32: exact
        np.testing.assert_array_equal(stored, x[0].transpose(0, 1).float().numpy())


@pytest.mark.parametrize("batch, prompt, trims", [(1, 1024, 3), (4, 256, 3), (1, 1023, 0)])
def test_prefill_layers_trim_the_heap_decode_steps_do_not(monkeypatch, batch, prompt, trims):
    """A forward of >= TRIM_TOKENS real tokens (of all its rows) gives malloc's free heap back after each layer's
    attention (`decode.hf.heap`: its freed temporaries would stay in the peak RSS beside the MLP's); a shorter
    prefill and a decode step never."""
    from decode.hf import heap, plan
    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
    model = build(llama(3), "pagedkv")
    assert batch * prompt in (plan.TRIM_TOKENS, plan.TRIM_TOKENS - 1)
    ids, mask = prompts(batch, prompt, seed=5)
    generate(model, ids, mask, cache=cache_for(model, max_tokens=batch * (prompt + 64), page_size=16),
             max_new_tokens=3, do_sample=False)
    assert len(calls) == trims                                   # the prefill's 3 layers (or none); no step's


def test_heap_trim_runs_on_glibc():
    import platform

    from decode.hf import heap
    assert heap.trim() is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_a_forwards_q_and_output_copies_are_made_once_and_given_back_at_its_end(monkeypatch, end):
    """A multi-token forward of a bfloat16 model copies q and the output through float32 buffers: made at the first
    layer and reused by every later one (a mapping per layer cost its page faults each time), no output a view of
    them (each layer's keeps its values), and both gone once the forward commits or rolls back."""
    import gc
    import weakref

    made = []
    scratch = query_chunks.scratch

    def counted(shape, dtype):
        array = scratch(shape, dtype)
        made.append(weakref.ref(array))
        return array
    monkeypatch.setattr(query_chunks, "scratch", counted)
    pool = _pool(layers=4)
    seqs = [pool.create_sequence() for _ in range(2)]
    plan = ForwardPlan(pool, seqs, np.ones((2, 6), dtype=bool))
    outs = []
    for layer in range(4):
        out = plan.run_layer(layer, *_tensors(2, 6, seed=20 + layer, dtype=torch.bfloat16), None, 0)
        assert out.dtype == torch.bfloat16
        outs.append((out, out.clone()))
    assert len(made) == 2 and all(ref() is not None for ref in made)           # q and output, once
    assert all(torch.equal(out, kept) for out, kept in outs)
    getattr(plan, end)()
    gc.collect()
    assert all(ref() is None for ref in made)
