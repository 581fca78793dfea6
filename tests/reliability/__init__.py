"""The reliability suite (issue 6): bad input, guard pages, enumerated faults, long runs, threads, index width.

A package so that the long-run driver runs as ``python -m tests.reliability.driver``; see docs/reliability.md.
"""
