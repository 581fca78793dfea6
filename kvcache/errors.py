"""Exceptions of the KV cache.

Input errors are the built-in `ValueError` / `TypeError` (their messages name the argument, what was expected
and what was given); the cache adds only the conditions a caller may want to catch on their own.
"""


class CacheFullError(RuntimeError):
    """The pool has too few free pages for a request; nothing was changed.

    Attributes
    ----------
    pages_needed : int   pages the request would take from the free list
    pages_free : int     pages free when the request was made
    num_pages : int      pages in the whole pool
    could_ever_fit : bool  whether the request fits once other sequences free their pages
    """

    def __init__(self, pages_needed: int, pages_free: int, num_pages: int, could_ever_fit: bool, what: str = ""):
        self.pages_needed = pages_needed
        self.pages_free = pages_free
        self.num_pages = num_pages
        self.could_ever_fit = could_ever_fit
        hint = ("it fits once other sequences free pages" if could_ever_fit
                else f"it can never fit: the pool has only {num_pages} pages")
        prefix = f"{what}: " if what else ""
        super().__init__(f"{prefix}needs {pages_needed} free pages, {pages_free} of {num_pages} are free; {hint}")


class InjectedFault(RuntimeError):
    """Raised by a `kvcache.faults.FaultInjector` at a chosen fault point (tests only)."""


class ScaleOverflowError(ValueError):
    """An input row of an int8 cache holds a value too large for its group's float16 scale
    (``|x| > kvcache.quant.MAX_ABS``); nothing was changed. A ValueError: it is bad input."""


class SnapshotError(ValueError):
    """A snapshot file that cannot be loaded; the message says what is wrong and where."""

    def __init__(self, path, what: str):
        self.path = str(path)
        super().__init__(f"snapshot {self.path}: {what}")


class SnapshotTruncatedError(SnapshotError):
    """The file ends before the data its header announces."""


class SnapshotCorruptError(SnapshotError):
    """The header or a tensor cannot be parsed (not a safetensors file, bad JSON, bad offsets)."""


class SnapshotChecksumError(SnapshotError):
    """A tensor's bytes do not match the sha256 recorded for it (a flipped byte)."""


class SnapshotVersionError(SnapshotError):
    """Not a pagedkv snapshot, or one of another format version."""


class SnapshotConfigError(SnapshotError):
    """The snapshot's cache config is not the one the caller expected (or not a valid config)."""


class SnapshotFormatError(SnapshotError):
    """A tensor is missing or has the wrong dtype or shape for the config."""


class SnapshotRangeError(SnapshotError):
    """A page id, sequence id, length or count outside its valid range."""


class SnapshotInconsistentError(SnapshotError):
    """Parts disagree: reference counts vs page tables, the page partition, the key chains, token ids."""
