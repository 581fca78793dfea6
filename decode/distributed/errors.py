"""Errors of the distributed decoders (plain exceptions: importing this module imports no ray)."""


class WorkerLostError(RuntimeError):
    """A worker died, or did not answer within the timeout (it is then killed), during a call.

    Attributes
    ----------
    worker : int        index of the lost worker
    holdings : str      what it held: the sequences and, for context sharding, their position ranges; for head
                        sharding, its kv heads
    reason : str        how it was lost (the Ray error, or the timeout)
    committed : bool    False: the call was rolled back on every other worker (they are as before the call);
                        True: it was lost while committing, after every worker had prepared, so the call took
                        effect on the others and `recover()` replays it on the rebuilt worker
    """

    def __init__(self, worker: int, holdings: str, reason: str, committed: bool = False):
        self.worker, self.holdings, self.reason, self.committed = worker, holdings, reason, committed
        outcome = ("the call was committed on the other workers; recover() rebuilds this one with it" if committed
                   else "the call was rolled back on the other workers; recover() rebuilds this one")
        super().__init__(f"worker {worker} lost ({reason}); it held {holdings}; {outcome}")


class NonLoopbackError(RuntimeError):
    """Ray reported an address that is not loopback: nothing is started on it."""
