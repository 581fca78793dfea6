"""The structural checks of a snapshot being loaded (`kvcache.snapshot.read`): shapes and dtypes, ranges, then
consistency (reference counts, the page partition, key chains); each failure is a named `SnapshotError`."""
import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from . import errors as sn
from . import quant
from .config import CacheConfig
from .prefix import page_key, root_key

INT_TENSORS = {"used_pages": 1, "free_list": 1, "eviction_order": 1, "ref_counts": 1, "seq_meta": 2,
               "seq_tables": 1, "seq_tokens": 1, "seq_chain": 1, "entry_pages": 1, "entry_parents": 1,
               "entry_keys": 2, "entry_parent_keys": 2, "entry_tokens": 2, "entry_namespace": 1}


@dataclass
class EntryState:
    page: int
    key: bytes
    parent: int                   # entry index, -1 the namespace root, -2 an evicted parent
    parent_key: bytes
    tokens: bytes
    namespace: str


@dataclass
class SequenceState:
    seq: int
    length: int
    first_live_page: int
    table: np.ndarray             # int32 [num_logical_pages]
    tokens: np.ndarray            # int32 [num_known]
    chain: list                   # entry index per logical page of the chain, or -1
    namespace: str


@dataclass
class CacheState:
    config: CacheConfig
    prefix_caching: bool
    namespace: str
    salt: bytes
    next_id: int
    free_list: list
    ref_counts: list
    eviction_order: list
    used_pages: np.ndarray        # int32 [U], ascending
    pools: dict                   # "k" / "v" -> [num_layers, U, ...]
    sequences: list = field(default_factory=list)
    entries: list = field(default_factory=list)


def meta_json(path, metadata: dict, name: str, kind):
    """``json.loads(metadata[name])``, required to be a ``kind``."""
    try:
        value = json.loads(metadata[name])
    except (KeyError, ValueError) as exc:
        raise sn.SnapshotCorruptError(path, f"metadata {name!r}: missing or not JSON ({exc})") from exc
    if not isinstance(value, kind):
        raise sn.SnapshotCorruptError(path, f"metadata {name!r}: expected {kind.__name__}, got {value!r}")
    return value


def check_state(path, cfg: CacheConfig, tensors: dict, metadata: dict) -> "CacheState":
    _check_tensors(path, cfg, tensors)
    prefix_caching = meta_json(path, metadata, "prefix_caching", bool)
    namespace = meta_json(path, metadata, "namespace", str)
    namespaces = meta_json(path, metadata, "namespaces", list)
    if not all(isinstance(ns, str) for ns in namespaces) or namespace not in namespaces:
        raise sn.SnapshotCorruptError(path, f"metadata 'namespaces': expected strings including {namespace!r}")
    try:
        salt = bytes.fromhex(metadata["salt"])
        next_id = int(metadata["next_id"])
    except (KeyError, ValueError) as exc:
        raise sn.SnapshotCorruptError(path, f"metadata 'salt'/'next_id': missing or malformed ({exc})") from exc
    if not 0 <= next_id < 2**62:
        raise sn.SnapshotRangeError(path, f"metadata 'next_id': expected in [0, 2**62), got {next_id}")
    t = tensors
    for name in ("used_pages", "free_list", "eviction_order", "entry_pages"):
        _in_range(path, name, t[name], 0, cfg.num_pages)
    _in_range(path, "ref_counts", t["ref_counts"], 0, 2**31)
    _in_range(path, "seq_tokens", t["seq_tokens"], 0, 2**31)
    _in_range(path, "entry_tokens", t["entry_tokens"], 0, 2**31)
    _in_range(path, "entry_namespace", t["entry_namespace"], 0, len(namespaces))
    entries = _entries(path, cfg, t, salt, namespaces)
    if entries and not prefix_caching:
        raise sn.SnapshotInconsistentError(path, "entry_pages: index entries in a snapshot without prefix caching")
    sequences = _sequences(path, cfg, t, next_id, namespaces, entries, prefix_caching)
    used = _check_pages(path, cfg, t, sequences, entries)
    return CacheState(config=cfg, prefix_caching=prefix_caching, namespace=namespace, salt=salt,
                         next_id=next_id, free_list=t["free_list"].tolist(), ref_counts=t["ref_counts"].tolist(),
                         eviction_order=t["eviction_order"].tolist(), used_pages=used,
                         pools={name: t[name] for name in ("k", "v", "k_scales", "v_scales") if name in t},
                         sequences=sequences, entries=entries)


def _check_tensors(path, cfg: CacheConfig, t: dict) -> None:
    pools = ("k", "v", "k_scales", "v_scales") if cfg.quantized else ("k", "v")
    expected = set(INT_TENSORS) | set(pools)
    if set(t) != expected:
        raise sn.SnapshotFormatError(path, f"tensors: expected {sorted(expected)}, missing "
                                           f"{sorted(expected - set(t))}, unexpected {sorted(set(t) - expected)}")
    for name, ndim in INT_TENSORS.items():
        dtype = {"seq_meta": np.int64, "entry_keys": np.uint8, "entry_parent_keys": np.uint8}.get(name, np.int32)
        if t[name].dtype != dtype or t[name].ndim != ndim:
            raise sn.SnapshotFormatError(path, f"tensor {name!r}: expected {np.dtype(dtype)} with {ndim} dims, got "
                                               f"{t[name].dtype} {t[name].shape}")
    used = len(t["used_pages"])
    widths = {"k": (cfg.head_dim, cfg.dtype), "v": (cfg.head_dim_v, cfg.dtype)}
    if cfg.quantized:
        widths.update(k_scales=(quant.num_groups(cfg.head_dim), quant.SCALE_DTYPE),
                      v_scales=(quant.num_groups(cfg.head_dim_v), quant.SCALE_DTYPE))
    for name, (width, dtype) in widths.items():
        shape = (cfg.num_layers, used, cfg.num_kv_heads, cfg.page_size, width)
        if t[name].dtype != dtype or t[name].shape != shape:
            raise sn.SnapshotFormatError(path, f"tensor {name!r}: expected {np.dtype(dtype)} [num_layers, used "
                                               f"pages, num_kv_heads, page_size, width] = {shape}, got "
                                               f"{t[name].dtype} {t[name].shape}")
    num_entries = len(t["entry_pages"])
    for name, shape in (("ref_counts", (cfg.num_pages,)), ("seq_meta", (len(t["seq_meta"]), 6)),
                        ("entry_parents", (num_entries,)), ("entry_keys", (num_entries, 32)),
                        ("entry_parent_keys", (num_entries, 32)), ("entry_tokens", (num_entries, cfg.page_size)),
                        ("entry_namespace", (num_entries,))):
        if t[name].shape != shape:
            raise sn.SnapshotFormatError(path, f"tensor {name!r}: expected shape {shape}, got {t[name].shape}")


def _in_range(path, name: str, array: np.ndarray, low: int, high: int) -> None:
    bad = np.flatnonzero((array.reshape(-1) < low) | (array.reshape(-1) >= high))
    if len(bad):
        raise sn.SnapshotRangeError(path, f"tensor {name!r} element {int(bad[0])}: expected in [{low}, {high}), "
                                          f"got {int(array.reshape(-1)[bad[0]])}")


def _entries(path, cfg: CacheConfig, t: dict, salt: bytes, namespaces: list) -> list:
    """Index entries with every key recomputed from its parent key and tokens."""
    count, entries = len(t["entry_pages"]), []
    config_text = repr(cfg)
    for i in range(count):
        parent, namespace = int(t["entry_parents"][i]), namespaces[int(t["entry_namespace"][i])]
        parent_key, key = t["entry_parent_keys"][i].tobytes(), t["entry_keys"][i].tobytes()
        tokens = t["entry_tokens"][i].astype("<i4").tobytes()
        where = f"tensor 'entry_parents' element {i}"
        if not -2 <= parent < count or parent == i:
            raise sn.SnapshotRangeError(path, f"{where}: expected an entry index, -1 or -2, got {parent}")
        if parent == -1 and parent_key != root_key(salt, config_text, namespace):
            raise sn.SnapshotInconsistentError(path, f"{where}: the parent key is not the root key of namespace "
                                                     f"{namespace!r}")
        if parent >= 0 and (parent_key != t["entry_keys"][parent].tobytes()
                            or namespaces[int(t["entry_namespace"][parent])] != namespace):
            raise sn.SnapshotInconsistentError(path, f"{where}: the parent key is not entry {parent}'s key")
        if page_key(parent_key, tokens) != key:
            raise sn.SnapshotInconsistentError(path, f"tensor 'entry_keys' element {i}: not sha256(parent key, "
                                                     f"tokens)")
        entries.append(EntryState(int(t["entry_pages"][i]), key, parent, parent_key, tokens, namespace))
    pages = Counter(e.page for e in entries)
    keys = Counter(e.key for e in entries)
    if pages and max(pages.values()) > 1 or keys and max(keys.values()) > 1:
        raise sn.SnapshotInconsistentError(path, "entry_pages/entry_keys: a page or key registered twice")
    return entries


def _sequences(path, cfg: CacheConfig, t: dict, next_id: int, namespaces: list, entries: list,
               prefix_caching: bool) -> list:
    meta, size = t["seq_meta"], cfg.page_size
    offsets = {"seq_tables": 0, "seq_tokens": 0, "seq_chain": 0}
    needs = {"seq_tables": int(meta[:, 3].sum()) if len(meta) else 0,
             "seq_tokens": int(meta[:, 4].sum()) if len(meta) else 0}
    seqs, seen = [], set()
    for row, (seq, length, first, pages, known, ns) in enumerate(meta.tolist()):
        where = f"tensor 'seq_meta' row {row}"
        if not 0 <= seq < next_id or seq in seen:
            raise sn.SnapshotRangeError(path, f"{where}: sequence id {seq} duplicate or outside [0, next_id={next_id})")
        seen.add(seq)
        if not 0 <= length <= cfg.num_pages * size or pages != cfg.pages_for(length):
            raise sn.SnapshotRangeError(path, f"{where}: length {length} with {pages} pages (expected "
                                              f"ceil(length / {size}) and length <= {cfg.num_pages * size})")
        if not 0 <= first <= pages or not 0 <= known <= length or not 0 <= ns < len(namespaces):
            raise sn.SnapshotRangeError(path, f"{where}: first_live_page {first}, num_known {known} or namespace "
                                              f"{ns} out of range")
        table = _take(path, t, "seq_tables", offsets, pages)
        _in_range(path, f"seq_tables (sequence {seq})", table[first:], 0, cfg.num_pages)
        if (table[:first] != -1).any():
            raise sn.SnapshotRangeError(path, f"tensor 'seq_tables' (sequence {seq}): released entries not -1")
        tokens = _take(path, t, "seq_tokens", offsets, known)
        chain = _take(path, t, "seq_chain", offsets, known // size if prefix_caching else 0).tolist()
        _check_chain(path, seq, chain, tokens, entries, size)
        seqs.append(SequenceState(seq, length, first, table.astype(np.int32), tokens.astype("<i4"), chain,
                                     namespaces[ns]))
    for name in offsets:
        if offsets[name] != len(t[name]) or (name in needs and needs[name] != len(t[name])):
            raise sn.SnapshotFormatError(path, f"tensor {name!r}: {len(t[name])} elements, the sequences use "
                                               f"{offsets[name]}")
    return seqs


def _take(path, t: dict, name: str, offsets: dict, count: int) -> np.ndarray:
    start = offsets[name]
    if start + count > len(t[name]):
        raise sn.SnapshotFormatError(path, f"tensor {name!r}: {len(t[name])} elements, the sequences need more")
    offsets[name] = start + count
    return t[name][start:start + count]


def _check_chain(path, seq: int, chain: list, tokens: np.ndarray, entries: list, size: int) -> None:
    for logical, index in enumerate(chain):
        where = f"tensor 'seq_chain' (sequence {seq}, page {logical})"
        if not -1 <= index < len(entries):
            raise sn.SnapshotRangeError(path, f"{where}: entry index {index} outside [-1, {len(entries)})")
        if index < 0:
            continue
        entry = entries[index]
        if entry.tokens != tokens[logical * size:(logical + 1) * size].astype("<i4").tobytes():
            raise sn.SnapshotInconsistentError(path, f"{where}: entry {index} holds other token ids")
        expected_parent = -1 if logical == 0 else chain[logical - 1]
        if entry.parent != (expected_parent if expected_parent >= 0 or logical == 0 else -2):
            raise sn.SnapshotInconsistentError(path, f"{where}: entry {index}'s parent is not the chain's previous "
                                                     f"link")


def _check_pages(path, cfg: CacheConfig, t: dict, sequences: list, entries: list) -> np.ndarray:
    """Reference counts equal the page tables' holdings; free, cached and referenced pages partition the pool;
    the stored pages are exactly the referenced and cached ones. Returns the stored page ids."""
    held = Counter(int(p) for s in sequences for p in s.table[s.first_live_page:])
    refs = t["ref_counts"]
    wrong = [p for p in range(cfg.num_pages) if refs[p] != held.get(p, 0)]
    if wrong:
        raise sn.SnapshotInconsistentError(path, f"tensor 'ref_counts' element {wrong[0]}: {int(refs[wrong[0]])}, "
                                                 f"but {held.get(wrong[0], 0)} page tables hold the page")
    free, cached = t["free_list"].tolist(), t["eviction_order"].tolist()
    registered = {e.page for e in entries}
    if len(set(free)) != len(free) or len(set(cached)) != len(cached) or set(free) & set(cached):
        raise sn.SnapshotInconsistentError(path, "free_list/eviction_order: a page listed twice")
    if set(free) & held.keys() or set(cached) & held.keys():
        raise sn.SnapshotInconsistentError(path, "free_list/eviction_order: a page also held by a sequence")
    if len(free) + len(cached) + len(held) != cfg.num_pages:
        raise sn.SnapshotInconsistentError(path, f"pages: free {len(free)} + cached {len(cached)} + referenced "
                                                 f"{len(held)} != num_pages {cfg.num_pages}")
    if not set(cached) <= registered or not registered <= set(cached) | held.keys():
        raise sn.SnapshotInconsistentError(path, "eviction_order/entry_pages: cached pages must be exactly the "
                                                 "registered pages no sequence holds")
    used = np.asarray(sorted(held.keys() | set(cached)), dtype=np.int32)
    if not np.array_equal(t["used_pages"], used):
        raise sn.SnapshotInconsistentError(path, f"tensor 'used_pages': expected the referenced and cached pages "
                                                 f"in order ({len(used)}), got {len(t['used_pages'])} others")
    return used
