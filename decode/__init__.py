"""decode: the Numba single-query decode-attention kernel and the `Decoder` API over `kvcache`."""
import os as _os

from kvcache import jit_cache as _jit_cache

# before any decorator of this package runs: its cached kernels are stamped with its sources and kvcache's
_jit_cache.register(_os.path.dirname(__file__), deps=[_os.path.dirname(_jit_cache.__file__)])

from .batch import batch_extend, batch_step, batch_transaction  # noqa: E402
from .decoder import Decoder  # noqa: E402
from .decoder_transaction import DecoderTransaction  # noqa: E402

__all__ = ["Decoder", "DecoderTransaction", "batch_extend", "batch_step", "batch_transaction"]
