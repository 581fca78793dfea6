"""benchmarks.vllm_peer's engine processes measure beside their timed calls: the page walk of a decode step's
pages and a loop of steps beside batch_step, one figure per timed call, recorded per set and summarized by
vllm_compare into the keys the peer section judges (tiny shapes, float32, a few calls: no timing is asserted)."""
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import vllm_peer  # noqa: E402
from benchmarks.vllm_compare import summarize  # noqa: E402

pytest.importorskip("numba")

DECODE = vllm_peer.Case("decode", "MHA-100", 4, 4, 32, 1, 99, 1)
BATCH = vllm_peer.Case("batch", "3x40", 4, 2, 32, 3, 39, 1)
PREFILL = vllm_peer.Case("prefill", "20+8", 4, 2, 32, 1, 20, 8)
PAGE = 32


def run(case, beside=True):
    old = vllm_peer.BESIDE
    vllm_peer.BESIDE = beside
    try:
        return vllm_peer.run_case("engine", case, "float32", ["cold", "hot"], cold_mib=1, page_size=PAGE,
                                  budget=0.001)
    finally:
        vllm_peer.BESIDE = old


def test_decode_step_walks_its_pages_beside_each_timed_call():
    r = run(DECODE)
    pages = math.ceil(DECODE.length / PAGE)
    assert r["walk_bytes"] == pages * 2 * PAGE * DECODE.num_kv_heads * DECODE.head_dim * 4
    for mode in ("cold", "hot"):
        m = r[mode]
        assert m["walk_calls"] == m["calls"] and m["walk_min_s"] <= m["walk_s"]
        assert m["frac_walk"] == pytest.approx(m["walk_s"] / m["median_s"])
        assert m["walk_gb_per_s"] == pytest.approx(r["walk_bytes"] / m["walk_s"] / 1e9)
        assert "loop_s" not in m
    rows = summarize([{"results": [r]}], ["cold", "hot"])
    cold = next(x for x in rows if x["mode"] == "cold")
    assert cold["engine_frac_walk"] == pytest.approx(r["cold"]["frac_walk"])
    assert (cold["q_per_kv"], cold["length"]) == (1, DECODE.length)


def test_batch_step_times_a_checked_loop_of_steps_beside_it():
    r = run(BATCH)
    assert r["loop_rel_err"] <= vllm_peer.TOLERANCE["float32"]
    for mode in ("cold", "hot"):
        m = r[mode]
        assert m["loop_calls"] == m["calls"]
        assert m["loop_over_batch"] == pytest.approx(m["loop_s"] / m["median_s"])
        assert "walk_s" not in m
    row = next(x for x in summarize([{"results": [r]}], ["cold", "hot"]) if x["mode"] == "hot")
    assert row["loop_over_batch"] == pytest.approx(r["hot"]["loop_over_batch"])
    assert row["length"] == BATCH.length


@pytest.mark.parametrize("case,beside", [(PREFILL, True), (DECODE, False)], ids=["prefill", "no-beside"])
def test_nothing_beside_for_prefill_or_when_turned_off(case, beside):
    r = run(case, beside)
    rows = summarize([{"results": [r]}], ["cold", "hot"])
    assert not any(k in r[m] for m in ("cold", "hot") for k in ("walk_s", "loop_s", "frac_walk"))
    assert not any("engine_frac_walk" in x or "q_per_kv" in x for x in rows)


@pytest.mark.parametrize("case,alternates", [(DECODE, True), (BATCH, False)], ids=["walk", "loop"])
def test_walks_alternate_with_the_timed_calls_and_loops_follow_them(monkeypatch, case, alternates):
    """The page walk runs before every timed call; the loop of steps (one thread: the other core idles, and the next
    batch_step measured ~25% slower after such a gap) only after the mode's timed calls, as many times."""
    from benchmarks.peer_impls import Engine
    events = []
    call, alongside = Engine.call, Engine.alongside
    monkeypatch.setattr(Engine, "call", lambda self, copy: (events.append("call"), call(self, copy))[1])
    monkeypatch.setattr(Engine, "alongside", lambda self, copy: (events.append("beside"), alongside(self, copy))[1])
    r = run(case)
    seq = "".join("c" if e == "call" else "b" for e in events)
    cold, hot = r["cold"]["calls"], r["hot"]["calls"]           # hot is timed last; two warm-up calls first
    if alternates:
        assert seq.endswith("bc" * (2 + hot))
    else:
        assert seq.endswith("c" * cold + "b" * cold + "c" * (2 + hot) + "b" * hot)
