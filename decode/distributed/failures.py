"""Errors of the distributed decoders (plain exceptions: importing this module imports no ray)."""


class WorkerLostError(RuntimeError):
    """A worker died, or did not answer within the timeout (it is then killed), during a call.

    Attributes
    ----------
    worker : int        index of the lost worker
    holdings : str      what it held: the sequences and, for context sharding, their position ranges; for head
                        sharding, its kv heads
    reason : str        how it was lost (the Ray error, or the timeout)
    committed : bool    True when the worker failed to commit an earlier call that every worker had prepared
                        (decided): that call stands on the others and `recover()` replays it on the rebuilt
                        worker. In every case the current call was rolled back on the other workers (they
                        are byte for byte as before it)
    """

    def __init__(self, worker: int, holdings: str, reason: str, committed: bool = False):
        self.worker, self.holdings, self.reason, self.committed = worker, holdings, reason, committed
        outcome = ("its commit of an earlier, decided call failed: that call stands on the other workers and "
                   "recover() replays it here" if committed
                   else "the call was rolled back on the other workers; recover() rebuilds this one")
        super().__init__(f"worker {worker} lost ({reason}); it held {holdings}; {outcome}")


class NonLoopbackError(RuntimeError):
    """Ray reported an address that is not loopback: nothing is started on it."""
