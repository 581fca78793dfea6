"""Turn a saved pytest-benchmark JSON into docs/benchmarks.md (tables, target verdicts) and docs/img/*.png.

    python -m benchmarks.report --run                  # run the full suite (~10 min), save the JSON, render
    python -m benchmarks.report RESULTS.json           # render from a saved run
    python -m benchmarks.report RESULTS.json --memory-json MEM.json   # + formula vs measured memory plot
    python -m benchmarks.report --run --memory         # ... and run `python -m decode.app.cli memory --json` too
    python -m benchmarks.report --run -- -k MQA        # after --: extra pytest arguments

The JSON of the run the committed document shows is benchmarks/results/full-run.json. Hand-written notes in
docs/benchmarks.md between ``<!-- notes:begin -->`` and ``<!-- notes:end -->`` survive a re-render.
"""

