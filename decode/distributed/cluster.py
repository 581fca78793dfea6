"""The driver's side of the workers: one Ray actor per `Shard`, calls in parallel with a deadline, lost workers,
and the log that rebuilds a lost worker.

Every ``ray.get`` has a timeout. A worker that dies (Ray reports `RayActorError`) or does not answer before
the deadline (it is then killed) is *lost*: the call raises `WorkerLostError` naming it and what it held, and
every later call raises it again before sending anything, until `Cluster.recover` rebuilds the worker. An
exception raised inside a worker reaches the caller as the same exception (type and message), not wrapped.

Recovery: the cluster keeps, per worker, the log of the operations committed on it (sequence creation, forks,
truncations, frees, and the storage-dtype K/V of every committed write). `recover` starts a fresh actor with
the same configuration, which allocates its own pool, and replays the log: the same writes in the same order
give the same K/V at every position, so decoding resumes with identical results. The log costs driver memory
equal to the K/V sent to the workers (documented in docs/distributed.md).
"""
import itertools
import os
import time

import numba
import psutil
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from .failures import WorkerLostError
from .runtime import check_loopback, start_local_ray, stop_local_ray
from .shard import Shard

START_TIMEOUT_S = 120.0
_live_clusters = {"count": 0, "own_ray": False}


class Failure:
    """An exception raised inside a worker, carried back by value: `rebuild` gives the same type, message
    (``args``) and attributes."""

    def __init__(self, error: BaseException):
        self.type, self.args, self.attributes = type(error), error.args, dict(vars(error))

    def rebuild(self) -> BaseException:
        error = self.type.__new__(self.type)
        error.args = self.args
        vars(error).update(self.attributes)
        return error


class CommitFailure(Failure):
    """A deferred commit raised inside the worker: its pool no longer matches the decided state."""


class ShardServer:
    """The actor: a `Shard` built inside the worker process (its pool is allocated there), numba limited to the
    worker's CPU share."""

    def __init__(self, kind: str, config: dict, threads: int):
        numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
        self.shard = Shard(kind, config)

    def call(self, method: str, *args):
        """``shard.method(*args)``; an exception comes back as a `Failure` (not raised: Ray would wrap it, and
        exceptions whose constructor takes other arguments than their message do not survive pickling)."""
        try:
            return getattr(self.shard, method)(*args)
        except Exception as e:                                     # noqa: BLE001 (sent back to the caller)
            return Failure(e)

    def call_after(self, commits: list, method: str, *args):
        """Commit the transactions ``commits`` (decided earlier, see `Cluster.commit_later`), then `call`; a
        failed commit returns `CommitFailure` (and the call is not made)."""
        for txid in commits:
            try:
                self.shard.commit(txid)
            except Exception as e:                                 # noqa: BLE001 (sent back to the caller)
                return CommitFailure(e)
        return self.call(method, *args)


_Actor = ray.remote(max_restarts=0, max_task_retries=0)(ShardServer)


class Cluster:
    """``len(configs)`` workers of one kind (see `Shard`); ``describe(i)`` tells what worker i holds."""

    def __init__(self, kind: str, configs: list[dict], *, timeout: float, describe):
        if not ray.is_initialized():
            start_local_ray()
            _live_clusters["own_ray"] = True
        else:
            check_loopback()
        _live_clusters["count"] += 1
        self.kind, self.configs, self.timeout, self.describe = kind, configs, float(timeout), describe
        # the CPU share sets the worker's numba threads; the actors reserve no CPU in Ray's scheduler (several
        # decoders may share a machine's workers; a reservation would leave later actors pending forever)
        self.cpus = float(ray.cluster_resources().get("CPU", 1)) / len(configs)
        self.actors, self.pids = [None] * len(configs), [None] * len(configs)
        self.logs = [[] for _ in configs]                          # committed operations since the checkpoint
        self.checkpoints: list = [None] * len(configs)             # (path, sequences) of the last checkpoint
        self.lost: dict[int, str] = {}
        self.deferred: dict[int, list] = {}                        # worker -> decided txids not yet delivered
        self.lost_committing: set[int] = set()                     # lost while a decided commit was due
        self._txids = itertools.count()
        self._generation = 0
        self.closed = False
        try:
            for i in range(len(configs)):
                self.actors[i] = self._start(i)
            try:
                states = ray.get([a.call.remote("state") for a in self.actors], timeout=START_TIMEOUT_S)
            except GetTimeoutError:
                raise RuntimeError(f"workers: expected {len(configs)} workers started within {START_TIMEOUT_S:g} s, "
                                   f"got a timeout") from None
            for i, state in enumerate(states):
                self.pids[i] = state["pid"]
            check_loopback()                                       # the workers' sockets too
        except BaseException:
            self.close()
            raise

    def _start(self, i: int):
        return _Actor.options(num_cpus=0).remote(self.kind, self.configs[i], max(1, int(self.cpus)))

    def new_txid(self) -> int:
        return next(self._txids)

    # -- calls ----------------------------------------------------------------------------------------------
    def require(self, workers=None) -> None:
        """`WorkerLostError` if one of ``workers`` (None: all) was lost earlier (nothing is sent); RuntimeError
        once closed."""
        if self.closed:
            raise RuntimeError("decoder: expected an open decoder, got one that was closed")
        for i, reason in sorted(self.lost.items()):
            if workers is None or i in workers:
                raise WorkerLostError(i, self.describe(i), f"lost earlier: {reason}; call recover()",
                                      i in self.lost_committing)

    def gather(self, calls: dict[int, tuple], timeout: float | None = None):
        """Send ``calls[i] = (method, *args)`` to worker i, all at once; wait with one deadline.

        Returns ``(results, errors, lost)``: results by worker, the exceptions raised inside workers (unwrapped)
        and the reasons of the workers lost in this call (killed on a timeout)."""
        refs = {}
        for i, call in calls.items():
            commits = self.deferred.pop(i, None)
            refs[i] = (self.actors[i].call_after.remote(commits, *call) if commits
                       else self.actors[i].call.remote(*call))
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        results, errors, lost = {}, {}, {}
        for i, ref in refs.items():
            try:
                result = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                if isinstance(result, CommitFailure):
                    error = result.rebuild()
                    lost[i] = f"its commit raised {type(error).__name__}: {error}; killed"
                    self.lost_committing.add(i)
                    ray.kill(self.actors[i], no_restart=True)
                elif isinstance(result, Failure):
                    errors[i] = result.rebuild()
                else:
                    results[i] = result
            except RayTaskError as e:
                errors[i] = e.cause if isinstance(e.cause, BaseException) else e
            except RayActorError as e:
                lost[i] = f"died: {type(e).__name__}"
            except GetTimeoutError:
                lost[i] = f"no answer within the {self.timeout:g} s timeout; killed"
                ray.kill(self.actors[i], no_restart=True)
        self.lost.update(lost)
        return results, errors, lost

    def call_all(self, calls: dict[int, tuple]) -> dict:
        """`gather`, raising the first loss (`WorkerLostError`) or the first worker exception."""
        results, errors, lost = self.gather(calls)
        raise_first(self, errors, lost)
        return results

    def states(self, survivors_only: bool = False) -> dict[int, dict]:
        """`Shard.state` of every worker (``survivors_only``: of the workers not lost; none is rebuilt)."""
        self.require([] if survivors_only else None)
        return self.call_all({i: ("state",) for i in range(len(self.actors)) if i not in self.lost})

    def ping(self, payload=None) -> None:
        """One round trip to every worker at once, ``payload`` there and back (measurements)."""
        self.require()
        self.call_all({i: ("ping", payload) for i in range(len(self.actors))})

    def commit_later(self, workers, txid: int) -> None:
        """The second phase of a call whose outcome is decided (every worker prepared): the commit travels
        with the next call to each worker (`ShardServer.call_after`), which runs it first; Ray keeps one
        caller's calls to an actor in order, so every later call sees it committed. A worker lost before it
        committed is rebuilt by `recover` from the log, which has the decided call; one whose commit raises
        is killed and reported (``committed=True``) by that next call."""
        for w in workers:
            self.deferred.setdefault(w, []).append(txid)

    def log(self, i: int, op: tuple) -> None:
        self.logs[i].append(op)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def kill(self, i: int) -> None:
        """Kill worker i now and wait (bounded) until its process is gone (tests; the next call finds it dead and
        reports it lost). `ray.kill` is asynchronous: without the wait a call sent at once may still run."""
        ray.kill(self.actors[i], no_restart=True)
        deadline = time.monotonic() + 10.0
        while self.pids[i] is not None and _alive(self.pids[i]) and time.monotonic() < deadline:
            time.sleep(0.02)

    def checkpoint(self, directory: str) -> list[str]:
        """Every worker snapshots its pool into ``directory`` (a new file per checkpoint; on a cluster it must be
        storage the replacement worker can read); the logs restart empty. All or nothing: if a worker fails,
        the previous checkpoint and logs stay in force. Returns the paths."""
        self.require()
        self._generation += 1
        paths = {i: os.path.join(os.fspath(directory), f"worker-{i}-{self._generation}.kv")
                 for i in range(len(self.actors))}
        results = self.call_all({i: ("save", path) for i, path in paths.items()})
        for i, path in paths.items():
            old = self.checkpoints[i]
            self.checkpoints[i], self.logs[i] = (path, results[i]), []
            if old is not None and os.path.exists(old[0]):
                os.remove(old[0])
        return [paths[i] for i in sorted(paths)]

    def recover(self) -> list[int]:
        """Rebuild every lost worker from its log (module docstring); returns their indices."""
        if self.closed:
            raise RuntimeError("decoder: expected an open decoder, got one that was closed")
        rebuilt = sorted(self.lost)
        for i in rebuilt:
            self.actors[i] = actor = self._start(i)
            steps = ([("restore",) + tuple(self.checkpoints[i])] if self.checkpoints[i] else []) + [
                ("replay", self.logs[i])]
            for step in steps:
                result = ray.get(actor.call.remote(*step), timeout=START_TIMEOUT_S + self.timeout)
                if isinstance(result, Failure):
                    raise result.rebuild()
            self.pids[i] = ray.get(actor.call.remote("state"), timeout=self.timeout)["pid"]
            del self.lost[i]
            self.lost_committing.discard(i)
            self.deferred.pop(i, None)                 # the log already has the decided calls
        if rebuilt:
            check_loopback()
        return rebuilt

    def close(self) -> None:
        """Kill every worker and wait (bounded) for their processes to exit; stop Ray if this module started it
        and no other cluster is open."""
        if self.closed:
            return
        self.closed = True
        for actor in self.actors:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + 10.0
        for pid in self.pids:
            while pid is not None and _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        _live_clusters["count"] -= 1
        if _live_clusters["count"] == 0 and _live_clusters["own_ray"]:
            _live_clusters["own_ray"] = False
            stop_local_ray()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def raise_first(cluster: Cluster, errors: dict, lost: dict, committed: bool = False) -> None:
    for i, reason in sorted(lost.items()):
        raise WorkerLostError(i, cluster.describe(i), reason, committed or i in cluster.lost_committing)
    for i in sorted(errors):
        raise errors[i]

