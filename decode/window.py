"""Sliding windows: give back the pages no future query of a decoder can read."""
import logging

_log = logging.getLogger(__name__)


def release_outside_window(decoder) -> None:
    """With a sliding window, give back the pages no future query can read (positions < length - window + 1)."""
    if decoder.window and decoder.length - decoder.window + 1 > decoder.cache.pool.first_position(decoder.seq):
        decoder.cache.release_before(decoder.seq, decoder.length - decoder.window + 1)


def release_after_commit(decoder) -> None:
    """`release_outside_window` once the tokens are committed: a failure now would report a failed call that
    changed the cache, so it is not raised; the release is atomic (nothing was given back), the next commit
    retries it, and the failure is logged (logger ``decode.window``, level WARNING)."""
    try:
        release_outside_window(decoder)
    except Exception as exc:                      # noqa: BLE001 (the tokens are committed; retried next commit)
        _log.warning("sliding-window release of sequence %s deferred to the next commit: %r", decoder.seq, exc)
