"""`OpGroup`: sequence operations undone together (`KVCache.group`).

Each of `create_sequence`, `fork`, `free`, `truncate`, `release_before` and `match_prefix` is atomic on its own;
a caller that needs several of them to land together (a batch of rows forked and freed for a beam reorder, rows
created for a request) runs them inside one group, and a failure anywhere rolls every one of them back: the
cache is then byte for byte what it was, the sequence-id counter included. Only the thread that opened the group
is recorded; a transaction or append inside it keeps its own rollback (the caller rolls it back first). A
group opened inside another one (same thread) hands what it kept to the outer group when it closes.
"""
import threading

from .journal import Journal


class OpGroup:
    """``with cache.group(): ...``: rolled back if the block raises, kept (closed) when it ends. With
    ``span_calls=True`` the group stays open after a block: later ``with group:`` blocks record into it too,
    until `close` (keep everything) or `rollback`."""

    def __init__(self, core, span_calls: bool = False):
        self._core = core
        self.span_calls = span_calls
        self.thread = threading.get_ident()
        self.journal = Journal()
        self.closed = False
        self._outer = None

    def __enter__(self) -> "OpGroup":
        core = self._core
        with core.lock:
            if self.closed:
                raise RuntimeError("group: expected an open group, got one already closed or rolled back")
            outer = core.group
            if outer is not None and outer is not self and outer.thread != self.thread:
                raise RuntimeError("group: expected no group of another thread open on this cache, got one")
            self._outer = outer if outer is not self else None
            core.group = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        core = self._core
        with core.lock:
            if core.group is self:
                core.group = self._outer
        if exc_type is not None:
            self.rollback()
        elif not self.span_calls:
            self.close()

    def rollback(self) -> None:
        """Undo every operation recorded in the group (newest first); the group is closed."""
        core = self._core
        with core.lock:
            self.journal.rollback()
            self.closed = True
            core.clear_freed()

    def close(self) -> None:
        """Keep every recorded operation (an enclosing group takes them over); the group is closed."""
        core = self._core
        with core.lock:
            outer, self._outer = self._outer, None
            if outer is not None and not outer.closed:
                outer.journal.extend(self.journal)
            self.journal.clear()
            self.closed = True
            core.clear_freed()              # the frees of the group are final now
