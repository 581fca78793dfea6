"""decode: the Numba single-query decode-attention kernel and the `Decoder` API over `kvcache`."""
from .batch import batch_extend, batch_step, batch_transaction
from .decoder import Decoder
from .decoder_transaction import DecoderTransaction

__all__ = ["Decoder", "DecoderTransaction", "batch_extend", "batch_step", "batch_transaction"]
