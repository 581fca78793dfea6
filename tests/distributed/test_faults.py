"""Faults across workers: a worker killed between steps and during a step (a fault hook holds the step open
while the test kills the process), an error raised inside a worker, a timeout, a loss while committing.
After each: the named error (`WorkerLostError` naming the worker and what it held, or the single-process
exception), the other workers byte for byte as before (fingerprints), nothing hangs (bounded time), then
recovery (log replay, or a checkpoint + the log) and decoding resumes with the single-process results."""
import os
import signal
import threading
import time

import numpy as np
import pytest

pytest.importorskip("ray")

from decode import Decoder, batch_step  # noqa: E402
from decode.distributed import DecoderPool, ShardedDecoder, WorkerLostError, ray_processes  # noqa: E402
from decode.distributed import start_local_ray, stop_local_ray  # noqa: E402
from kvcache import KVCache  # noqa: E402
from kvcache.errors import InjectedFault  # noqa: E402
from kvcache.faults import FaultInjector  # noqa: E402
from kvcache.testing import set_fault_hook  # noqa: E402

from .workload import CALL_TIMEOUT_S  # noqa: E402

ARGS = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4, max_tokens=32)
BOUND_S = 15.0          # a loss is reported well within this (the timeout test's timeout is 3 s)


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    start_local_ray()
    yield
    assert stop_local_ray() == []
    assert ray_processes() == []


def draw(rng, tokens=None):
    lead = () if tokens is None else (tokens,)
    return (rng.standard_normal(lead + (4, 8)), rng.standard_normal(lead + (2, 8)), rng.standard_normal(lead + (2, 8)))


class Twin:
    """A sharded decoder and its single-process twin fed the same tokens (20 to start: with context sharding
    worker 0 holds positions 0..15, worker 1 16..19)."""

    def __init__(self, shard, seed=0, **kw):
        self.rng = np.random.default_rng(seed)
        self.sharded = ShardedDecoder(workers=2, shard=shard, **ARGS, **{"timeout": CALL_TIMEOUT_S, **kw})
        self.single = Decoder(**ARGS)
        self.exact = shard == "heads"
        self.both("extend", *draw(self.rng, 20))

    def both(self, method, *args):
        got, want = getattr(self.sharded, method)(*args), getattr(self.single, method)(*args)
        if self.exact:
            assert np.array_equal(got, want)
        else:
            assert np.allclose(got, want, rtol=4e-5, atol=4e-6)
        return got

    def resume(self, steps=4):
        """Decoding resumes: more steps equal the single process's, and the K/V bytes are equal."""
        for _ in range(steps):
            self.both("step", *draw(self.rng))
        assert self.sharded.length == self.single.length
        for a, b in zip(self.sharded.kv(), self.single.kv()):
            assert np.array_equal(a, b)


@pytest.fixture(params=["heads", "context"])
def twin(request):
    t = Twin(request.param)
    yield t
    pids = t.sharded.worker_pids
    t.sharded.close()
    assert not any(pid in [p for p, _ in ray_processes()] for pid in pids)      # close() ended the workers


def lost_error(call, *args):
    start = time.monotonic()
    with pytest.raises(WorkerLostError) as info:
        call(*args)
    assert time.monotonic() - start < BOUND_S
    return info.value


def test_worker_killed_between_steps(twin):
    survivor = twin.sharded.worker_states()[0]
    twin.sharded.kill_worker(1)
    err = lost_error(twin.sharded.step, *draw(twin.rng))
    assert err.worker == 1 and not err.committed and "worker 1 lost" in str(err)
    assert ("kv heads [1, 2)" if twin.exact else "sequence 0: positions [16, 20)") in err.holdings
    assert twin.sharded.worker_states(survivors_only=True) == {0: survivor}
    lost_error(twin.sharded.kv)                              # every later call names it too, sending nothing
    assert twin.sharded.recover() == [1]
    twin.resume()


def kill_when_held(path, pids):
    """Kill the worker that wrote ``path`` (from inside the held step) with SIGKILL."""
    deadline = time.monotonic() + BOUND_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    pid = int(open(path).read())
    assert pid in pids
    os.kill(pid, signal.SIGKILL)


def test_worker_killed_during_a_step(twin, tmp_path):
    before = twin.sharded.worker_states()
    marker = str(tmp_path / "held")
    twin.sharded.set_fault(1, "hold", (marker, 60.0))
    killer = threading.Thread(target=kill_when_held, args=(marker, twin.sharded.worker_pids))
    killer.start()
    err = lost_error(twin.sharded.step, *draw(twin.rng))
    killer.join()
    assert err.worker == 1 and "died" in err.reason and not err.committed
    assert twin.sharded.worker_states(survivors_only=True) == {0: before[0]}   # worker 0 rolled back its write
    assert twin.sharded.length == twin.single.length == 20
    assert twin.sharded.recover() == [1]
    twin.resume()


def test_error_inside_a_worker_is_the_single_process_error(twin):
    before = twin.sharded.worker_states()
    q, k, v = draw(twin.rng)
    writer = 0 if twin.exact else 1                          # context: position 20 is on worker 1
    twin.sharded.set_fault(writer, "inject", 0)              # the first fault point of the next step
    with pytest.raises(InjectedFault) as got:
        twin.sharded.step(q, k, v)
    if twin.exact:                                           # head shard 0 runs the single process's operations
        set_fault_hook(twin.single.cache, FaultInjector(fail_at=0))
        with pytest.raises(InjectedFault) as want:
            twin.single.step(q, k, v)
        set_fault_hook(twin.single.cache, FaultInjector())
        assert (type(got.value), str(got.value)) == (type(want.value), str(want.value))
    assert str(got.value).startswith("injected fault #0 at ")
    assert twin.sharded.worker_states() == before            # both workers as before: nothing to recover
    twin.resume()


def test_a_worker_that_does_not_answer_times_out(tmp_path):
    t = Twin("heads", seed=3, timeout=3.0)
    try:
        before = t.sharded.worker_states()
        t.sharded.set_fault(0, "hold", (str(tmp_path / "held"), 60.0))
        err = lost_error(t.sharded.step, *draw(t.rng))
        assert err.worker == 0 and "timeout" in err.reason
        assert t.sharded.worker_states(survivors_only=True) == {1: before[1]}
        assert t.sharded.recover() == [0]
        t.resume()
    finally:
        t.sharded.close()


def test_a_loss_while_committing_keeps_the_decided_step(twin):
    twin.sharded.set_fault(1, "exit_in_commit")
    twin.both("step", *draw(twin.rng))                       # every worker prepared: the step is decided
    err = lost_error(twin.sharded.step, *draw(twin.rng))     # its commit runs first in the next call: it dies
    assert err.worker == 1 and "died" in err.reason          # that next call was rolled back on worker 0
    assert twin.sharded.length == twin.single.length == 21
    assert twin.sharded.recover() == [1]                     # the log replays the decided step on the new worker
    twin.resume()


def test_a_commit_that_raises_inside_a_worker_is_a_loss(twin):
    writer = 0 if twin.exact else 1
    twin.sharded.set_fault(writer, "inject_at", "publish")   # the commit's fault point
    twin.both("step", *draw(twin.rng))                       # prepared everywhere: decided
    err = lost_error(twin.sharded.kv)
    assert err.worker == writer and err.committed and "its commit raised InjectedFault" in err.reason
    assert "that call stands on the other workers" in str(err)
    assert twin.sharded.recover() == [writer]                # rebuilt with the decided step
    twin.resume()


def test_checkpoint_then_recovery_restores_the_bytes(twin, tmp_path):
    paths = twin.sharded.checkpoint(tmp_path)
    assert [os.path.basename(p) for p in paths] == ["worker-0-1.kv", "worker-1-1.kv"]
    before = twin.sharded.worker_states()
    twin.sharded.kill_worker(0)
    lost_error(twin.sharded.step, *draw(twin.rng))
    assert twin.sharded.recover() == [0]
    assert twin.sharded.worker_states()[0]["content"] == before[0]["content"]    # the snapshot's bytes exactly
    twin.resume(2)
    paths = twin.sharded.checkpoint(tmp_path)                # a second checkpoint replaces the first
    assert sorted(os.listdir(tmp_path)) == ["worker-0-2.kv", "worker-1-2.kv"]
    twin.resume(2)                                           # logged after the checkpoint
    twin.sharded.kill_worker(1)
    lost_error(twin.sharded.step, *draw(twin.rng))
    assert twin.sharded.recover() == [1]                     # snapshot + the two logged steps
    twin.resume()


def test_pool_loss_names_the_sequences_and_spares_the_other_worker():
    rng = np.random.default_rng(4)
    cache = KVCache(num_kv_heads=2, head_dim=8, page_size=4, max_tokens=64)
    with DecoderPool(workers=2, timeout=CALL_TIMEOUT_S, **dict(ARGS, max_tokens=64)) as pool:
        seqs = [pool.new_sequence() for _ in range(3)]       # workers 0, 1, 0
        single = [Decoder.on_cache(cache, 4) for _ in range(3)]
        q, k, v = draw(rng, 3)
        assert np.array_equal(pool.batch_step(seqs, q, k, v), batch_step(single, q, k, v))
        before = pool.worker_states()
        pool.kill_worker(1)
        err = lost_error(pool.batch_step, seqs, *draw(rng, 3))
        assert err.worker == 1 and err.holdings == "sequences [1]"
        assert pool.worker_states(survivors_only=True) == {0: before[0]}
        on_zero = [seqs[0], seqs[2]]                         # the other worker's sequences go on
        q, k, v = draw(rng, 2)
        assert np.array_equal(pool.batch_step(on_zero, q, k, v), batch_step([single[0], single[2]], q, k, v))
        assert pool.new_sequence().worker == 0               # new sequences avoid the lost worker
        assert pool.recover() == [1]
        q, k, v = draw(rng, 2)
        assert np.array_equal(pool.batch_step(seqs[:2], q, k, v), batch_step(single[:2], q, k, v))
