"""CacheConfig.build and PageAllocator: every argument check, the layout arithmetic, exact inverses."""
import dataclasses

import numpy as np
import pytest

import kvcache
from kvcache import CacheConfig, CacheFullError
from kvcache.testing import FaultInjector, InjectedFault, PageAllocator, set_free_list


# -- CacheConfig ---------------------------------------------------------------------------------------------
def test_build_defaults_and_layout():
    cfg = CacheConfig.build(num_kv_heads=4, head_dim=8, num_pages=10)
    assert (cfg.num_layers, cfg.head_dim_v, cfg.page_size, cfg.dtype) == (1, 8, 16, np.dtype(np.float32))
    assert cfg.k_page_shape == (10, 4, 16, 8) and cfg.v_page_shape == (10, 4, 16, 8)
    assert cfg.bytes_per_token == 1 * 4 * (8 + 8) * 4
    assert cfg.bytes_per_page == cfg.bytes_per_token * 16


def test_build_head_dim_v_and_dtype():
    cfg = CacheConfig.build(num_layers=3, num_kv_heads=2, head_dim=8, head_dim_v=5, page_size=4, num_pages=2,
                            dtype=np.float16)
    assert cfg.v_page_shape == (2, 2, 4, 5) and cfg.k_page_shape == (2, 2, 4, 8)
    assert cfg.bytes_per_token == 3 * 2 * (8 + 5) * 2
    assert cfg.dtype == np.float16


@pytest.mark.parametrize("max_tokens, pages", [(1, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_max_tokens_rounds_up_to_whole_pages(max_tokens, pages):
    assert CacheConfig.build(num_kv_heads=1, head_dim=1, max_tokens=max_tokens).num_pages == pages


@pytest.mark.parametrize("tokens, pages", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_pages_for(tokens, pages):
    assert CacheConfig.build(num_kv_heads=1, head_dim=1, page_size=4, num_pages=1).pages_for(tokens) == pages


@pytest.mark.parametrize("kwargs", [{}, {"num_pages": 2, "max_tokens": 32}])
def test_exactly_one_of_num_pages_and_max_tokens(kwargs):
    with pytest.raises(ValueError, match=r"num_pages/max_tokens: expected exactly one of them, got num_pages="):
        CacheConfig.build(num_kv_heads=1, head_dim=1, **kwargs)


@pytest.mark.parametrize("name", ["num_layers", "num_kv_heads", "head_dim", "head_dim_v", "page_size",
                                  "num_pages", "max_tokens"])
@pytest.mark.parametrize("bad, error, message", [
    (0, ValueError, "expected an integer >= 1, got 0"),
    (-3, ValueError, "expected an integer >= 1, got -3"),
    (2.0, TypeError, "expected an integer, got float 2.0"),
    (True, TypeError, "expected an integer, got bool True"),
    ("4", TypeError, "expected an integer, got str '4'"),
])
def test_int_arguments_checked(name, bad, error, message):
    kwargs = dict(num_layers=1, num_kv_heads=1, head_dim=1, page_size=4, num_pages=2)
    if name == "max_tokens":
        del kwargs["num_pages"]
    kwargs[name] = bad
    with pytest.raises(error, match=f"^{name}: {message}$"):
        CacheConfig.build(**kwargs)
    with pytest.raises(error, match=f"^{name}: "):
        kvcache.KVCache(**kwargs)


def test_numpy_integers_accepted():
    cfg = CacheConfig.build(num_kv_heads=np.int64(2), head_dim=np.int32(3), num_pages=np.uint8(4))
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.num_pages) == (2, 3, 4)
    assert all(type(x) is int for x in (cfg.num_kv_heads, cfg.head_dim, cfg.num_pages))


@pytest.mark.parametrize("dtype", ["int32", np.uint8, np.uint16, "int16", bool, "complex64", "bf16", "BFloat16",
                                   object, "float128x", None])
def test_non_float_storage_dtypes_rejected(dtype):
    with pytest.raises(TypeError, match=r"^dtype: expected one of float16, float32, float64, int8, bfloat16, got "):
        CacheConfig.build(num_kv_heads=1, head_dim=1, num_pages=1, dtype=dtype)


@pytest.mark.parametrize("dtype, expected", [("float16", np.float16), (np.float32, np.float32),
                                             (float, np.float64), ("f8", np.float64), ("int8", np.int8),
                                             (np.int8, np.int8)])
def test_storage_dtypes_accepted(dtype, expected):
    cfg = CacheConfig.build(num_kv_heads=1, head_dim=1, num_pages=1, dtype=dtype)
    assert cfg.dtype == np.dtype(expected) and cfg.storage == np.dtype(expected).name and not cfg.bfloat16


def test_bfloat16_storage_is_uint16_bits_named_bfloat16():
    cfg = CacheConfig.build(num_kv_heads=2, head_dim=3, head_dim_v=5, num_pages=4, dtype="bfloat16")
    assert cfg.storage == "bfloat16" and cfg.bfloat16 and cfg.dtype == np.uint16 and not cfg.quantized
    assert cfg.bytes_per_token == 2 * (3 + 5) * 2 and cfg.scale_bytes_per_token == 0
    assert cfg != CacheConfig.build(num_kv_heads=2, head_dim=3, head_dim_v=5, num_pages=4, dtype="float16")
    fields = {name: value for name, value in dataclasses.asdict(cfg).items() if name != "storage"}
    assert CacheConfig.build(**{**fields, "dtype": cfg.storage}) == cfg       # the name rebuilds it


def test_config_is_frozen():
    cfg = CacheConfig.build(num_kv_heads=1, head_dim=1, num_pages=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_pages = 2


def test_cache_pool_matches_config():
    cache = kvcache.KVCache(num_layers=2, num_kv_heads=3, head_dim=4, head_dim_v=5, page_size=2, num_pages=6,
                            dtype="float16")
    assert cache.pool.k_pages(1).shape == (6, 3, 2, 4) and cache.pool.v_pages(1).shape == (6, 3, 2, 5)
    assert cache.pool.k_pages().dtype == np.float16
    assert cache.num_free_pages == 6 and cache.sequences == ()
    for layer, error in ((2, ValueError), (-1, ValueError), (1.0, TypeError)):
        with pytest.raises(error, match="^layer: expected an integer"):
            cache.pool.k_pages(layer)
        with pytest.raises(error, match="^layer: expected an integer"):
            cache.pool.v_pages(layer)


# -- PageAllocator -------------------------------------------------------------------------------------------
def test_allocate_hands_out_low_pages_first_and_sets_refs():
    alloc = PageAllocator(5)
    assert alloc.allocate(2) == [0, 1]
    assert alloc.num_free_pages == 3
    assert alloc.ref_counts() == (1, 1, 0, 0, 0)
    assert alloc.allocate(0) == []
    alloc.check_invariants([[0, 1]])


def test_allocate_all_or_none():
    alloc = PageAllocator(3)
    alloc.allocate(2)
    before = (alloc.free_list(), alloc.ref_counts())
    with pytest.raises(CacheFullError) as info:
        alloc.allocate(2, what="append")
    assert (alloc.free_list(), alloc.ref_counts()) == before
    err = info.value
    assert (err.pages_needed, err.pages_free, err.num_pages, err.could_ever_fit) == (2, 1, 3, True)
    assert str(err) == "append: needs 2 free pages, 1 of 3 are free; it fits once other sequences free pages"


def test_cache_full_error_never_fits_message():
    alloc = PageAllocator(3)
    with pytest.raises(CacheFullError, match=r"^needs 4 free pages, 3 of 3 are free; it can never fit: the pool "
                                             r"has only 3 pages$") as info:
        alloc.allocate(4, could_ever_fit=False)
    assert info.value.could_ever_fit is False
    assert isinstance(info.value, RuntimeError)


def test_unallocate_is_exact_inverse():
    alloc = PageAllocator(6)
    alloc.allocate(1)
    alloc.decref(0)                      # free list order now differs from the initial one
    before = (alloc.free_list(), alloc.ref_counts())
    pages = alloc.allocate(4)
    alloc.unallocate(pages)
    assert (alloc.free_list(), alloc.ref_counts()) == before


def test_incref_decref_and_undo():
    alloc = PageAllocator(3)
    [page] = alloc.allocate(1)
    alloc.incref(page)
    assert alloc.ref_count(page) == 2
    assert alloc.decref(page) is False and alloc.ref_count(page) == 1
    before = (alloc.free_list(), alloc.ref_counts())
    assert alloc.decref(page) is True
    assert alloc.free_list()[-1] == page and alloc.ref_count(page) == 0
    alloc.undo_decref(page, True)
    assert (alloc.free_list(), alloc.ref_counts()) == before
    alloc.incref(page)
    alloc.decref(page)
    alloc.undo_decref(page, False)
    assert alloc.ref_count(page) == 2


def test_undo_decref_out_of_order_is_caught():
    alloc = PageAllocator(3)
    a, b = alloc.allocate(2)
    alloc.decref(a)
    alloc.decref(b)
    with pytest.raises(AssertionError, match="LIFO"):
        alloc.undo_decref(a, True)


@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_fault_inside_allocate_gives_back_the_pages_taken(fail_at):
    alloc = PageAllocator(5)
    alloc.allocate(1)
    before = (alloc.free_list(), alloc.ref_counts())
    alloc.fault_hook = FaultInjector(fail_at=fail_at)
    with pytest.raises(InjectedFault, match=f"injected fault #{fail_at} at 'allocate'"):
        alloc.allocate(3)
    assert (alloc.free_list(), alloc.ref_counts()) == before
    assert alloc.fault_hook.points == ["allocate"] * (fail_at + 1)


def test_fault_injector_counts_points():
    hook = FaultInjector()
    alloc = PageAllocator(4, fault_hook=hook)
    alloc.allocate(3)
    assert hook.points == ["allocate"] * 3


def test_allocator_check_invariants_detects_corruption():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.incref(pages[0])
    alloc.check_invariants([[0, 1], [0]])
    with pytest.raises(AssertionError, match="page 0: ref count 2 but held by 1 page tables"):
        alloc.check_invariants([[0, 1]])
    with pytest.raises(AssertionError, match="page 1: ref count 1 but held by 2"):
        alloc.check_invariants([[0, 1], [0, 1]])
    with pytest.raises(AssertionError, match=r"pages both free and mapped: \[2\]"):
        alloc.check_invariants([[0, 1], [0], [2]])
    set_free_list(alloc, alloc.free_list() + alloc.free_list()[-1:])
    with pytest.raises(AssertionError, match="duplicates in the free list"):
        alloc.check_invariants([[0, 1], [0]])
    set_free_list(alloc, alloc.free_list()[:-2])     # the duplicate gone, and a page neither free nor referenced: leaked
    with pytest.raises(AssertionError, match=r"free 1 \+ parked 0 \+ in use 2 != total 4"):
        alloc.check_invariants([[0, 1], [0]])
    alloc = PageAllocator(2)
    alloc.allocate(1)
    alloc.check_invariants([[-1, 0]])                 # -1 entries (released pages) are ignored
