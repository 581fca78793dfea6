"""The suite against the bugs other engines shipped: each is planted here (monkeypatch, in-process) and the random
driver, with its guard pages, dense model and fingerprints, must report a divergence within a short run.

A mutation the driver cannot see would mean a blind spot in the reliability suite, not in the engine.
"""
import numpy as np
import pytest

from decode.attention_plan import AttentionPlan
import decode.window as window_module
import kvcache.allocator as allocator_module
import kvcache.transaction as transaction_module
from .driver import Divergence, Settings, run

pytestmark = pytest.mark.kernel


def shift_positions(monkeypatch, how):
    """The decoder's kernel call sees other query positions than the tokens' own (a mistyped length)."""
    real = AttentionPlan.run_layer

    def run_layer(self, pools, layer, q, scale, window, out):
        size = pools.k_run[layer].shape[2]
        capacity = (self.indptr[self.query_seq + 1] - self.indptr[self.query_seq]) * size
        pos = np.asarray(self.query_pos).copy()
        if how == "one past the length":                   # reads a slot no token was written to
            pos = np.minimum(pos + 1, capacity - 1)
        elif how == "whole last page":                      # reads the unused tail of the last page
            pos = capacity - 1
        else:                                               # the new token left out: attends one key short
            pos = np.maximum(pos - 1, 0)
        shifted = AttentionPlan(self.query_seq, pos, window, q.shape, pools.v_shape, pools.storage)
        shifted.indices, shifted.indptr = self.indices, self.indptr
        return real(shifted, pools, layer, q, scale, window, out)
    monkeypatch.setattr(AttentionPlan, "run_layer", run_layer)


def plant(monkeypatch, bug):
    if bug == "stale shared prefix (no copy-on-write)":
        monkeypatch.setattr(allocator_module.PageAllocator, "ref_count", lambda self, page: 1)
    elif bug == "pages leaked by an aborted request":
        monkeypatch.setattr(allocator_module.PageAllocator, "unallocate", lambda self, pages: None)
    elif bug == "double free":
        real = allocator_module.PageAllocator.decref

        def decref(self, page):
            freed = real(self, page)
            if not freed:
                self._free.append(page)                   # handed out again while still mapped
            return freed
        monkeypatch.setattr(allocator_module.PageAllocator, "decref", decref)
    elif bug == "failed call keeps its bytes":
        real = transaction_module.TokenWrite.rollback

        def rollback(self):
            self._saved = []
            real(self)
        monkeypatch.setattr(transaction_module.TokenWrite, "rollback", rollback)
    elif bug == "length published before every layer was written":
        real = transaction_module.TokenWrite.commit

        def commit(self):
            self._written = (1 << self._num_layers) - 1
            real(self)
        monkeypatch.setattr(transaction_module.TokenWrite, "commit", commit)
    elif bug == "window gives back a page still read":
        def release(dec):
            if dec.window and dec.length > dec.window:
                dec.cache.release_before(dec.seq, min(dec.length, dec.length - dec.window + 1 +
                                                      dec.config.page_size))
        monkeypatch.setattr(window_module, "release_outside_window", release)
    else:
        shift_positions(monkeypatch, bug)


BUGS = {
    "stale shared prefix (no copy-on-write)": {},
    "pages leaked by an aborted request": {},
    "double free": {},
    "failed call keeps its bytes": {},
    "length published before every layer was written": dict(layers=2),
    "window gives back a page still read": dict(window=6),
    "one past the length": {},                             # an out-of-bounds read inside the page table
    "whole last page": {},                                 # NaN from garbage in unused slots
    "one short": {},                                       # silent error from a mistyped length
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_planted_bug_is_caught(bug, monkeypatch):
    plant(monkeypatch, bug)
    with pytest.raises(Divergence):
        run(Settings(ops=1500, seed=7, **BUGS[bug]))
