"""`PagedCache`: a `transformers.Cache` whose K/V live in one `kvcache.KVCache` pool (all layers; one pool
sequence per batch row), attended by our kernels through the "pagedkv" attention implementation.

    cache = PagedCache(model.config, max_tokens=8192, dtype="float32", page_size=16)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)

transformers sees ``columns`` positions per row (pads included, the same for every row); the pool holds only
the real tokens of each row (`RowColumns`), so padding never enters the cache or any softmax. `update` stores
nothing: it returns the new K/V as given and names the cache to the layer's attention call, which writes them
into the pool and attends over the page tables (`ForwardPlan`: one transaction per forward, committed after the
last layer). A forward that fails anywhere is rolled back: by the attention call itself, or, when the failure
was outside our code, at this cache's next use.

Prefix reuse across `generate()` calls (``prefix_caching=True``): before each call, `match_prefix(input_ids,
attention_mask)` starts every row from the longest prefix the pool holds (then generate() computes only the
rest), and gives the pool the prompt's token ids so its full pages are registered for the next calls;
`track_token_ids(model)` also hands the pool the ids of generated tokens (a forward pre-hook on the model)::

    cache = PagedCache(model.config, max_tokens=8192, prefix_caching=True)
    for prompt_ids, mask in requests:
        cache.reset()                                     # rows freed; their registered pages stay cached
        reused = cache.match_prefix(prompt_ids, mask)     # columns taken from the pool
        out = model.generate(prompt_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=32)
"""
import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcache import CacheFullError, KVCache

from . import handoff, pool_rows, sizing
from . import page_dtype as storage
from .layout import ModelLayout, layout_key, layout_of
from .plan import ForwardPlan, check_kernel_threads
from .rows import RowColumns, check_new_real


class PagedLayer(CacheLayerMixin):
    """transformers' per-layer view of a `PagedCache` (lengths, mask sizes, flags); the state is the cache's."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: "PagedCache", layer: int):
        super().__init__()
        self._cache, self.layer = cache, layer
        self.is_sliding = bool(cache.layout.windows[layer])
        self.sliding_window = cache.layout.windows[layer] or None
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    @property
    def record_past(self) -> bool:
        return self._cache._record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        self._cache._record_past = bool(value)


class PagedCache(Cache):
    """A transformers cache over a paged pool.

    Parameters
    ----------
    config : transformers.PretrainedConfig   the model's config (layers, KV heads, head_dim, sliding windows)
    max_tokens / num_pages : int             pool capacity over all rows (and forks) together; give one
                                             (`PagedCache.for_generate` sizes it for a generate() call)
    dtype : None | str | numpy or torch dtype   storage dtype: "float16", "bfloat16", "float32", "float64",
                                             "int8" (`kvcache.quant`), or torch.float16 / bfloat16 / float32 /
                                             float64. None (default): the model's dtype (``config.dtype``, else
                                             the K/V of the first forward; a bfloat16 model gets bfloat16
                                             pages).
                                             Inputs are converted, outputs come back in the model's dtype
    page_size : int                          tokens per page
    prefix_caching : bool                    register full pages by token id, reuse them (`match_prefix`)
    namespace : str                          the pool's prefix namespace (name the model and its revision)
    kernel_threads : int, None or "auto"     numba threads of the attention kernel for forwards of fewer than
                                             256 real queries (decode steps, verification); None: numba's
                                             setting. "auto" (the default, `plan.auto_kernel_threads`): None on
                                             CPUs with AMX, 1 elsewhere, where torch's OpenMP threads keep
                                             spinning after each op and take the cores numba's threads wait for
                                             (5-20x slower decode calls, docs/transformers.md). Prefills use
                                             numba's setting.

    Attributes
    ----------
    pool : kvcache.KVCache                   shared with every `fork` of this cache
    stats : dict                             ``kernel_calls``, ``forwards``, ``tokens`` (real tokens stored),
                                             ``deferred_releases`` (window releases that failed after a forward
                                             landed; the pages go back at the next one)
    """

    def __init__(self, config, *, max_tokens=None, num_pages=None, dtype=None, page_size=16,
                 kernel_threads: int | None | str = "auto", prefix_caching=False, namespace=""):
        kernel_threads = check_kernel_threads(kernel_threads)
        layout = layout_of(config)
        name = storage.storage_name(dtype)
        model_dtype = storage.config_dtype(config)
        pending = name is None and model_dtype is None          # known at the first forward (the model's K/V)
        if name is None:
            name = storage.for_model(model_dtype) if model_dtype is not None else "float32"
        pool = KVCache(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                       dtype=name, page_size=page_size, num_pages=num_pages, max_tokens=max_tokens,
                       prefix_caching=prefix_caching, namespace=namespace)
        self._setup(layout, pool, None, RowColumns(0), kernel_threads)
        self._dtype_pending = pending

    @classmethod
    def for_generate(cls, config, batch_size: int, max_length: int, *, num_beams: int = 1, page_size: int = 16,
                     **kwargs) -> "PagedCache":
        """A cache sized for one ``generate()`` call: ``batch_size`` prompts, ``num_beams`` beams, up to
        ``max_length`` columns per row (prompt columns, pads included, + max_new_tokens); `decode.hf.sizing`
        says why ``batch_size * num_beams * (ceil(max_length / page_size) + 1)`` pages always suffice. Other
        keyword arguments as for `PagedCache` (dtype, prefix_caching, ...)."""
        if "max_tokens" in kwargs or "num_pages" in kwargs:
            raise TypeError("for_generate: expected no max_tokens / num_pages (it computes them), got "
                            f"{sorted(set(kwargs) & {'max_tokens', 'num_pages'})}")
        pages = sizing.pages_for_generate(batch_size, max_length, page_size, num_beams)
        return cls(config, num_pages=pages, page_size=page_size, **kwargs)

    def _setup(self, layout: ModelLayout, pool: KVCache, seqs, cols: RowColumns, kernel_threads) -> None:
        self.layout, self.pool, self.kernel_threads = layout, pool, kernel_threads
        super().__init__(layers=[PagedLayer(self, i) for i in range(layout.num_layers)])
        self._seqs, self._cols = seqs, cols
        self._plan = None
        self._record_past = False
        self._prompt_ids = None          # int64 [B, L]: token ids of the columns of the current prompt
        self._next_ids = None            # int64 [B, T]: the next forward's input_ids (`track_token_ids`)
        self._fresh = None               # the first forward's (pool group, pool before it) until it commits
        self._dtype_pending = False
        self._prompt_columns = 0         # columns of the first forward (the prompt), for CacheFullError
        self._checked_model = None       # `check_model`'s key of the config last found right
        self._columns = {}               # decode steps' q / output buffers by shape (`ForwardPlan`'s columns)
        self._all_real = {}              # B -> read-only all-True new_real [B, 1] of a decode step without padding
        self.stats = {"kernel_calls": 0, "forwards": 0, "tokens": 0, "deferred_releases": 0}

    # -- transformers' queries ----------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns seen so far (pads included, as transformers counts them)."""
        self._settle()
        return self._cols.columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx=None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self._seqs is not None

    @property
    def batch_size(self) -> int:
        return -1 if self._seqs is None else len(self._seqs)

    def lengths(self) -> list[int]:
        """Real tokens held for each batch row (its pool sequence's length)."""
        self._settle()
        return [] if self._seqs is None else [self.pool.length(s) for s in self._seqs]

    def fingerprint(self) -> str:
        """`KVCache.fingerprint` of the pool (after rolling back a forward that failed outside our code)."""
        self._settle()
        return self.pool.fingerprint()

    def early_initialization(self, *args, **kwargs) -> None:
        pass

    # -- one forward ----------------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Name this cache to ``layer_idx``'s attention call and hand the new states back unchanged (the
        attention call writes them into the pool: it knows which tokens are padding)."""
        if layer_idx == 0:
            self._settle()
        return handoff.handoff(self, layer_idx, key_states, value_states)

    def attend(self, layer: int, config, query, key, value, new_real, scale, window: int) -> torch.Tensor:
        """Write ``layer``'s new K/V and attend (see `ForwardPlan.run_layer`); the first layer of a forward
        checks the model (``config``) against the cache, validates and plans it, the last commits it. Any
        failure rolls the forward back before it propagates."""
        if self._plan is None:
            if layer != 0:
                raise RuntimeError(f"layer: expected a forward to start at layer 0, got layer {layer}")
            self._begin(config, query, key, new_real)
        plan = self._plan
        try:
            self._check_layer(layer, key, value, window)
            out = plan.run_layer(layer, query, key, value, scale, window)
            self.stats["kernel_calls"] += 1
            if layer == self.layout.num_layers - 1:
                self._commit(plan)
            return out
        except BaseException:
            self._abandon()
            raise

    def _begin(self, config, query, key, new_real) -> None:
        self.check_model(config)
        batch, _, width, _ = query.shape
        fresh = self._seqs is None
        if not fresh and batch != len(self._seqs):
            raise ValueError(f"input batch: expected {len(self._seqs)} rows (the cache's; change them with "
                             f"reorder_cache / batch_select_indices / batch_repeat_interleave, or reset()), got "
                             f"{batch}")
        if new_real is None:                                 # no padding: every row's new columns are real
            new_real = self._all_real.get(batch) if width == 1 else np.ones((batch, width), dtype=bool)
            if new_real is None:                             # a decode step's, made once per batch size
                new_real = self._all_real[batch] = np.ones((batch, 1), dtype=bool)
                new_real.flags.writeable = False
        else:
            held = np.zeros(batch, dtype=bool) if fresh else np.array([self.pool.length(s) > 0 for s in self._seqs])
            check_new_real(new_real, batch, width, held, any(self.layout.windows))
        ids = self._forward_ids(batch, width)
        if fresh:
            self._begin_fresh(key.dtype, new_real, ids)
        else:
            self._follow_model_dtype(key.dtype, rebuild=False)
            self._plan = self._plan_forward(self._seqs, new_real, ids)

    def _begin_fresh(self, model_dtype, new_real, ids) -> None:
        """The first forward: rows created in a pool group (undone with the forward if it fails, sequence-id
        counter included), the pool rebuilt in the model's dtype when the dtype was left to it."""
        old_pool = self.pool
        self._follow_model_dtype(model_dtype)
        group = self.pool.group(span_calls=True)
        try:
            with group:
                seqs = [self.pool.create_sequence() for _ in range(len(new_real))]
                self._prompt_columns = new_real.shape[1]
                self._plan = self._plan_forward(seqs, new_real, ids)
        except BaseException:
            self.pool, self._prompt_columns = old_pool, 0
            raise
        self._fresh = (group, old_pool)
        self._seqs, self._cols = seqs, RowColumns(len(new_real))

    def _plan_forward(self, seqs, new_real, ids) -> ForwardPlan:
        try:
            return ForwardPlan(self.pool, seqs, new_real, self.kernel_threads, ids, self._columns)
        except CacheFullError as err:
            used = self.pool.config.num_pages - self.pool.num_free_pages
            raise sizing.explain_full(err, page_size=self.pool.config.page_size, rows=len(seqs),
                                      columns=self._cols.columns, prompt_columns=self._prompt_columns,
                                      forward_columns=new_real.shape[1], pages_used=used) from None

    def _follow_model_dtype(self, model_dtype, rebuild: bool = True) -> None:
        """dtype=None and no dtype in the config: the pool (float32 until now) takes the model's dtype; refused
        when the pool is in use already (rows made by match_prefix)."""
        if self._dtype_pending:
            self.pool = storage.pool_for_model(self.pool, model_dtype, rebuild)

    def check_model(self, config) -> None:
        """ValueError unless ``config`` (the model's) has this cache's layout: layers, q / kv heads, head_dim,
        sliding windows (a cache built for a deeper or shallower model, or another model's cache). The config
        last found right is remembered by identity and the attributes the layout is read from (`layout_of`
        takes ~0.3-0.9 ms)."""
        key = layout_key(config)
        if key == self._checked_model:
            return
        got = layout_of(config)
        if got == self.layout:
            self._checked_model = key
            return
        if got != self.layout:
            raise ValueError(f"past_key_values: expected a PagedCache built for this model ({got.describe()}), got "
                             f"one built for {self.layout.describe()}")

    def _forward_ids(self, batch: int, width: int):
        """``[B, T]`` token ids of this forward's columns if known (the model's input_ids through
        `track_token_ids`, else the prompt given to `match_prefix`), or None."""
        if not self.pool.prefix_caching:
            return None
        ids, self._next_ids = self._next_ids, None
        if ids is not None and ids.shape == (batch, width):
            return ids
        start = self._cols.columns if self._seqs is not None else 0
        prompt = self._prompt_ids
        if prompt is not None and prompt.shape[0] == batch and start + width <= prompt.shape[1]:
            return prompt[:, start:start + width]
        return None

    # -- prefix reuse ---------------------------------------------------------------------------------------
    def track_token_ids(self, model):
        """Hand the pool the token ids of every forward of ``model`` (its ``input_ids``; a forward pre-hook),
        so generated tokens' pages are registered too. Returns the hook's handle (``.remove()`` undoes it)."""
        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self._next_ids = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else None
        return model.register_forward_pre_hook(hook, with_kwargs=True)

    def match_prefix(self, input_ids, attention_mask=None) -> int:
        """Start every row of an empty cache from the longest prefix of its real tokens the pool holds; the same
        number of columns for every row (transformers counts columns), at most ``L - 1``. Also remembers the
        prompt's ids for registration. ``input_ids [B, L]``, ``attention_mask [B, L]`` (1: real). Returns the
        columns reused (generate() then computes columns ``reused ..``)."""
        self._settle()
        if not self.pool.prefix_caching:
            raise ValueError("match_prefix: expected a PagedCache built with prefix_caching=True, got False")
        if self._seqs is not None:
            raise ValueError("match_prefix: expected an empty cache (new, or after reset()), got one holding rows")
        ids, mask = pool_rows.prompt_arrays(input_ids, attention_mask)
        seqs, columns = pool_rows.match(self.pool, ids, mask)
        cols = RowColumns(len(ids))
        cols.extend(mask[:, :columns])
        self._seqs, self._cols, self._prompt_ids = seqs, cols, ids.astype(np.int64)
        return columns

    def _check_layer(self, layer: int, key, value, window: int) -> None:
        lay = self.layout
        if layer >= lay.num_layers:
            raise ValueError(f"layer: expected < {lay.num_layers} (the cache's layers), got {layer}")
        expected = (lay.num_kv_heads, lay.head_dim)
        for name, x in (("key", key), ("value", value)):
            if (x.shape[1], x.shape[3]) != expected:
                raise ValueError(f"{name}: expected [batch, {lay.num_kv_heads} kv heads, new, {lay.head_dim}] "
                                 f"(the cache was built for {lay.describe()}), got {tuple(x.shape)}")
        if window != lay.windows[layer]:
            raise ValueError(f"sliding_window of layer {layer}: expected {lay.windows[layer] or None} (the cache "
                             f"was built for {lay.describe()}), got {window or None}")

    def _commit(self, plan: ForwardPlan) -> None:
        plan.commit()
        self._plan = None
        self._dtype_pending = False
        if self._fresh is not None:
            self._fresh[0].close()
            self._fresh = None
        self._cols.extend(plan.new_real)
        self.stats["forwards"] += 1
        self.stats["tokens"] += plan.num_tokens
        if not self._record_past:
            try:                # the forward has landed: a failure here keeps the pages (released next time)
                self._release_window()
            except Exception:
                self.stats["deferred_releases"] += 1

    def _abandon(self) -> None:
        if self._plan is not None:
            plan, self._plan = self._plan, None
            plan.rollback()
        if self._fresh is not None:                     # the first forward: its rows go, the pool is as before
            (group, old_pool), self._fresh = self._fresh, None
            group.rollback()
            self.pool, self._seqs, self._cols, self._prompt_columns = old_pool, None, RowColumns(0), 0

    def _settle(self) -> None:
        """Roll back a forward that failed between our calls (its transaction is still open)."""
        if self._plan is not None:
            self._abandon()

    def _release_window(self) -> None:
        """When every layer slides, give back the pages no future query can read (all rows or none)."""
        pool_rows.release_window(self.pool, self._seqs, self.layout.release_window)

    # -- rollback, beams, forks -----------------------------------------------------------------------------
    def activate_past_recording(self) -> None:
        """Keep sliding-window pages until the next `crop` (assisted decoding may roll tokens back)."""
        self._record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` columns (transformers' v5 convention: a count <= 0). ``crop(0)``
        gives back sliding-window pages kept for a rollback."""
        self._settle()
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, (int, np.integer)):
            raise TypeError(f"tokens_to_remove: expected an int <= 0, got {type(tokens_to_remove).__name__}")
        if tokens_to_remove > 0:
            raise ValueError(f"tokens_to_remove: expected a count <= 0 of tokens to remove (transformers v5), got "
                             f"{tokens_to_remove}")
        remove = -int(tokens_to_remove)
        if remove > self._cols.columns:
            raise ValueError(f"tokens_to_remove: expected at most {self._cols.columns} tokens (the cache's length), "
                             f"got {remove}")
        with self.pool.group():                         # every row's truncate and release, or none
            if remove:
                lengths = self._cols.lengths_after_crop(self._cols.columns - remove)
                pool_rows.truncate(self.pool, self._seqs, lengths, self.layout.release_window)
            self._release_window()
        if remove:
            self._cols.crop(self._cols.columns - remove)

    def reorder_cache(self, beam_idx) -> None:
        """Row i takes the tokens of row ``beam_idx[i]`` (beam search): pages are shared (fork), never copied;
        a later write into a shared page copies that page first."""
        self._select_rows(beam_idx, "beam_idx")

    def batch_select_indices(self, indices) -> None:
        self._select_rows(indices, "indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
            raise ValueError(f"repeats: expected an int >= 1, got {repeats!r}")
        if self._seqs is not None:
            self._select_rows(np.repeat(np.arange(len(self._seqs)), int(repeats)), "repeats")

    def _select_rows(self, rows, name: str) -> None:
        self._settle()
        if self._seqs is None:
            raise ValueError(f"{name}: expected a cache holding rows (after a forward), got an empty cache")
        rows = pool_rows.row_index(rows, len(self._seqs), name)
        seqs = pool_rows.select(self.pool, self._seqs, rows)
        self._seqs, self._cols = seqs, self._cols.select(rows)
        self._prompt_ids = None                          # rows moved: the prompt's ids no longer line up

    def fork(self) -> "PagedCache":
        """An independent cache sharing every page of this one (copy-on-write; no K/V copied)."""
        self._settle()
        child = PagedCache.__new__(PagedCache)
        with self.pool.group():
            seqs = None if self._seqs is None else [self.pool.fork(s) for s in self._seqs]
        child._setup(self.layout, self.pool, seqs, self._cols.copy(), self.kernel_threads)
        child._record_past, child._dtype_pending = self._record_past, self._dtype_pending
        child._prompt_columns = self._prompt_columns
        return child

    def __deepcopy__(self, memo) -> "PagedCache":
        return self.fork()

    def reset(self) -> None:
        """Free every row; the cache is empty (as new) and takes any batch size at its next forward (with
        prefix caching, the rows' registered pages stay cached for `match_prefix`)."""
        self._settle()
        self._free_rows()
        self._cols = RowColumns(0)
        self._prompt_ids = None

    def _free_rows(self) -> None:
        if self._seqs is not None:
            pool_rows.free(self.pool, self._seqs)
            self._seqs = None

    def __del__(self):
        try:
            self._abandon()
            self._free_rows()
        except Exception:               # interpreter shutdown, or the pool is gone already
            pass

    def __repr__(self) -> str:
        return (f"PagedCache({self.layout.describe()}; rows {self.lengths()}, columns {self._cols.columns}; pool "
                f"{self.pool.num_free_pages}/{self.pool.config.num_pages} pages free)")
