"""The transformers integration's tests need the `hf` extra (torch, transformers); skipped without it."""
import importlib.util

collect_ignore_glob = [] if all(importlib.util.find_spec(m) for m in ("torch", "transformers")) else ["*.py"]
