"""The per-query (decode) kernel on AMX tiles (`decode.kernels.amx_decode`): the query's exact bfloat16 parts laid
out as columns, the value rows paired (`amx_blocks.value_pairs`), and
decode queries over bfloat16 pages with >= MIN_GROUP q heads per kv head within the float32 budget of the float64
oracle (`naive.budget`): head_dim 32 / 64 / 128, pages of 1 / 16 / 32 / 64 keys, windows, float32 and bfloat16
q, serial / parallel / split into partials (their lanes in the pair order the merge expects), |q.k| ~ 10**3, the
same bits on a second call; below MIN_GROUP, and with $KVENGINE_AMX=0, the other paths (other bits). The tile
tests run where the CPU has AMX and the OS grants the tile state.

Marked `kernel` (rerun under NUMBA_DISABLE_JIT=1 and NUMBA_BOUNDSCHECK=1 with --reduced-grid)."""
import importlib.util
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

import decode.attention_plan as AP
from decode.attention_plan import attend_unchecked
from decode.kernels import amx_decode, amx_tiles
from decode.kernels.simd import JIT

_spec = importlib.util.spec_from_file_location("decode_kernel_naive_amx_decode", Path(__file__).with_name("naive.py"))
naive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(naive)

pytestmark = pytest.mark.kernel
TILES = pytest.mark.skipif(not amx_tiles.usable(), reason="AMX tiles: the CPU lacks them or the OS refused")
MODES = ((1, 0), (2, 0), (2, 40))      # serial, parallel, parallel with key ranges cut every 40 tokens (partials)
NAN_BITS = 0x7FC0
F32 = np.float32(0.0)       # a zero of the float32 q.k accumulation (the kernels' acc0)


class Scene:
    """Sequences of ``lengths`` tokens in bfloat16 pages in random physical order (unread slots NaN); one decode
    query per sequence at its last position (and one more, a few tokens earlier, in the first), H kv heads of
    ``group`` q heads; q float32 (or exactly bfloat16), times ``q_scale``; K times ``k_scale``."""

    def __init__(self, rng, *, D, group, P, lengths, window=0, H=2, bf16_q=False, q_scale=1.0, k_scale=1.0):
        npp = [-(-L // P) for L in lengths]
        num_pages = sum(npp) + 2
        self.page_indices = rng.permutation(num_pages)[:sum(npp)].astype(np.int32)
        self.page_indptr = np.concatenate([[0], np.cumsum(npp)]).astype(np.int64)
        self.kb = np.full((num_pages, H, P, D), NAN_BITS, np.uint16)
        self.vb = np.full((num_pages, H, P, D), NAN_BITS, np.uint16)
        for s, L in enumerate(lengths):
            row = self.page_indices[self.page_indptr[s]:self.page_indptr[s + 1]]
            for t in range(L):
                self.kb[row[t // P], :, t % P] = naive.bf16_bits(rng.standard_normal((H, D)) * k_scale)
                self.vb[row[t // P], :, t % P] = naive.bf16_bits(rng.standard_normal((H, D)))
        seq = list(range(len(lengths))) + [0]
        pos = [L - 1 for L in lengths] + [max(0, lengths[0] - 4)]
        self.query_seq, self.query_pos = np.array(seq, np.int32), np.array(pos, np.int64)
        q = (rng.standard_normal((len(seq), H * group, D)) * q_scale).astype(np.float32)
        self.q = naive.bf16_values(naive.bf16_bits(q)).astype(np.float32) if bf16_q else q
        self.scale, self.window = 1.0 / math.sqrt(D), window

    def run(self, mode=0, split_tokens=0, only=None, precision="default"):
        """All queries, or those at the indices ``only`` (a smaller batch)."""
        pick = slice(None) if only is None else np.asarray(only)
        q = np.ascontiguousarray(self.q[pick])
        out = np.full((len(q), q.shape[1], self.vb.shape[3]), np.nan, np.float32)
        return attend_unchecked(q, self.kb, self.vb, self.page_indices, self.page_indptr, self.query_seq[pick],
                                self.query_pos[pick], self.scale, self.window, out, storage="bfloat16", mode=mode,
                                split_tokens=split_tokens, tiled=False, precision=precision)

    def check(self, out):
        naive.check_bf16(out, self.q, self.kb, self.vb, self.page_indices, self.page_indptr, self.query_seq,
                         self.query_pos, self.scale, self.window)


@pytest.mark.parametrize("G", [16, 32])
def test_pack_columns_is_exact(G):
    """The packed query's parts sum to q exactly (float32 q: three parts; a bfloat16 q: one). 16 q heads per kv
    head: part p of head g in column p * G + g, the columns past the parts up to the tiles' width (a multiple of
    32) zero; 32: the parts stacked along head_dim (rows p * D / 2 + k), head g in column g."""
    rng = np.random.default_rng(3 + G)
    H, D = 2, 64
    for bf16_q in (False, True):
        q = (rng.standard_normal((H * G, D)) * 7).astype(np.float32)
        if bf16_q:
            q = naive.bf16_values(naive.bf16_bits(q)).astype(np.float32)
        buf = amx_decode.decode_scratch(np.zeros((1, H, 16, D), np.int16), np.zeros((1, H, 16, D), np.int16),
                                        q[None], F32, H, amx_decode.FLAG)
        buf[0][:] = 5 if G % 32 else 0
        npq = amx_decode.prepare_query(q, buf)
        assert npq == (1 if bf16_q else 3)
        for h in range(H):
            bits = buf[0][h].view(np.uint16).astype(np.uint32) << np.uint32(16)
            vals = bits.view(np.float32).astype(np.float64)           # [rows, 2 * cols]: (pair, column, element)
            if G % 32:
                cols = vals.reshape(D // 2, -1, 2).transpose(1, 0, 2).reshape(-1, D)          # [columns, D]
                parts = cols[:npq * G].reshape(npq, G, D)
                assert not cols[npq * G:-(-npq * G // 32) * 32].any()
            else:
                parts = vals.reshape(3, D // 2, G, 2).transpose(0, 2, 1, 3).reshape(3, G, D)  # [part, head, D]
                assert not parts[npq:].any()
            assert np.array_equal(parts.sum(axis=0), q[h * G:(h + 1) * G].astype(np.float64))


def _grid(reduced):
    """(head_dim, group, page_size, window, H, bfloat16 q)."""
    if reduced:
        return [(32, 16, 16, 0, 1, False), (32, 32, 1, 5, 2, True)]
    grid = itertools.product((32, 64, 128), (16, 32), (1, 16, 32, 64), (False, True))
    return [(d, g, p, 7 * (n % 2), 1 + n % 2, b) for n, (d, g, p, b) in enumerate(grid) if not (d == 128 and p == 1)]


def pytest_generate_tests(metafunc):
    if "decode_case" in metafunc.fixturenames:
        reduced = metafunc.config.getoption("--reduced-grid")
        metafunc.parametrize("decode_case", _grid(reduced), ids=lambda c: "d%d-g%d-p%d-w%d-h%d-bf16q%d" % c)


@TILES
def test_grid(decode_case):
    """Decode queries on the tiles, serial / parallel / split: within budget, the same bits on a second call, on
    one thread and on all (the key ranges are cut at absolute positions), and for a query alone as in the batch."""
    D, group, P, window, H, bf16_q = decode_case
    rng = np.random.default_rng(D * 1000 + group * 100 + P * 10 + window + H + bf16_q)
    scene = Scene(rng, D=D, group=group, P=P, lengths=(150, 301), window=window, H=H, bf16_q=bf16_q)
    outs = {}
    for m, split in MODES:
        outs[m, split] = out = scene.run(mode=m, split_tokens=split)
        scene.check(out)
        assert np.array_equal(out, scene.run(mode=m, split_tokens=split))
    assert np.array_equal(outs[1, 0], outs[2, 0])
    for i in range(len(scene.q)):
        assert np.array_equal(scene.run(mode=2, only=[i])[0], outs[2, 0][i])


@TILES
def test_long_contexts_in_pieces_of_the_tiles():
    """Where the tiles take the queries the plan cuts key ranges every AMX_SPLIT_TOKENS (a whole number of
    blocks; other formats and precision="highest" every SPLIT_TOKENS). Contexts of several pieces: within budget,
    the same bits serial and parallel, and for a query alone as in the batch."""
    assert AP.AMX_SPLIT_TOKENS % amx_decode.BLOCK == 0 and AP.AMX_SPLIT_TOKENS > AP.SPLIT_TOKENS
    pos = np.array([3000], np.int64)
    shapes = (np.zeros(1, np.int32), pos, 0, (1, 32, 64), (4, 2, 16, 64))
    assert AP.AttentionPlan(*shapes, "bfloat16").single.split == AP.AMX_SPLIT_TOKENS
    assert AP.AttentionPlan(*shapes, "bfloat16", precision="highest").single.split == AP.SPLIT_TOKENS
    assert AP.AttentionPlan(*shapes, np.float16).single.split == AP.SPLIT_TOKENS
    scene = Scene(np.random.default_rng(13), D=64, group=16, P=32, lengths=(2600, 1100), H=1)
    serial, parallel = scene.run(mode=1), scene.run(mode=2)
    scene.check(serial)
    assert np.array_equal(serial, parallel)
    for i in range(len(scene.q)):
        assert np.array_equal(scene.run(mode=2, only=[i])[0], parallel[i])


@TILES
@pytest.mark.parametrize("D,group,H", [(128, 16, 2), (128, 32, 1), (64, 16, 1)])
def test_score_magnitudes(D, group, H):
    """q and K times 10 (|q.k| ~ 10**3 at head_dim 128), a float32 q: within budget, whole and in partials."""
    rng = np.random.default_rng(D + group + H)
    scene = Scene(rng, D=D, group=group, P=16, lengths=(83, 260), H=H, q_scale=10.0, k_scale=10.0)
    for m, split in MODES:
        scene.check(scene.run(mode=m, split_tokens=split))


@TILES
def test_tiles_taken_from_min_group(monkeypatch):
    """The tiles take groups >= MIN_GROUP (other bits than with $KVENGINE_AMX=0, both within budget); a smaller
    group keeps the per-query path (the same bits with the tiles on and off)."""
    rng = np.random.default_rng(11)
    big = Scene(rng, D=64, group=amx_decode.MIN_GROUP, P=16, lengths=(90, 200))
    small = Scene(rng, D=64, group=amx_decode.MIN_GROUP // 2, P=16, lengths=(90, 200))
    on = [big.run(), small.run()]
    monkeypatch.setenv(amx_tiles.ENV, "0")
    assert not amx_tiles.usable()
    off = [big.run(), small.run()]
    for scene, a, b in ((big, on[0], off[0]), (small, on[1], off[1])):
        scene.check(a)
        scene.check(b)
    assert not np.array_equal(on[0], off[0])
    assert np.array_equal(on[1], off[1])


@TILES
def test_highest_precision_is_not_taken(monkeypatch):
    """precision="highest" (q.k in float64) never takes the tiles, whose sums are float32: its bits are those of
    the per-query kernel's float64 path (the tiles off), in every mode, partials included."""
    scene = Scene(np.random.default_rng(12), D=64, group=amx_decode.MIN_GROUP, P=16, lengths=(90, 300))
    on = [scene.run(mode=m, split_tokens=split, precision="highest") for m, split in MODES]
    default = scene.run()
    monkeypatch.setenv(amx_tiles.ENV, "0")
    off = [scene.run(mode=m, split_tokens=split, precision="highest") for m, split in MODES]
    for a, b in zip(on, off):
        assert np.array_equal(a, b)
    assert not np.array_equal(on[0], default)


def test_no_tiles_without_the_flag():
    """Without FLAG in ``dot`` (or below MIN_GROUP, head_dim not a multiple of 32, float64 q.k) the buffers are
    empty: the per-query kernel keeps its own path."""
    pages = np.zeros((1, 1, 16, 64), np.int16)
    q = np.zeros((1, 32, 64), np.float32)
    flag = amx_decode.FLAG
    assert amx_decode.decode_scratch(pages, pages, q, F32, 1, 1)[0].shape[0] == 0
    assert amx_decode.decode_scratch(pages, pages, q[:, :amx_decode.MIN_GROUP - 1], F32, 1, flag)[0].shape[0] == 0
    odd = np.zeros((1, 1, 16, 48), np.int16)
    assert amx_decode.decode_scratch(odd, odd, np.zeros((1, 32, 48), np.float32), F32, 1, flag)[0].shape[0] == 0
    assert amx_decode.decode_scratch(pages, pages, q, np.float64(0.0), 1, flag)[0].shape[0] == 0
    assert amx_decode.decode_scratch(pages.view(np.uint16), pages.view(np.uint16), q, F32, 1, flag)[0].shape[0] == 0
    if JIT and amx_tiles.HOST:
        assert amx_decode.decode_scratch(pages, pages, q, F32, 1, flag)[0].shape[0] > 0
