"""Snapshots: `KVCache.save` / `KVCache.load` round trips (fingerprint, gathered K/V, decoding, the next
operations), atomic writes under injected faults, and corrupt files, each a named `SnapshotError` subclass
that leaves the file (the destination) as it was."""
import hashlib
import json
import os
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kvcache
from kvcache.testing import FaultInjector, InjectedFault, set_fault_hook
from kvcache.errors import (SnapshotChecksumError, SnapshotConfigError, SnapshotCorruptError, SnapshotFormatError,
                     SnapshotInconsistentError, SnapshotRangeError, SnapshotTruncatedError, SnapshotVersionError)
from .kv_helpers import random_kv


def busy_cache(prefix_caching=True, dtype="float32", num_layers=2, seed=0):
    """A cache with forks, a truncation into a registered page, a released window page, a prefix match,
    cached (evictable) pages and a free sequence's pages back on the free list."""
    rng = np.random.default_rng(seed)
    cache = kvcache.KVCache(num_layers=num_layers, num_kv_heads=2, head_dim=3, head_dim_v=2, page_size=4,
                            num_pages=24, dtype=dtype, prefix_caching=prefix_caching, namespace="model-a")
    a = cache.create_sequence()
    cache.append(a, *random_kv(cache, 13, rng), token_ids=np.arange(13) * 7)
    b = cache.fork(a)
    cache.truncate(b, 6)
    cache.append(b, *random_kv(cache, 5, rng), token_ids=np.arange(5) + 100)
    c = cache.create_sequence(namespace="tenant-2")
    cache.append(c, *random_kv(cache, 9, rng))                            # no token ids
    d = cache.create_sequence()
    cache.append(d, *random_kv(cache, 10, rng), token_ids=np.arange(10) + 1000)
    cache.release_before(d, 8)
    if prefix_caching:
        e = cache.match_prefix(np.arange(13) * 7).seq
        cache.append(e, *random_kv(cache, 2, rng), token_ids=[91, 13 * 7])
        f = cache.create_sequence()
        cache.append(f, *random_kv(cache, 12, rng), token_ids=np.arange(12) + 5000)
        cache.free(f)                                                    # 3 cached pages
    cache.free(c)
    cache.check_invariants()
    return cache, rng


@pytest.fixture
def path(tmp_path):
    return tmp_path / "cache.safetensors"


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "float32", "int8", "bfloat16"])
def test_round_trip_same_fingerprint_kv_and_next_operations(path, prefix_caching, dtype):
    cache, rng = busy_cache(prefix_caching, dtype)
    size = cache.save(path)
    assert size == os.path.getsize(path) and os.listdir(path.parent) == [path.name]     # no temporary left
    loaded = kvcache.KVCache.load(path, config=cache.config)
    loaded.check_invariants()
    assert loaded.fingerprint(include_free_pages=False) == cache.fingerprint(include_free_pages=False)
    assert loaded.sequences == cache.sequences and loaded.num_cached_pages == cache.num_cached_pages
    if prefix_caching:
        assert cache.num_cached_pages == 3 + 2          # f's 3 pages, d's 2 released by the window
    for seq in cache.sequences:
        assert np.array_equal(loaded.token_ids(seq), cache.token_ids(seq))
        for layer in range(cache.config.num_layers):
            for mine, theirs in zip(cache.gather(seq, layer), loaded.gather(seq, layer)):
                assert mine.tobytes() == theirs.tobytes()
    # the same operations afterwards (allocation order, eviction, matches) give the same state
    for target in (cache, loaded):
        op_rng = np.random.default_rng(5)
        seq = target.sequences[0]
        target.append(seq, *random_kv(target, 9, op_rng), token_ids=np.arange(9) + 7)
        new = target.create_sequence()
        target.append(new, *random_kv(target, 20, op_rng), token_ids=np.arange(20) + 3)
        if prefix_caching:
            target.match_prefix(np.arange(12) + 5000)
        target.free(target.sequences[1])
    assert loaded.fingerprint(include_free_pages=False) == cache.fingerprint(include_free_pages=False)


def test_loaded_cache_decodes_identically(path):
    from decode.decoder import Decoder
    cache, rng = busy_cache(num_layers=1)
    cache.save(path)
    loaded = kvcache.KVCache.load(path)
    q = rng.standard_normal((4, 3))
    k, v = rng.standard_normal((2, 3)), rng.standard_normal((2, 2))
    for seq in cache.sequences:
        window = 2 if cache.pool.first_position(seq) else None              # d released its first pages
        outs = [Decoder.on_sequence(c, seq, 4, window=window).step(q, k, v, token_ids=77) for c in (cache, loaded)]
        assert outs[0].tobytes() == outs[1].tobytes()
    assert loaded.fingerprint(include_free_pages=False) == cache.fingerprint(include_free_pages=False)


def test_load_some_sequences_frees_the_others_in_id_order(path):
    cache, _ = busy_cache()
    cache.save(path)
    keep = [cache.sequences[1]]
    loaded = kvcache.KVCache.load(path, sequences=keep)
    for seq in cache.sequences:
        if seq not in keep:
            cache.free(seq)
    loaded.check_invariants()
    assert loaded.sequences == tuple(keep)
    assert loaded.fingerprint(include_free_pages=False) == cache.fingerprint(include_free_pages=False)
    with pytest.raises(ValueError, match=r"sequences: expected ids among the snapshot's"):
        kvcache.KVCache.load(path, sequences=[99])


@pytest.mark.parametrize("point", ["save_write", "save_rename"])
def test_failed_save_leaves_the_earlier_file_and_no_temporary(path, point):
    cache, rng = busy_cache()
    cache.save(path)
    before = path.read_bytes()
    cache.append(cache.sequences[0], *random_kv(cache, 3, rng))
    fingerprint = cache.fingerprint()
    points = FaultInjector()
    set_fault_hook(cache, points)
    cache.save(path.with_name("other.safetensors"))
    set_fault_hook(cache, FaultInjector(fail_at=points.points.index(point)))
    with pytest.raises(InjectedFault):
        cache.save(path)
    assert path.read_bytes() == before and cache.fingerprint() == fingerprint
    assert sorted(os.listdir(path.parent)) == sorted([path.name, "other.safetensors"])


def test_save_refused_inside_a_transaction(path):
    cache, rng = busy_cache()
    with cache.transaction({cache.sequences[0]: 1}) as tx:
        with pytest.raises(RuntimeError, match="save: expected no open transaction"):
            cache.save(path)
        for layer in range(2):
            tx.write(layer, cache.sequences[0], *(x[layer] for x in random_kv(cache, 1, rng)))
    assert not path.exists()


# -- corrupt files ---------------------------------------------------------------------------------------------------
def header_of(data: bytes):
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8:8 + n])


def data_offset(data: bytes, tensor: str) -> int:
    """Byte offset in the file of ``tensor``'s first byte."""
    n, header = header_of(data)
    return 8 + n + header[tensor]["data_offsets"][0]


def flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x10]) + data[offset + 1:]


def resign(path, edit_tensors=None, edit_meta=None):
    """Rewrite the snapshot with edited tensors/metadata and *valid* checksums (what a buggy writer would do)."""
    tensors = load_file(path)
    metadata = header_of(path.read_bytes())[1]["__metadata__"]
    if edit_tensors:
        edit_tensors(tensors)
    sums = {name: hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8)).hexdigest()
            for name, a in tensors.items()}
    metadata["sha256"] = json.dumps(sums)
    if edit_meta:
        edit_meta(metadata)
    save_file(tensors, path, metadata=metadata)


def bytes_case(edit):
    return lambda path: path.write_bytes(edit(path.read_bytes()))


def tensor_case(edit):
    return lambda path: resign(path, edit_tensors=edit)


def meta_case(edit):
    return lambda path: resign(path, edit_meta=edit)


def set_item(name, index, value):
    def edit(t):
        t[name] = t[name].copy()
        t[name][index] = value
    return edit


def set_config(**changes):
    def edit(meta):
        meta["config"] = json.dumps({**json.loads(meta["config"]), **changes})
    return edit


CORRUPTIONS = {
    "empty file": (bytes_case(lambda d: b""), SnapshotTruncatedError, "shorter than the 8-byte header"),
    "5 bytes": (bytes_case(lambda d: d[:5]), SnapshotTruncatedError, "shorter than the 8-byte header"),
    "cut in the header": (bytes_case(lambda d: d[:40]), SnapshotTruncatedError, "header of"),
    "cut in the data": (bytes_case(lambda d: d[:len(d) // 2 + 200]), SnapshotTruncatedError, "only"),
    "last byte missing": (bytes_case(lambda d: d[:-1]), SnapshotTruncatedError, "data section"),
    "huge header length": (bytes_case(lambda d: struct.pack("<Q", 2**40) + d[8:]), SnapshotTruncatedError,
                           "header of 1099511627776 bytes"),
    "header not JSON": (bytes_case(lambda d: d[:8] + b"#" + d[9:]), SnapshotCorruptError, "not valid safetensors JSON"),
    "bad tensor offsets": (bytes_case(lambda d: d.replace(b'"data_offsets":[0,', b'"data_offsets":[1,', 1)),
                           SnapshotCorruptError, "tensors cannot be parsed"),
    "flipped byte in k": (bytes_case(lambda d: flip(d, data_offset(d, "k") + 5)), SnapshotChecksumError, "'k'"),
    "flipped byte in v": (bytes_case(lambda d: flip(d, data_offset(d, "v"))), SnapshotChecksumError, "'v'"),
    "flipped byte in a page table": (bytes_case(lambda d: flip(d, data_offset(d, "seq_tables"))),
                                     SnapshotChecksumError, "'seq_tables'"),
    "flipped byte in the token ids": (bytes_case(lambda d: flip(d, data_offset(d, "seq_tokens") + 2)),
                                      SnapshotChecksumError, "'seq_tokens'"),
    "flipped last byte": (bytes_case(lambda d: flip(d, len(d) - 1)), SnapshotChecksumError, "sha256 differs"),
    "checksums missing": (meta_case(lambda m: m.pop("sha256")), SnapshotCorruptError, "metadata 'sha256'"),
    "wrong version": (meta_case(lambda m: m.update(version="2")), SnapshotVersionError, "expected 1, got '2'"),
    "not a pagedkv snapshot": (meta_case(lambda m: m.update(format="llama-state")), SnapshotVersionError,
                               "metadata 'format'"),
    "invalid config": (meta_case(set_config(page_size=0)), SnapshotConfigError, "not a valid cache config"),
    "config bigger than the data": (meta_case(set_config(num_kv_heads=3)), SnapshotFormatError, "tensor 'k'"),
    "missing tensor": (tensor_case(lambda t: t.pop("ref_counts")), SnapshotFormatError, r"missing \['ref_counts'\]"),
    "k of another dtype": (tensor_case(lambda t: t.update(k=t["k"].astype(np.float64))), SnapshotFormatError,
                           "tensor 'k'"),
    "page id out of range in a table": (tensor_case(set_item("seq_tables", 1, 24)), SnapshotRangeError,
                                        "seq_tables"),
    "negative page id in the free list": (tensor_case(set_item("free_list", 0, -3)), SnapshotRangeError,
                                          "'free_list' element 0"),
    "length beyond the page table": (tensor_case(set_item("seq_meta", (0, 1), 40)), SnapshotRangeError,
                                     "seq_meta' row 0: length 40"),
    "sequence id >= next_id": (meta_case(lambda m: m.update(next_id="1")), SnapshotRangeError, r"outside \[0, next_id"),
    "negative token id": (tensor_case(set_item("seq_tokens", 3, -1)), SnapshotRangeError, "'seq_tokens' element 3"),
    "wrong reference count": (tensor_case(set_item("ref_counts", 0, 7)), SnapshotInconsistentError,
                              "'ref_counts' element 0"),
    "page listed twice as free": (tensor_case(lambda t: t.update(free_list=np.repeat(t["free_list"][:1], 2))),
                                  SnapshotInconsistentError, "listed twice"),
    "wrong entry key": (tensor_case(set_item("entry_keys", (0, 0), 0)), SnapshotInconsistentError, "entry"),
    "token ids not those of the chain": (tensor_case(set_item("seq_tokens", 1, 4)), SnapshotInconsistentError,
                                         "holds other token ids"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_snapshot_is_a_named_error_and_the_file_stays(path, case):
    corrupt, error, match = CORRUPTIONS[case]
    cache, _ = busy_cache()
    cache.save(path)
    corrupt(path)
    damaged = path.read_bytes()
    with pytest.raises(error, match=match) as info:
        kvcache.KVCache.load(path)
    assert isinstance(info.value, kvcache.SnapshotError) and isinstance(info.value, ValueError)
    assert str(path) in str(info.value)
    assert path.read_bytes() == damaged and os.listdir(path.parent) == [path.name]


def test_config_mismatch_names_the_fields(path):
    cache, _ = busy_cache()
    cache.save(path)
    other = kvcache.CacheConfig.build(num_layers=2, num_kv_heads=2, head_dim=3, head_dim_v=2, page_size=8,
                                      num_pages=24)
    with pytest.raises(SnapshotConfigError, match=r"'page_size': \(8, 4\)"):
        kvcache.KVCache.load(path, config=other)


def test_corruption_cases_count():
    assert len(CORRUPTIONS) >= 20
