"""The serving benchmark's fixed workloads (issue 18 §4) and the figures computed from a run's per-request token
times. numpy and the standard library only: the vLLM venv imports it too.

A workload is a list of requests ``{"id", "arrival" (s after the start), "prompt" (token ids), "max_tokens"}``,
drawn from one seed:
* prompt lengths log-normal around ``prompt_median`` (sigma 0.5), clipped to [prompt_min, prompt_max];
* outputs fixed (``new``) or "mixed": uniform in [16, 256];
* arrivals "burst" (all at t = 0) or "poisson" (exponential gaps at ``rate`` requests/s);
* "shared": every prompt starts with the same ``shared_prefix`` tokens (a system prompt), then its own tokens.
"""
from __future__ import annotations

import numpy as np

# name -> (arrivals, outputs, shared prefix)
WORKLOADS = {
    "burst": ("burst", "fixed", False),
    "poisson": ("poisson", "fixed", False),
    "poisson_mixed": ("poisson", "mixed", False),
    "burst_mixed": ("burst", "mixed", False),
    "shared_prefix": ("burst", "fixed", True),
}


def make_workload(name: str, *, requests: int, vocab: int, new: int = 128, prompt_median: int = 512,
                  prompt_min: int = 128, prompt_max: int = 2048, rate: float = 1.0, shared_prefix: int = 1024,
                  seed: int = 0) -> list[dict]:
    arrivals, outputs, shared = WORKLOADS[name]
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(prompt_median), 0.5, requests)), prompt_min, prompt_max)
    lengths = lengths.astype(int)
    if outputs == "mixed":
        max_tokens = rng.integers(16, 257, requests)
    else:
        max_tokens = np.full(requests, new)
    if arrivals == "poisson":
        times = np.cumsum(rng.exponential(1.0 / rate, requests))
        times -= times[0]
    else:
        times = np.zeros(requests)
    prefix = rng.integers(3, vocab, shared_prefix).tolist() if shared else []
    out = []
    for i in range(requests):
        own = rng.integers(3, vocab, int(lengths[i])).tolist()
        out.append({"id": str(i), "arrival": float(times[i]), "prompt": prefix + own,
                    "max_tokens": int(max_tokens[i])})
    return out


def percentile(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def figures(workload: list[dict], token_times: dict) -> dict:
    """Output tokens/s (all output tokens / from the first arrival to the last token), TTFT and ITL p50 / p99 (s),
    from ``token_times[id] = [seconds after the start at which each output token was delivered]``."""
    ttft, itl, total, end = [], [], 0, 0.0
    missing = []
    for r in workload:
        times = token_times.get(r["id"], [])
        if len(times) != r["max_tokens"]:
            missing.append((r["id"], len(times), r["max_tokens"]))
            continue
        ttft.append(times[0] - r["arrival"])
        itl.extend(np.diff(times).tolist())
        total += len(times)
        end = max(end, times[-1])
    start = min(r["arrival"] for r in workload)
    return {"output_tokens": total, "makespan_s": end - start,
            "output_tokens_per_s": total / (end - start) if end > start else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "prompt_tokens": sum(len(r["prompt"]) for r in workload), "requests": len(workload),
            "incomplete": missing}
