"""decode.distributed: the paged KV cache and its kernels sharded over Ray workers (the `distributed` extra).

    from decode.distributed import ShardedDecoder, DecoderPool
    dec = ShardedDecoder(workers=2, shard="heads", num_q_heads=8, num_kv_heads=2, head_dim=64)
    pool = DecoderPool(workers=2, num_q_heads=8, num_kv_heads=2, head_dim=64)

Importing this package imports ray (`import decode` never does) and sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
first, so that a local instance keeps to loopback (`decode.distributed.runtime`). See docs/distributed.md.
"""
from .failures import NonLoopbackError, WorkerLostError
from .runtime import check_loopback, ray_processes, start_local_ray, stop_local_ray
from .sharded import ShardedDecoder, ShardedTransaction
from .pool import DecoderPool

__all__ = ["ShardedDecoder", "ShardedTransaction", "DecoderPool", "WorkerLostError", "NonLoopbackError",
           "start_local_ray", "stop_local_ray", "check_loopback", "ray_processes"]
