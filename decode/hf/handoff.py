"""The hand-off between `PagedCache.update` and the "pagedkv" attention call of the same layer.

transformers passes no cache to attention functions, so `update` records ``(cache, layer, key, value)`` in a
context variable and returns *pending* stand-ins of the new K/V (`PendingKV`: their shape and dtype, no data).
The "pagedkv" attention takes the real states from the context variable; any other attention (sdpa, eager,
flash, a model compiled by dynamo) that reads the pending stand-ins raises `PagedAttentionRequired` instead of
attending over the new tokens alone (`update` stores nothing: the history lives in the pool, read only by our
kernels).

    handoff(cache, layer, key, value) -> (pending_key, pending_value)     in PagedCache.update
    take(layer) -> Handoff or None                                        in the "pagedkv" attention call
"""
import contextvars
from typing import NamedTuple

import torch

from .layout import UnsupportedFeatureError

_CURRENT = contextvars.ContextVar("pagedkv_handoff", default=None)

# what may be read of a pending view: metadata only (no values)
_METADATA = frozenset({"shape", "size", "dtype", "device", "dim", "ndim", "ndimension", "requires_grad", "layout",
                       "is_floating_point", "numel", "is_cuda", "is_meta", "is_sparse", "is_quantized"})


class PagedAttentionRequired(TypeError):
    """A `PagedCache` was given to a model whose attention is not "pagedkv" (or reads K/V another way)."""


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":                                  # a property getter: Tensor.shape.__get__ -> "shape"
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class PendingKV(torch.Tensor):
    """A view of new K/V states that only the "pagedkv" attention may use (it reads the real tensors from the
    hand-off); every other operation on it raises `PagedAttentionRequired`."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = _name(func)
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise PagedAttentionRequired(
            f"attn_implementation: a decode.hf.PagedCache needs the model on attn_implementation='pagedkv' "
            f"(model.set_attn_implementation('pagedkv') after `import decode.hf`), got code that computes on the "
            f"K/V PagedCache.update returned ({name}): an sdpa / eager / flash attention would attend over the new "
            f"tokens alone (update returns only them), and model code changing K/V between update and attention "
            f"is not what the kernels read")


class Handoff(NamedTuple):
    cache: object
    layer: int
    key: torch.Tensor            # [B, num_kv_heads, T, head_dim] as the model computed them
    value: torch.Tensor
    pending_key: torch.Tensor    # the PendingKV stand-ins update() returned
    pending_value: torch.Tensor


# (role, shape, dtype, device) -> a PendingKV of that shape holding no data (one element, expanded): made once and
# handed back by every layer (a new view per layer cost ~20 µs of a decode step's layer, between the model's GEMMs)
_PENDING = {}
_MOST_PENDING = 64


def _pending(role: str, x: torch.Tensor) -> torch.Tensor:
    meta = (role, x.shape, x.dtype, x.device)
    view = _PENDING.get(meta)
    if view is None:
        if len(_PENDING) >= _MOST_PENDING:
            _PENDING.clear()
        base = torch.empty(1, dtype=x.dtype, device=x.device).expand(x.shape)
        view = _PENDING[meta] = torch.Tensor._make_subclass(PendingKV, base, False)
    return view


def handoff(cache, layer: int, key: torch.Tensor, value: torch.Tensor):
    """Record ``layer``'s new states for its attention call; return the pending stand-ins to hand back: tensors
    of their shapes and dtypes that hold no data (the same objects for every layer of a shape)."""
    if torch.compiler.is_compiling():
        _REFUSE_COMPILE()
    pending = _pending("key", key), _pending("value", value)
    _CURRENT.set(Handoff(cache, layer, key, value, *pending))
    return pending


def take(layer: int) -> Handoff | None:
    """The hand-off of ``layer`` recorded just before in this context, or None (cleared: it serves one call)."""
    current = _CURRENT.get()
    _CURRENT.set(None)
    if current is None or current.layer != layer:
        return None
    return current


def clear() -> None:
    _CURRENT.set(None)


class _CompileRefusal:
    """Called only while dynamo traces (`torch.compile`): dynamo refuses a forbidden callable at once, naming it
    by its repr (the message below), instead of tracing numba / numpy code for a minute and failing deep inside."""

    def __call__(self):
        raise UnsupportedFeatureError(repr(self))

    def __repr__(self) -> str:
        return ("UnsupportedFeatureError('torch.compile: decode.hf.PagedCache and attn_implementation=\"pagedkv\" "
                "run numba kernels over numpy pages, which dynamo cannot trace; run the model uncompiled (the "
                "attention kernels are compiled already)')")


_REFUSE_COMPILE = torch._dynamo.forbid_in_graph(_CompileRefusal())
