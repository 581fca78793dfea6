"""Bitwise-deterministic attention (issue 19, item 4): a sequence's output is identical, to the bit, whatever else is
in the call (alone, in a batch of other sequences, next to runs and single queries), whatever the thread count
and the serial / parallel choice, and wherever its pages lie in the pool; for every storage format.

Why it holds (docs/kernel.md, "Determinism"): key ranges are cut at absolute multiples of fixed piece lengths,
partial states are merged in key order, and threads only decide who computes a unit.
"""
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decode import Decoder, batch_extend, batch_step
from decode.attention import paged_decode_attention
from kvcache import KVCache, bf16, quant

pytestmark = pytest.mark.kernel

FORMATS = ("float32", "float16", "int8", "bfloat16")
# without the JIT (the NUMBA_DISABLE_JIT rerun) a third of the draws: the kernels run as Python there, where the
# compiled runs' 12 draws took ~40 s of CI's time; the compiled runs keep all of them
SETTINGS = settings(max_examples=4 if numba.config.DISABLE_JIT else 12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Pool:
    """Sequences of given lengths in one pool, pages in a random physical order (``order``), stored as ``fmt``."""

    def __init__(self, rng, fmt, lengths, num_kv_heads, group, head_dim, page_size, spare=2):
        self.fmt, self.P = fmt, page_size
        self.keys = [rng.standard_normal((L, num_kv_heads, head_dim)).astype(np.float32) for L in lengths]
        self.values = [rng.standard_normal((L, num_kv_heads, head_dim)).astype(np.float32) for L in lengths]
        self.num_q_heads = num_kv_heads * group
        npp = [-(-L // page_size) for L in lengths]
        self.num_pages = sum(npp) + spare
        self.npp = npp

    def build(self, order):
        """(k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr) with logical page i at order[i]."""
        H, D = self.keys[0].shape[1:]
        P = self.P
        k = np.zeros((self.num_pages, H, P, D), np.float32)
        v = np.zeros_like(k)
        indices = []
        n = 0
        for K, V, pages in zip(self.keys, self.values, self.npp):
            for j in range(pages):
                phys = order[n + j]
                rows = slice(j * P, min(len(K), (j + 1) * P))
                width = rows.stop - rows.start
                k[phys, :, :width] = K[rows].transpose(1, 0, 2)
                v[phys, :, :width] = V[rows].transpose(1, 0, 2)
                indices.append(phys)
            n += pages
        indptr = np.zeros(len(self.npp) + 1, np.int64)
        indptr[1:] = np.cumsum(self.npp)
        indices = np.array(indices, np.int32)
        if self.fmt == "int8":
            kq, ks = quant.quantize(k)
            vq, vs = quant.quantize(v)
            return kq, vq, ks, vs, indices, indptr
        if self.fmt == "bfloat16":
            return bf16.to_bits(k), bf16.to_bits(v), None, None, indices, indptr
        dt = np.dtype(self.fmt)
        return k.astype(dt), v.astype(dt), None, None, indices, indptr


def attend(pages, q, query_seq, query_pos, **kw):
    k, v, ks, vs, indices, indptr = pages
    if k.dtype == np.uint16:                     # `Pool.build` stores bfloat16 bits as uint16
        kw["storage"] = "bfloat16"
    return paged_decode_attention(q, k, v, indices, indptr, np.asarray(query_seq, np.int32),
                                  np.asarray(query_pos, np.int64), k_scales=ks, v_scales=vs, **kw)


def with_threads(n, f):
    before = numba.get_num_threads()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        return f()
    finally:
        numba.set_num_threads(before)


@st.composite
def scenes(draw):
    fmt = draw(st.sampled_from(FORMATS))
    page_size = draw(st.sampled_from((1, 3, 16, 32)))
    group = draw(st.sampled_from((1, 2, 4, 8)))
    head_dim = draw(st.sampled_from((8, 32, 40)))
    lengths = draw(st.lists(st.integers(1, 1400), min_size=2, max_size=4))
    target_T = draw(st.integers(1, 6))                      # 1: a step; >= 3: a run (the tiled kernel)
    seed = draw(st.integers(0, 2 ** 16))
    return fmt, page_size, group, head_dim, lengths, target_T, seed


@SETTINGS
@given(scenes())
def test_output_independent_of_batch_threads_and_placement(scene):
    """Sequence 0's queries (its last target_T positions): alone on one thread, then in a batch with every other
    sequence's last query and a run of another sequence, on 2 threads, parallel forced, pages permuted."""
    fmt, P, group, head_dim, lengths, T, seed = scene
    rng = np.random.default_rng(seed)
    T = min(T, lengths[0])
    pool = Pool(rng, fmt, lengths, 1 if group == 8 else 2, group, head_dim, P)
    q = rng.standard_normal((T, pool.num_q_heads, head_dim)).astype(np.float32)
    own_pos = list(range(lengths[0] - T, lengths[0]))
    alone = with_threads(1, lambda: attend(pool.build(np.arange(pool.num_pages)), q, [0] * T, own_pos))
    others_seq, others_pos = [], []
    for s, L in enumerate(lengths[1:], 1):                   # a run of up to 4 queries, or one query
        n = min(L, 4 if s == 1 else 1)
        others_seq += [s] * n
        others_pos += list(range(L - n, L))
    qo = rng.standard_normal((len(others_seq), pool.num_q_heads, head_dim)).astype(np.float32)
    order = rng.permutation(pool.num_pages)
    for first in (True, False):                              # the target first or last in the batch
        seqs = [0] * T + others_seq if first else others_seq + [0] * T
        pos = own_pos + others_pos if first else others_pos + own_pos
        qq = np.concatenate([q, qo] if first else [qo, q])
        for threads in (2, 1):
            out = with_threads(threads, lambda: attend(pool.build(order), qq, seqs, pos))
            got = out[:T] if first else out[len(others_seq):]
            assert np.array_equal(got, alone), (threads, first)


@pytest.mark.parametrize("fmt", FORMATS)
def test_long_sequence_split_pieces_independent_of_threads(fmt):
    """One long query (cut into pieces, merged) and a long run: 1 thread == 2 threads == forced serial. Without
    the JIT (where the kernels run as Python, ~7-20 s a format) float32 and bfloat16 only."""
    if numba.config.DISABLE_JIT and fmt in ("float16", "int8"):
        pytest.skip("compiled runs only: float32 and bfloat16 cover the Python semantics")
    rng = np.random.default_rng(3)
    pool = Pool(rng, fmt, [2600, 1500], 2, 4, 64, 16)
    pages = pool.build(rng.permutation(pool.num_pages))
    q = rng.standard_normal((9, 8, 64)).astype(np.float32)
    seqs, pos = [0] * 5 + [1] * 3 + [0], list(range(2590, 2595)) + [1497, 1498, 1499] + [2599]
    one = with_threads(1, lambda: attend(pages, q, seqs, pos))
    two = with_threads(2, lambda: attend(pages, q, seqs, pos))
    assert np.array_equal(one, two)
    step = with_threads(2, lambda: attend(pages, q[8:], [0], [2599]))        # the single query alone
    assert np.array_equal(step, one[8:])
    run = with_threads(2, lambda: attend(pages, q[:5], [0] * 5, pos[:5]))    # the run alone (tiled kernel)
    assert np.array_equal(run, one[:5])


def _decoders(fmt, n, rng, length):
    cache = KVCache(num_kv_heads=2, head_dim=32, page_size=16, max_tokens=n * (length + 200), dtype=fmt)
    decs = []
    for i in range(n):
        d = Decoder.on_cache(cache, 8)
        d.append(rng.standard_normal((length + 37 * i, 2, 32)).astype(np.float32),
                 rng.standard_normal((length + 37 * i, 2, 32)).astype(np.float32))
        decs.append(d)
    return decs


@pytest.mark.parametrize("fmt", FORMATS)
def test_decoder_step_alone_equals_batch_step_and_batch_extend(fmt):
    """Through the Decoder: a step alone == the same step inside batch_step of 3 sequences == inside
    batch_extend with other sequences extending by several tokens."""
    rng = np.random.default_rng(11)
    decs = _decoders(fmt, 3, rng, 700)
    q, k, v = (rng.standard_normal((3, h, 32)).astype(np.float32) for h in (8, 2, 2))
    alone = decs[0].step(q[0], k[0], v[0])
    decs[0].truncate(decs[0].length - 1)
    batched = batch_step(decs, q, k, v)
    assert np.array_equal(batched[0], alone)
    for d in decs:
        d.truncate(d.length - 1)
    qs = [q[:1], rng.standard_normal((5, 8, 32)).astype(np.float32), rng.standard_normal((2, 8, 32)).astype(np.float32)]
    ks = [k[:1], rng.standard_normal((5, 2, 32)).astype(np.float32), rng.standard_normal((2, 2, 32)).astype(np.float32)]
    vs = [v[:1], rng.standard_normal((5, 2, 32)).astype(np.float32), rng.standard_normal((2, 2, 32)).astype(np.float32)]
    outs = batch_extend(decs, qs, ks, vs)
    assert np.array_equal(outs[0][0], alone)


_SUBPROCESS = """
import numpy as np, sys
sys.path.insert(0, {root!r})
import numba
from decode.attention import paged_decode_attention
rng = np.random.default_rng(5)
k = rng.standard_normal((200, 2, 16, 64)).astype(np.float32)
v = rng.standard_normal((200, 2, 16, 64)).astype(np.float32)
q = rng.standard_normal((7, 8, 64)).astype(np.float32)
pages = rng.permutation(200).astype(np.int32)
out = paged_decode_attention(q, k, v, pages, [0, 100, 200], np.array([0, 0, 0, 0, 0, 1, 1], np.int32),
                             np.array([1500, 1501, 1502, 1503, 1504, 900, 1599]))
sys.stdout.write(str(numba.get_num_threads()) + " " + out.tobytes().hex())
"""


@pytest.mark.skipif(numba.config.DISABLE_JIT or numba.config.BOUNDSCHECK,
                    reason="compiled optimised code only: under NUMBA_DISABLE_JIT nothing compiles or loads, and the "
                           "NUMBA_BOUNDSCHECK rerun's build ships nowhere (the other kernel tests bounds-check it)")
def test_more_threads_than_cores_and_fresh_compile_equals_cache_load(tmp_path):
    """Fresh processes on an empty numba cache of their own: the first compiles every kernel (NUMBA_NUM_THREADS=1),
    the next load them from that cache (=4, more than this machine's cores, and =1 again): the same bits.
    With fastmath's reassociation a kernel's callee was optimised differently alone and inside its caller, and
    which copy ran depended on what the process had compiled or loaded (docs/kernel.md, "Determinism"): the
    compiling process and the loading ones disagreed in the last bits, whatever the thread count."""
    root = str(Path(__file__).resolve().parents[2])
    results = []
    for n in (1, 4, 1):
        env = dict(os.environ, NUMBA_NUM_THREADS=str(n), NUMBA_CACHE_DIR=str(tmp_path / "numba"))
        res = subprocess.run([sys.executable, "-c", _SUBPROCESS.format(root=root)], env=env, capture_output=True,
                             text=True, timeout=600, check=True)
        threads, bits = res.stdout.split()
        assert int(threads) == n
        results.append(bits)
    assert results[1] == results[0], "NUMBA_NUM_THREADS=4 loading from the cache != =1 compiling"
    assert results[2] == results[0], "NUMBA_NUM_THREADS=1 loading from the cache != =1 compiling"
