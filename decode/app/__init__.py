"""The programs on top of the library: the ``kvengine`` command (`decode.app.cli`), the demo and its toy model
(`demo`, `tiny_model`), the transformers comparison (`hf_compare`, hf extra) and the memory measurement
(`measure_memory`). No library module imports this package; these modules (and only these, besides tests and
benchmarks) may import `reference`.
"""
