"""vdpbf16ps scores over bfloat16 pages (`decode.kernels.bf16_dot`): the exact split of q into bfloat16 parts, the
register blocks (the instruction, its shift-and-FMA emulation and the NumPy twin agree bit for bit), and the
per-query kernel in every mode (0: shift path, 1: bfloat16 q only, 2: every q) within the float32 budget of the
float64 oracle on the dequantized K/V, with the bits of a query independent of the mode it did not need and of
the other queries of the call.

Marked `kernel` (rerun under NUMBA_DISABLE_JIT=1 and NUMBA_BOUNDSCHECK=1 with --reduced-grid)."""
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from decode.attention import paged_decode_attention
from decode.attention_plan import attend_unchecked
from decode.kernels import bf16_dot

_spec = importlib.util.spec_from_file_location("decode_kernel_naive_bf16", Path(__file__).with_name("naive.py"))
naive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(naive)

pytestmark = pytest.mark.kernel


def to_bits(x):
    """float32 -> bfloat16 bits (uint16), nearest even (finite input): the test's own rounding."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def widen(bits):
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def as_bf16(x):
    """x rounded to bfloat16, as float32 (a bfloat16 model's q)."""
    return widen(to_bits(x))


@pytest.fixture
def mode(monkeypatch):
    """Set the mode plans pass to the kernel (0 stays 0 where the CPU has no avx512bf16: `plan_mode`)."""
    def set_mode(m):
        monkeypatch.setattr(bf16_dot, "MODE", m)
    return set_mode


# ------------------------------------------------------------------------------------------------------------
# the split
# ------------------------------------------------------------------------------------------------------------
def _buffers(Hq, D, H=1):
    return (np.zeros((H, Hq // H, bf16_dot.PARTS * bf16_dot.padded(D)), np.int16),
            np.zeros((H, Hq // H, bf16_dot.padded(D)), np.float32))


def _split(q, mode=2):
    qb, qf = _buffers(*q.shape)
    parts = bf16_dot.split_query(np.ascontiguousarray(q, np.float32), qb, qf, mode)
    return parts, (qf[0] if parts < 0 else qb[0])


@pytest.mark.parametrize("D", [1, 31, 32, 33, 128])
def test_split_is_exact(D):
    """hi + mid + lo == q exactly (float64 sum of the parts) for normal float32 over 60 binades, signs, and values
    with 8, 16 and 24 significand bits; the padding beyond head_dim is zero; the part count is the least
    needed."""
    rng = np.random.default_rng(D)
    q = (rng.standard_normal((6, D)) * 2.0 ** rng.integers(-30, 30, (6, D))).astype(np.float32)
    parts, qb = _split(q)
    Dp = bf16_dot.padded(D)
    total = sum(widen(qb[:, p * Dp:p * Dp + D]).astype(np.float64) for p in range(bf16_dot.PARTS))
    assert np.array_equal(total, q.astype(np.float64))
    assert parts == 3
    for p in range(bf16_dot.PARTS):
        assert not qb[:, p * Dp + D:(p + 1) * Dp].any()
    assert _split(as_bf16(q))[0] == 1
    two = (q.view(np.uint32) & np.uint32(0xFFFFFF00)).view(np.float32)   # 16 significand bits
    assert _split(two)[0] == 2
    zeros = np.zeros((2, D), np.float32)
    zeros[0, 0] = -0.0
    assert _split(zeros)[0] == 1


def test_modes_choose_per_query():
    """Mode 1: vdpbf16ps parts only for a bfloat16 q with >= MIN_GROUP heads per kv head, else the shift path;
    2: parts always; 3: halves always; 0, or empty buffers (pages not bfloat16): neither."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 40)).astype(np.float32)
    qb, qf = _buffers(4, 40, H=1)
    expect = {0: (0, 0), 1: (0, 1), 2: (3, 1), 3: (-1, -1)}
    for mode, (plain, exact) in expect.items():
        assert bf16_dot.split_query(q, qb, qf, mode) == plain
        assert bf16_dot.split_query(as_bf16(q), qb, qf, mode) == exact
    small = _buffers(4, 40, H=2)                                       # 2 q heads per kv head
    assert bf16_dot.split_query(as_bf16(q), *small, 1) == 0
    assert bf16_dot.split_query(as_bf16(q), *small, 2) == 1
    empty = (np.zeros((0, 0, 0), np.int16), np.zeros((0, 0, 0), np.float32))
    assert bf16_dot.split_query(q, *empty, 2) == 0


@pytest.mark.parametrize("D", [1, 31, 32, 33, 128])
def test_halves_layout(D):
    """The float32 halves: each block of 32 as its 16 even elements, then its 16 odd ones; zero padded."""
    rng = np.random.default_rng(D)
    q = rng.standard_normal((3, D)).astype(np.float32)
    parts, qf = _split(q, mode=3)
    assert parts == -1
    Dp = bf16_dot.padded(D)
    padded_q = np.zeros((3, Dp), np.float32)
    padded_q[:, :D] = q
    for i in range(0, Dp, 32):
        assert np.array_equal(qf[:, i:i + 16], padded_q[:, i:i + 32:2])
        assert np.array_equal(qf[:, i + 16:i + 32], padded_q[:, i + 1:i + 32:2])


# ------------------------------------------------------------------------------------------------------------
# the register blocks
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("D", [1, 31, 32, 40, 128, 129])
def test_blocks_instruction_emulation_twin_agree(D):
    """dot44 / dot14 by vdpbf16ps (where the CPU has it), by the shift-and-FMA emulation and by the NumPy twin:
    the same bits for every part count, key offsets and a short last block (rows past `last` repeat it); within
    a float32 dot product's error of the float64 values."""
    rng = np.random.default_rng(D + 1)
    q = (rng.standard_normal((5, D)) * rng.choice([1e-3, 1.0, 30.0], (5, D))).astype(np.float32)
    parts, qb = _split(q)
    kp = to_bits(10 * rng.standard_normal((9, D))).view(np.int16)
    blocks = [bf16_dot.testing_blocks(False), bf16_dot.testing_blocks(True)]
    K = widen(kp).astype(np.float64)
    for use in (1, 2, parts):
        for t, last in ((0, 8), (5, 8), (6, 7)):
            got = [b44(qb, 1, use, kp, t, D, last) for b44, _ in blocks]
            twin = np.array(bf16_dot.dot44_bf(qb, 1, use, kp, t, D, last), np.float32)
            assert all(np.array_equal(g, twin) for g in got)
            got1 = [b14(qb, 4, use, kp, t, D, last) for _, b14 in blocks]
            twin1 = np.array(bf16_dot.dot14_bf(qb, 4, use, kp, t, D, last), np.float32)
            assert all(np.array_equal(g, twin1) for g in got1)
        if use == parts:
            _, qf = _split(q, mode=3)
            halves = bf16_dot.testing_blocks(False)[0](qf, 1, 1, kp, t, D, last)
            twin_h = np.array(bf16_dot.dot44_bf(qf, 1, 1, kp, t, D, last), np.float32)
            exact = np.array([q[1 + a].astype(np.float64) @ K[min(t + b, last)] for a in range(4) for b in range(4)])
            mag = np.array([np.abs(q[1 + a]).astype(np.float64) @ np.abs(K[min(t + b, last)])
                            for a in range(4) for b in range(4)])
            for got in (twin, halves, twin_h):
                assert (np.abs(got - exact) <= 3 * D * 2.0 ** -24 * mag + 1e-30).all()


# ------------------------------------------------------------------------------------------------------------
# the kernel
# ------------------------------------------------------------------------------------------------------------
class Pages:
    """One bfloat16 pool, sequences of ``lengths`` in random page order, q per query; the oracle's K/V are the
    widened bits."""

    def __init__(self, rng, *, num_kv_heads, group, head_dim, page_size, lengths, queries, magnitude=1.0):
        P = page_size
        npp = [-(-L // P) for L in lengths]
        num_pages = sum(npp) + 2
        self.page_indices = rng.permutation(num_pages)[:sum(npp)].astype(np.int32)
        self.page_indptr = np.concatenate([[0], np.cumsum(npp)]).astype(np.int64)
        shape = (num_pages, num_kv_heads, P, head_dim)
        self.kb = to_bits(magnitude * rng.standard_normal(shape))
        self.vb = to_bits(rng.standard_normal(shape))
        self.query_seq = np.array([s for s, _ in queries], np.int32)
        self.query_pos = np.array([p for _, p in queries], np.int64)
        self.q = (magnitude * rng.standard_normal((len(queries), num_kv_heads * group, head_dim))).astype(np.float32)
        self.scale = 1.0 / math.sqrt(head_dim)

    def tables(self):
        return self.page_indices, self.page_indptr, self.query_seq, self.query_pos

    def budget(self, q):
        args = (q, widen(self.kb), widen(self.vb), *self.tables())
        ref = naive.decode(*args, self.scale, 0)
        return ref, naive.budget(*args, self.scale, 0, ref=ref)

    def run(self, q, mode=0, split=0):
        out = np.empty((len(q), q.shape[1], self.vb.shape[3]), np.float32)
        return attend_unchecked(q, self.kb, self.vb, *self.tables(), self.scale, 0, out, mode=mode,
                                split_tokens=split, storage="bfloat16", tiled=False)


CASES = [(1, 1, 1), (33, 4, 3), (64, 8, 16), (40, 2, 5), (128, 32, 16), (129, 1, 32), (128, 4, 32)]


@pytest.mark.parametrize("head_dim,group,P", CASES)
def test_kernel_modes_within_budget(head_dim, group, P, mode, reduced_grid):
    """Every mode, float32 q and bfloat16 q, serial / parallel / split: within the budget; a bfloat16 q gets the
    same bits in modes 1 and 2 where mode 1 takes vdpbf16ps (one part either way), else in modes 0 and 1, and a
    float32 q the same bits in modes 0 and 1 (the shift path)."""
    if reduced_grid and head_dim >= 128:
        pytest.skip("full grid only")
    if numba.config.DISABLE_JIT and (head_dim, group, P) in ((1, 1, 1), (40, 2, 5)):
        pytest.skip("compiled runs only: without the JIT (~12-16 s each as Python) 33 / 4 / 3 and 64 / 8 / 16 cover it")
    rng = np.random.default_rng(head_dim * 100 + group + P)
    s = Pages(rng, num_kv_heads=1 if group == 32 else 2, group=group, head_dim=head_dim, page_size=P,
              lengths=[1, P + 1, 70, 300], queries=[(0, 0), (1, P), (2, 69)] + [(3, t) for t in range(295, 300)])
    for q in (s.q, as_bf16(s.q)):
        ref, allowed = s.budget(q)
        outs = {}
        for m in (0, 1, 2, 3):
            mode(m)
            for run, split in ((1, 0), (2, 0), (2, 64)):
                got = s.run(q, run, split)
                assert np.abs(got - ref).max() <= allowed, (m, run, split)
                outs[m, run, split] = got
            routed = paged_decode_attention(q, s.kb, s.vb, *s.tables(), storage="bfloat16")   # run: tiled
            assert np.abs(routed - ref).max() <= allowed
        same = (1, 2) if q is not s.q and group >= bf16_dot.MIN_GROUP else (0, 1)
        for key in ((1, 0), (2, 0), (2, 64)):
            assert np.array_equal(outs[(same[0],) + key], outs[(same[1],) + key])


@pytest.mark.parametrize("head_dim", [3, 33, 128, 129])
@pytest.mark.parametrize("magnitude", [3.0, 10.0])
def test_kernel_score_magnitudes(head_dim, magnitude, mode, reduced_grid):
    """q and K scaled up (|q.k| to ~1000 at head_dim 128): modes 1-3 within the budget, bfloat16 and float32 q,
    groups 1 / 4 / 8 / 32, pages 1 / 3 / 16."""
    if reduced_grid and (head_dim, magnitude) != (33, 10.0):
        pytest.skip("full grid only")
    for P, group in ((1, 8), (16, 1), (16, 32), (3, 4)):
        rng = np.random.default_rng(int(head_dim * 1000 + P * 10 + group + magnitude))
        s = Pages(rng, num_kv_heads=1 if group == 32 else 2, group=group, head_dim=head_dim, page_size=P,
                  lengths=[1, P, 2 * P + 1, 70], queries=[(0, 0), (1, P - 1), (2, 2 * P), (3, 69)],
                  magnitude=magnitude)
        for q in (s.q, as_bf16(s.q)):
            ref, allowed = s.budget(q)
            for m in (1, 2, 3):
                mode(m)
                for run, split in ((1, 0), (2, 64)):
                    assert np.abs(s.run(q, run, split) - ref).max() <= allowed, (P, group, m, run)


@pytest.mark.parametrize("m", [1, 2])
def test_query_bits_independent_of_the_other_queries(m, mode):
    """A bfloat16 query alone == the same query in a call with float32 queries of other sequences (and a float32
    query alone == in a call with bfloat16 ones), on one thread and on all of them, pages permuted."""
    rng = np.random.default_rng(m)
    s = Pages(rng, num_kv_heads=2, group=4, head_dim=64, page_size=16, lengths=[900, 400, 50],
              queries=[(0, 899), (1, 399), (2, 49)])
    mode(m)
    q = s.q.copy()
    q[0] = as_bf16(q[0])
    before = numba.get_num_threads()
    try:
        for threads in (1, before):
            numba.set_num_threads(threads)
            together = s.run(q)
            for i in range(3):
                alone = attend_unchecked(q[i:i + 1], s.kb, s.vb, s.page_indices, s.page_indptr,
                                         s.query_seq[i:i + 1], s.query_pos[i:i + 1], s.scale, 0,
                                         np.empty((1, 8, 64), np.float32), storage="bfloat16", tiled=False)
                assert np.array_equal(alone[0], together[i]), (threads, i)
    finally:
        numba.set_num_threads(before)


def test_plan_mode_is_zero_without_the_instruction(monkeypatch):
    monkeypatch.setattr(bf16_dot, "MODE", 2)
    assert bf16_dot.plan_mode() == (2 if bf16_dot.HOST else 0)
    monkeypatch.setattr(bf16_dot, "HOST", False)
    assert bf16_dot.plan_mode() == 0


def test_default_mode_follows_the_cpu(monkeypatch):
    """Unset (MODE None), the plans' mode is the CPU's default: the shift path where it has AMX, vdpbf16ps
    elsewhere; a mode that is set wins; no avx512bf16: 0 whatever is set."""
    monkeypatch.setattr(bf16_dot, "MODE", None)
    monkeypatch.setattr(bf16_dot, "HOST", True)
    monkeypatch.setattr(bf16_dot, "AMX_HOST", True)
    assert bf16_dot.plan_mode() == bf16_dot.AMX_MODE == 0
    assert bf16_dot.tile_mode() == 0
    monkeypatch.setattr(bf16_dot, "AMX_HOST", False)
    assert bf16_dot.plan_mode() == bf16_dot.DEFAULT_MODE == 1
    assert bf16_dot.tile_mode() == 1
    monkeypatch.setattr(bf16_dot, "MODE", 0)
    assert bf16_dot.plan_mode() == 0
    monkeypatch.setattr(bf16_dot, "MODE", None)
    monkeypatch.setattr(bf16_dot, "HOST", False)
    assert bf16_dot.plan_mode() == 0


def test_mode_from_the_environment(monkeypatch):
    """$KVENGINE_BF16_DOT sets the mode at import; unset, None (the CPU's default); anything else is refused by
    name."""
    for raw, want in (("", None), ("0", 0), ("2", 2)):
        monkeypatch.setenv(bf16_dot.MODE_ENV, raw)
        assert bf16_dot.env_mode() == want
    monkeypatch.setenv(bf16_dot.MODE_ENV, "5")
    with pytest.raises(ValueError, match="KVENGINE_BF16_DOT"):
        bf16_dot.env_mode()


def test_named_target_assumes_no_instruction(tmp_path):
    """Under NUMBA_CPU_NAME alone (a named target, here one without avx512bf16: its features are not queried)
    neither vdpbf16ps nor the AMX tiles are emitted, whatever the host has (the plans keep mode 0). Before, the
    bfloat16 blocks asked the host and would have emitted vdpbf16ps for a skylake-avx512 target on this host."""
    env = dict(os.environ, NUMBA_CPU_NAME="skylake-avx512", NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("NUMBA_CPU_FEATURES", None)
    code = ("from decode.kernels import amx_tiles, bf16_dot; "
            "print(bf16_dot.HOST, bf16_dot.AMX_HOST, amx_tiles.HOST, bf16_dot.plan_mode())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["False", "False", "False", "0"]
