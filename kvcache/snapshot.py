"""Cache snapshots on disk: the safetensors format (the `safetensors` package; no pickle, no code run on load).

A snapshot holds the config and namespace, the per-cache salt, every sequence (id, length, first live page,
page table, known token ids, prefix chain), the reference counts, the free list and the eviction order (in
order), the prefix index entries, and the bytes of the pages in use only (referenced or cached), with a
sha256 per tensor in the metadata. `write` is atomic: a temporary file in the same directory, fsync, rename,
fsync of the directory; a failed save leaves any earlier file at the path as it was.

`read` validates everything before anything is built: a truncated file, a corrupt header, a flipped byte, a
wrong format version, a config that is not the expected one, out-of-range page ids or lengths, inconsistent
reference counts or key chains each raise a `SnapshotError` subclass (a ValueError) naming what is wrong and
where. Tensors (named dimensions; ``U`` pages in use, ``S`` sequences, ``E`` index entries)::

    k [num_layers, U, num_kv_heads, page_size, head_dim]   v [num_layers, U, num_kv_heads, page_size, head_dim_v]
        in the pool's element type: the config's "dtype" names the storage format; bfloat16 pages are stored
        as their uint16 bits (safetensors U16, no rounding on the way: a load gives back the same bits)
    used_pages int32 [U]        free_list int32 [F]        eviction_order int32 [C]      ref_counts int32 [num_pages]
    seq_meta int64 [S, 6]: id, length, first_live_page, num_logical_pages, num_known, namespace index
    seq_tables int32 [sum pages]   seq_tokens int32 [sum known]   seq_chain int32 [sum chain] (entry index or -1)
    entry_pages int32 [E]   entry_parents int32 [E] (entry index, -1 the root, -2 an evicted parent)
    entry_keys uint8 [E, 32]   entry_parent_keys uint8 [E, 32]   entry_tokens int32 [E, page_size]
    entry_namespace int32 [E]
"""
import hashlib
import json
import os
import struct
import tempfile

import numpy as np

from .config import CacheConfig
from .errors import (SnapshotChecksumError, SnapshotConfigError, SnapshotCorruptError, SnapshotTruncatedError,
                     SnapshotVersionError)
from .snapshot_checks import CacheState, EntryState, SequenceState, check_state, meta_json

__all__ = ["CacheState", "EntryState", "SequenceState", "read", "write", "encode"]

FORMAT = "pagedkv-snapshot"
VERSION = 1


# -- writing ----------------------------------------------------------------------------------------------------
def config_dict(cfg: CacheConfig) -> dict:
    return {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "head_dim_v": cfg.head_dim_v, "page_size": cfg.page_size, "num_pages": cfg.num_pages,
            "dtype": cfg.storage}


def encode(state: CacheState) -> tuple[dict, dict]:
    """``(tensors, metadata)`` of a state, ready for safetensors."""
    seqs, entries, size = state.sequences, state.entries, state.config.page_size
    namespaces = sorted({state.namespace} | {s.namespace for s in seqs} | {e.namespace for e in entries})
    ns_index = {ns: i for i, ns in enumerate(namespaces)}

    def i32(values, shape=None):
        return np.asarray(values, dtype="<i4").reshape(shape if shape is not None else (-1,))
    tensors = dict(state.pools)
    tensors.update(
        used_pages=i32(state.used_pages), free_list=i32(state.free_list), eviction_order=i32(state.eviction_order),
        ref_counts=i32(state.ref_counts),
        seq_meta=np.array([[s.seq, s.length, s.first_live_page, len(s.table), len(s.tokens), ns_index[s.namespace]]
                           for s in seqs], dtype="<i8").reshape(len(seqs), 6),
        seq_tables=i32(np.concatenate([s.table for s in seqs]) if seqs else []),
        seq_tokens=i32(np.concatenate([s.tokens for s in seqs]) if seqs else []),
        seq_chain=i32([i for s in seqs for i in s.chain]),
        entry_pages=i32([e.page for e in entries]), entry_parents=i32([e.parent for e in entries]),
        entry_keys=np.frombuffer(b"".join(e.key for e in entries), np.uint8).reshape(len(entries), 32),
        entry_parent_keys=np.frombuffer(b"".join(e.parent_key for e in entries), np.uint8).reshape(len(entries), 32),
        entry_tokens=np.frombuffer(b"".join(e.tokens for e in entries), "<i4").reshape(len(entries), size),
        entry_namespace=i32([ns_index[e.namespace] for e in entries]))
    tensors = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    metadata = {"format": FORMAT, "version": str(VERSION), "config": json.dumps(config_dict(state.config)),
                "prefix_caching": json.dumps(state.prefix_caching), "namespace": json.dumps(state.namespace),
                "namespaces": json.dumps(namespaces), "salt": state.salt.hex(), "next_id": str(state.next_id),
                "sha256": json.dumps({name: _digest(array) for name, array in tensors.items()})}
    return tensors, metadata


def _digest(array: np.ndarray) -> str:
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)        # [bytes]
    return hashlib.sha256(flat).hexdigest()


def write(path, state: CacheState, fault=lambda point: None) -> int:
    """Write ``state`` to ``path`` atomically; returns the file's size in bytes."""
    from safetensors.numpy import save_file
    tensors, metadata = encode(state)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        fault("save_write")
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        fault("save_rename")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return os.path.getsize(path)


# -- reading ----------------------------------------------------------------------------------------------------
def read(path, expected_config: CacheConfig | None = None) -> CacheState:
    """The validated state in ``path`` (see the module docstring for the errors)."""
    tensors, metadata = _read_file(path)
    _check_version(path, metadata)
    _check_checksums(path, tensors, metadata)
    cfg = _check_config(path, metadata, expected_config)
    return check_state(path, cfg, tensors, metadata)


def _read_file(path) -> tuple[dict, dict]:
    """Header checks (length, JSON, the data it announces present), then the tensors through safetensors'
    memory map (one copy into numpy arrays)."""
    from safetensors import safe_open
    with open(path, "rb") as f:                       # a missing file: FileNotFoundError, as for any open
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise SnapshotTruncatedError(path, f"{size} bytes, shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise SnapshotTruncatedError(path, f"header of {header_len} bytes announced, {size - 8} present")
        raw_header = f.read(header_len)
    try:
        header = json.loads(raw_header)
        metadata = header.get("__metadata__") or {}
        ends = [int(info["data_offsets"][1]) for name, info in header.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise SnapshotCorruptError(path, f"header is not valid safetensors JSON ({exc})") from exc
    body = size - 8 - header_len
    if ends and max(ends) > body:
        raise SnapshotTruncatedError(path, f"tensor data ends at byte {max(ends)} of the data section, "
                                           f"only {body} bytes present")
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SnapshotCorruptError(path, "metadata: expected a string -> string map")
    try:
        with safe_open(os.fspath(path), framework="np") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:                         # safetensors' own errors (offsets, dtype, alignment)
        raise SnapshotCorruptError(path, f"tensors cannot be parsed ({type(exc).__name__}: {exc})") from exc
    return tensors, metadata


def _check_version(path, metadata: dict) -> None:
    if metadata.get("format") != FORMAT:
        raise SnapshotVersionError(path, f"metadata 'format': expected {FORMAT!r}, got {metadata.get('format')!r}")
    if metadata.get("version") != str(VERSION):
        raise SnapshotVersionError(path, f"metadata 'version': expected {VERSION}, got {metadata.get('version')!r}")


def _check_checksums(path, tensors: dict, metadata: dict) -> None:
    try:
        sums = json.loads(metadata["sha256"])
    except (KeyError, ValueError) as exc:
        raise SnapshotCorruptError(path, f"metadata 'sha256': expected a JSON map of tensor digests ({exc})") from exc
    if not isinstance(sums, dict) or set(sums) != set(tensors):
        raise SnapshotCorruptError(path, f"metadata 'sha256': expected digests of tensors {sorted(tensors)}, "
                                         f"got {sorted(sums) if isinstance(sums, dict) else sums!r}")
    for name in sorted(tensors):
        if _digest(tensors[name]) != sums[name]:
            raise SnapshotChecksumError(path, f"tensor {name!r}: sha256 differs from the recorded one "
                                              f"(corrupt bytes)")


def _check_config(path, metadata: dict, expected: CacheConfig | None) -> CacheConfig:
    raw = meta_json(path, metadata, "config", dict)
    try:
        cfg = CacheConfig.build(**raw)
    except (TypeError, ValueError) as exc:
        raise SnapshotConfigError(path, f"metadata 'config': not a valid cache config ({exc})") from exc
    if expected is not None and cfg != expected:
        diff = {k: (v, raw.get(k)) for k, v in config_dict(expected).items() if config_dict(cfg).get(k) != v}
        raise SnapshotConfigError(path, f"config: expected the caller's config, got differences "
                                        f"{{field: (expected, in file)}} = {diff}")
    return cfg
