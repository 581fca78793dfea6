"""Turn a saved pytest-benchmark JSON into docs/benchmarks.md (tables, target verdicts) and docs/img/*.png.

    python -m benchmarks.report --run                  # run the full suite (~10 min), save the JSON, render
    python -m benchmarks.report RESULTS.json           # render from a saved run
    python -m benchmarks.report RESULTS.json --memory-json MEM.json   # + formula vs measured memory plot
    python -m benchmarks.report --run --memory         # ... and run `python -m decode.app.cli memory --json` too
    python -m benchmarks.report --run -- -k MQA        # after --: extra pytest arguments
    python -m benchmarks.report --peer-json benchmarks/results/vllm-peer-X.json   # issue 20's section from a
                                                       # `python -m benchmarks.vllm_compare --out` file (repeatable)

The JSON of the run the committed document shows is benchmarks/results/full-run.json. Hand-written notes in
docs/benchmarks.md between ``<!-- notes:begin -->`` and ``<!-- notes:end -->`` (and the ``issue20-notes`` and
``hf-path`` blocks) survive a re-render; the issue-20 section is generated from the peer runs the document's header
names unless ``--peer-json`` gives others.
"""

