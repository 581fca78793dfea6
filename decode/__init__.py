"""decode: the Numba single-query decode-attention kernel and the `Decoder` API over `kvcache`."""
from .decoder import Decoder, DecoderTransaction, batch_extend, batch_step, batch_transaction

__all__ = ["Decoder", "DecoderTransaction", "batch_extend", "batch_step", "batch_transaction"]
