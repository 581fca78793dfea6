"""The per-query (decode) kernel's walk on AMX tiles for bfloat16 pages (`amx_tiles`; Intel CPUs with AMX-BF16).

A decode query has G q heads per kv head: far fewer rows than a tile's 16, so the parts of the exact bfloat16 split
(`bf16_dot.split3`) are laid side by side instead of one after another along head_dim: the query's columns are
(part, head) = p * G + g (3 G columns for a float32 q, G for a bfloat16 one), the softmax's weights the rows p * G +
g of the PV operand. Each tile product is then of exact bfloat16 numbers (exact in float32), and a score, or an
output element, is the float32 sum of its parts' sums: per kv head and block of keys

    ST [nb, cols]      =  K_block . QA          (`amx_tiles.amx_scores`; K in place where whole 16-key groups lie
                                                  in a page, else staged)
    W [nb, G]          =  the sum over parts of ST's columns, then the online softmax over keys x heads (unscaled
                          running max m, sum l; O's rows of head g rescaled with it), exp((W - max) * scale): a
                          whole row of 16 heads per 512-bit op (`tile_softmax`)
    PA [3 G, nb]       <- the weights, 16 keys x 16 heads at a time transposed in registers and split into three
                          exact parts, rows p * G + g (`tile_softmax.head_parts`)
    O [3 G, Dv]        += PA . V_block's key pairs (`amx_tiles.amx_pv`; a unit's first block from zero tiles)

and the output row of head g is (O[g] + O[G + g] + O[2 G + g]) / l[g]. Where G is a multiple of 32 (the heads
alone fill whole tiles) the query's parts are stacked along head_dim instead (`stacked`) and the tile unit sums
them: no parts' sum in W. Against the per-query kernel's widening
path the tile products replace 2 x head_dim FMA lanes per key and q head: 3 to 12 times fewer instructions for
groups of 4 to 32 q heads. The only roundings are float32 additions (the accuracy rule's budget holds: `tests/
decode/test_amx_decode.py`); the bits differ from the other paths' (and are the same on every call and thread
count: the blocks are cut at absolute multiples of BLOCK, as the units are). Only groups of >= MIN_GROUP q heads
per kv head take the tiles: below, the per-query kernel's FMAs measured faster (docs/kernel.md, "AMX tiles").

    FLAG                         the bit the plan sets in the per-query kernel's ``dot`` where the tiles run
    MIN_GROUP                    q heads per kv head from which the tiles take a query (measured)
    shapes_fit(G, D, Dv)         whether the tiles take these shapes (the plan asks too: `AMX_SPLIT_TOKENS`)
    takes_tiles(k_pages, v_pages, q, acc0, H, dot)  whether a call's queries take the tiles
    decode_scratch(k_pages, v_pages, q, acc0, H, dot)  the buffers, empty where they do not
    prepare_query(qi, buf)       pack a query's columns for every kv head; returns its parts (1 or 3)
    attend_query(k_pages, v_pages, pages, lo, hi, scale, npq, buf, out_i, w, wm, wl, wacc)
                                 one unit (a query over keys [lo, hi)): every kv head, into out_i (w < 0) or the
                                 partial slot w (wacc by dim: `per_query.paired_partials` tells the merge)
"""
import numpy as np
from numba import njit, types

from .amx_blocks import stage_keys, value_pairs
from .amx_tiles import HOST, amx_pv, amx_scores, tile_config
from .bf16_dot import exactly_bf16, split3
from .tile_softmax import block_softmax
from .simd import FAST, JIT, borrow, zeros64

FLAG = 8            # `dot`'s bit for the tiles; its low bits stay the `bf16_dot` mode of the other paths
MIN_GROUP = 16      # q heads per kv head from which the tiles are faster (measured: docs/kernel.md, "AMX tiles")
BLOCK = 128         # keys per block (a multiple of 32), cut at absolute multiples


def _cols(n):
    """n rounded up to whole tiles of 32 (the 2 x 2 C tiles)."""
    return -(-n // 32) * 32


def _cols16(n):
    """n rounded up to a multiple of 16 (the 16 x 16 transposes)."""
    return -(-n // 16) * 16


def _buffers(H, D, Dv, G, use):
    """(QA, Kt, ST [BLOCK, R + 16], W [BLOCK, G16], PA [R, BLOCK], VB [BLOCK / 2, Dv], O [H, R, Dv], m [H, G], l
    [H, G], cfg, red [3, G16]) for H kv heads of G q heads (R = 3 G rounded up to 32, G16 = G rounded up to 16; QA
    [H, D / 2, 2 R] with the parts side by side, [H, 3 D / 2, 2 G] `stacked` where G is a multiple of 32; ST's 16
    more columns: `block_softmax` reads whole vectors of heads); empty unless ``use``."""
    if not use:
        H = 0
        G = 0
        D = 0
        Dv = 0
    R = _cols(3 * G)
    nb = BLOCK if use else 0
    qrows, qcols = (3 * (D // 2), 2 * G) if G % 32 == 0 else (D // 2, 2 * R)    # `stacked` / side by side
    return (zeros64(H * qrows, qcols, np.zeros(0, np.int16)).reshape((H, qrows, qcols)),
            zeros64(nb, D, np.zeros(0, np.int16)), zeros64(nb, R + 16, np.zeros(0, np.float32)),
            np.zeros((nb, _cols16(G)), np.float32), zeros64(R, nb, np.zeros(0, np.int16)),
            zeros64(nb // 2, Dv, np.zeros(0, np.uint32)),
            zeros64(H * R, Dv, np.zeros(0, np.float32)).reshape((H, R, Dv)), np.zeros((H, G), np.float32),
            np.zeros((H, G), np.float32), tile_config(), np.zeros((3, _cols16(G)), np.float32))


def takes_tiles(k_pages, v_pages, q, acc0, H, dot):
    """Whether queries q [N, H * G, D] take the tiles: bfloat16 pages (int16 bits), float32 q and q.k (acc0: a zero
    of the accumulation dtype; float64 for precision="highest", which the tiles cannot give), ``dot`` has FLAG,
    G >= MIN_GROUP, D and Dv multiples of 32; compiled, also that the build target has AMX (HOST)."""
    return (k_pages.dtype == np.int16 and q.dtype == np.float32 and np.asarray(acc0).dtype == np.float32
            and _fits(v_pages, q, H, dot))


def shapes_fit(G, D, Dv):
    """Whether the tiles take these shapes: G >= MIN_GROUP q heads per kv head, head_dim D and Dv multiples of 32."""
    return G >= MIN_GROUP and D % 32 == 0 and Dv % 32 == 0


def _fits(v_pages, q, H, dot):
    """`takes_tiles`' shape and flag conditions."""
    return (dot & FLAG) != 0 and shapes_fit(q.shape[1] // H, q.shape[2], v_pages.shape[3])


def decode_scratch(k_pages, v_pages, q, acc0, H, dot):
    """The tiles' buffers where `takes_tiles`, else empty ones (the first's shape[0] == 0)."""
    return _buffers(H, q.shape[2], v_pages.shape[3], q.shape[1] // H, takes_tiles(k_pages, v_pages, q, acc0, H, dot))


def prepare_query(qi, buf):
    """Pack one query qi [H * G, D] float32 for every kv head (`pack_columns` into buf's QA); returns its parts:
    1 where every element is a bfloat16 (a bfloat16 model's q), else 3."""
    QA = buf[0]
    H = QA.shape[0]
    G = qi.shape[0] // H
    npq = 1 if exactly_bf16(qi.view(np.uint32)) else 3
    for h in range(H):
        pack_columns(qi, h, G, npq, QA[h], _cols(npq * G), stacked(QA, qi.shape[1]))
    return npq


def stacked(QA, D):
    """Whether the query's parts are stacked along head_dim (rows p * D / 2 + k of QA, column g: G a multiple of
    32, the tiles' columns full without laying the parts side by side; the tile unit then sums the parts) rather
    than side by side (columns p * G + g)."""
    return QA.shape[-2] == 3 * (D // 2)


def pack_columns(qi, h, G, npq, QA, R, stack):
    """QA's uint32 view [D / 2, >= R]: column p * G + g holds part p (< npq) of q head h * G + g, elements 2k (low
    half) and 2k + 1 (high half) in row k; columns npq * G .. R zero. stack (`stacked`): part p in rows p * D / 2
    + k, column g, instead. The split: `bf16_dot.split3` (exact)."""
    packed = QA.view(np.uint32)
    hm = np.uint32(0xFFFF0000)
    s16 = np.uint32(16)
    half = qi.shape[1] // 2
    for g in range(G):
        x = qi[h * G + g]
        u = x.view(np.uint32)
        for k in range(half):
            a0, b0, c0 = split3(x[2 * k], u[2 * k])
            a1, b1, c1 = split3(x[2 * k + 1], u[2 * k + 1])
            packed[k, g] = (a0 >> s16) | a1
            if npq == 3 and stack:
                packed[half + k, g] = (b0 >> s16) | (b1 & hm)
                packed[2 * half + k, g] = (c0 >> s16) | (c1 & hm)
            elif npq == 3:
                packed[k, G + g] = (b0 >> s16) | (b1 & hm)
                packed[k, 2 * G + g] = (c0 >> s16) | (c1 & hm)
    if not stack:
        for k in range(half):
            for c in range(npq * G, R):
                packed[k, c] = 0


def store_head(O, l, m, G, h, out_i, w, wm, wl, wacc):
    """Head group h's result: out_i[h * G + g] = (O[g] + O[G + g] + O[2 G + g]) / l[g] (w < 0), or the partial
    (m, l, the sum) at slot w, by dim (not in the pair order of the other bfloat16 paths: the merge is told,
    `per_query.paired_partials`)."""
    Dv = O.shape[1]
    for g in range(G):
        if w < 0:
            inv = 1.0 / l[g]
            for d in range(Dv):
                out_i[h * G + g, d] = (O[g, d] + O[G + g, d] + O[2 * G + g, d]) * inv
        else:
            wm[w, h, g] = m[g]
            wl[w, h, g] = l[g]
            for d in range(Dv):
                wacc[w, h, g, d] = O[g, d] + O[G + g, d] + O[2 * G + g, d]


def attend_query(k_pages, v_pages, pages, lo, hi, scale, npq, buf, out_i, w, wm, wl, wacc):
    """Attention of one query (packed by `prepare_query`, npq its parts) over the keys [lo, hi) of its sequence
    (`pages`: its page row): blocks of BLOCK keys (cut at absolute multiples), each over every kv head in turn (the
    walk reads a page's heads one after another), on the tiles; then `store_head` per head. buf: `decode_scratch`'s
    buffers."""
    QA, Kt, ST, W, PA, VB, O, m, l, cfg, red = buf
    QA, Kt, ST, W, PA, VB, O, m, l, cfg, red = (borrow(QA), borrow(Kt), borrow(ST), borrow(W), borrow(PA), borrow(VB),
                                                borrow(O), borrow(m), borrow(l), borrow(cfg), borrow(red))
    k_pages, v_pages, pages = borrow(k_pages), borrow(v_pages), borrow(pages)
    H = k_pages.shape[1]
    G = m.shape[1]
    Dv = v_pages.shape[3]
    stack = stacked(QA, k_pages.shape[3])
    R = G if stack else _cols(npq * G)      # the score tiles' columns, and the parts the tile unit sums
    tp = npq if stack else 1
    cp = 1 if stack else npq                # the parts `block_softmax` sums
    Rs = O.shape[1]
    PA1 = PA.reshape((1, PA.shape[0], PA.shape[1]))
    b0 = lo
    while b0 < hi:
        b1 = min(hi, (b0 // BLOCK + 1) * BLOCK)
        nb = b1 - b0
        nbp = _cols(nb)
        for h in range(H):
            Oh = O[h]
            stage_keys(k_pages, pages, h, b0, nb, Kt)
            amx_scores(k_pages, pages, h, b0, nb, Kt, QA[h], tp, ST, R, cfg)
            block_softmax(cp, G, nb, nbp, ST, W, PA, red, m[h], l[h], Oh, b0 == lo, scale)
            value_pairs(v_pages, pages, h, b0, nb, VB)
            amx_pv(PA1, 1, VB, Oh, Rs, nbp, Dv, b0 == lo, cfg)
        b0 = b1
    for h in range(H):
        store_head(O[h], l[h], m[h], G, h, out_i, w, wm, wl, wacc)


if JIT:
    from numba.extending import overload

    _cols = njit(inline="always")(_cols)
    _cols16 = njit(inline="always")(_cols16)
    _buffers = njit(cache=True)(_buffers)
    pack_columns = njit(cache=True)(pack_columns)        # no fastmath: x - hi must be the exact difference
    stacked = njit(inline="always")(stacked)
    store_head = njit(cache=True, fastmath=FAST)(store_head)
    _attend_jit = njit(cache=True, fastmath=FAST)(attend_query) if HOST else None

    def _bf16_f32(k_pages, q):
        return isinstance(k_pages, types.Array) and k_pages.dtype == types.int16 and q.dtype == types.float32

    shapes_fit = njit(inline="always")(shapes_fit)
    _fits = njit(inline="always")(_fits)

    @overload(takes_tiles, inline="always")
    def _takes_tiles_ov(k_pages, v_pages, q, acc0, H, dot):
        if HOST and _bf16_f32(k_pages, q) and acc0 == types.float32:
            return lambda k_pages, v_pages, q, acc0, H, dot: _fits(v_pages, q, H, dot)
        return lambda k_pages, v_pages, q, acc0, H, dot: False

    @overload(decode_scratch)
    def _decode_scratch_ov(k_pages, v_pages, q, acc0, H, dot):
        def impl(k_pages, v_pages, q, acc0, H, dot):
            if takes_tiles(k_pages, v_pages, q, acc0, H, dot):
                return _buffers(H, q.shape[2], v_pages.shape[3], q.shape[1] // H, True)
            return _buffers(0, 0, 0, 0, False)
        return impl

    @overload(attend_query, inline="always")
    def _attend_query_ov(k_pages, v_pages, pages, lo, hi, scale, npq, buf, out_i, w, wm, wl, wacc):
        if HOST and _bf16_f32(k_pages, out_i):
            return lambda k_pages, v_pages, pages, lo, hi, scale, npq, buf, out_i, w, wm, wl, wacc: _attend_jit(
                k_pages, v_pages, pages, lo, hi, scale, npq, buf, out_i, w, wm, wl, wacc)
        return lambda k_pages, v_pages, pages, lo, hi, scale, npq, buf, out_i, w, wm, wl, wacc: None

    _prepare_jit = njit(cache=True)(prepare_query)      # no fastmath: the split

    @overload(prepare_query, inline="always")
    def _prepare_query_ov(qi, buf):
        if qi.dtype == types.float32 and buf[0].dtype == types.int16:
            return lambda qi, buf: _prepare_jit(qi, buf)
        return lambda qi, buf: 0
