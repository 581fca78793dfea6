"""What numba compiles for: whether its target CPU has an instruction-set feature, for kernels that emit an
instruction only some CPUs have (and would otherwise lower to a library call, or fail to compile)."""
from numba.core import config as _nb_config


def target_has(feature: str) -> bool:
    """Whether numba's compilation target has LLVM feature ``feature`` (for example "f16c", "avx512bf16"):
    NUMBA_CPU_FEATURES when set; False when only NUMBA_CPU_NAME is set (a named target's features are not
    queried: the instruction is not assumed); else the host's, as LLVM reports them."""
    if _nb_config.CPU_FEATURES is not None:
        return f"+{feature}" in _nb_config.CPU_FEATURES.split(",")
    if _nb_config.CPU_NAME is not None:
        return False
    try:
        from llvmlite import binding
        return bool(binding.get_host_cpu_features().get(feature, False))
    except Exception:           # noqa: BLE001  (no feature query: assume none)
        return False
