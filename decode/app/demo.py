"""`kvengine demo`: a small random transformer decoding greedily, token by token, through the engine.

    python -m decode.app.cli demo [--tokens 256] [--layers 4] [--seed 0] [--dtype float32] [--prompt 32]
                              [--spec-k 4] [--draft-bits 6] [--no-progress]

The model (`decode.app.tiny_model`, NumPy, random weights, no training): token embedding -> ``layers`` x [RMSNorm -> GQA attention with
RoPE at absolute positions -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head (separate
from the embedding). Its K/V live in one `Decoder` with ``num_layers = layers``; the prompt is prefilled with
``tx.extend`` in one transaction, then every generated token is one ``dec.transaction(1)`` with one
``tx.step(layer, q, k, v)`` per layer.

What it checks (any failure: exit status 1 and ``DEMO_FAILED``; a bad option: exit status 2):

1. the engine's logits at every position equal a float64 forward pass over the whole final sequence with no
   cache at all (dense causal attention, `reference.dense`), within a tolerance set by the storage dtype;
2. a naive concat cache (K/V grown with ``np.concatenate`` each step, float64 NumPy attention) decodes the
   same tokens; both are timed (tokens/s), their steps interleaved so both see the same machine load;
3. speculative decoding: a draft (the same model with its weight matrices rounded to 6-bit integers) proposes
   ``spec_k`` tokens, the engine verifies them with one ``extend`` in one transaction, keeps the prefix that
   matches greedy and ``truncate``s the rest away (the draft's own decoder too); the tokens must equal plain
   greedy decoding exactly, and the verify passes' logits the single-step logits;
4. the K/V bytes formula ``2 * layers * batch * tokens * kv_heads * head_dim * bytes`` against the bytes of
   the pages the sequence holds (equal up to the empty slots of the last page);
5. failing calls (NaN in one layer's K in the middle of a token, a transaction larger than the pool) raise and
   leave the cache byte for byte as it was (`KVCache.fingerprint`).

The last line is ``DEMO_OK`` when all of them pass.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from kvcache import CacheFullError
from reference.memory import kv_bytes
from reference.naive_cache import NaiveKVCache

from decode import Decoder
from .tiny_model import TinyTransformer, engine_forward, naive_forward, reference_logits

# Max |engine logit - float64 no-cache logit| allowed, by storage dtype. The logits have a standard deviation
# of about tiny_model.LOGIT_SCALE (4). Measured with the default sizes: float32 storage (and float32 model arithmetic)
# ~2e-5, bound 1e-3 (50x); float16 storage (K/V rounded to 11 significant bits) ~5e-3, bound 0.1 (20x);
# float64 ~4e-14 (arithmetic rounding only), bound 1e-9.
TOLERANCE = {"float64": 1e-9, "float32": 1e-3, "float16": 0.1}


@dataclass
class DemoConfig:
    tokens: int = 256                 # decode steps after the prefill (the sequence grows by this many)
    layers: int = 4
    seed: int = 0
    dtype: str = "float32"            # storage dtype of the KV cache
    prompt: int = 32                  # prompt tokens (prefilled in one transaction)
    spec_k: int = 4                   # draft tokens proposed per speculative round
    draft_bits: int = 6               # the draft: the same model with weights rounded to this many bits
    vocab: int = 1024
    d_model: int = 256
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 768
    page_size: int = 16
    progress: bool = True


@dataclass
class DemoResult:
    config: DemoConfig
    tokens_engine: list = field(default_factory=list)      # prompt + generated
    tokens_naive: list = field(default_factory=list)
    tokens_spec: list = field(default_factory=list)
    logits_engine: np.ndarray | None = None                # [prompt + tokens, vocab]
    logits_reference: np.ndarray | None = None
    max_logit_error: float = math.inf
    max_logit_error_naive: float = math.inf
    tolerance: float = 0.0
    min_margin: float = 0.0                                # smallest top-1 minus top-2 logit over the steps
    engine_tokens_per_s: float = 0.0
    naive_tokens_per_s: float = 0.0
    engine_attn_us: float = 0.0                            # cache + attention time per token (all layers)
    naive_attn_us: float = 0.0
    compile_s: float = 0.0
    acceptance: float = 0.0
    spec_logit_diff: float = math.inf                      # max |verify-pass logits - greedy step logits|
    spec_rounds: int = 0
    pages_used: int = 0
    pages_total: int = 0
    formula_bytes: int = 0
    used_page_bytes: int = 0
    pool_bytes: int = 0
    rollback_checks: dict = field(default_factory=dict)    # name -> passed
    checks: dict = field(default_factory=dict)             # name -> passed

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(self.checks.values())


class Progress:
    """tqdm when available and wanted, otherwise a plain line every eighth of the way."""

    def __init__(self, total: int, desc: str, enabled: bool, log):
        self.total, self.desc, self.log, self.done, self.bar = total, desc, log, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, unit="tok", leave=False, file=sys.stderr)
            except ImportError:
                pass
        self.every = max(1, total // 8)

    def update(self, n: int = 1) -> None:
        n = max(0, min(n, self.total - self.done))
        before, self.done = self.done, self.done + n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and n and (self.done // self.every > before // self.every or self.done == self.total):
            self.log(f"  {self.desc}: {min(self.done, self.total)}/{self.total} tokens")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------------------------------------
# the phases
# ----------------------------------------------------------------------------------------------------------

def make_decoder(cfg: DemoConfig, num_layers: int, capacity: int) -> Decoder:
    return Decoder(num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                   dtype=cfg.dtype, page_size=cfg.page_size, max_tokens=capacity, num_layers=num_layers)


def warm_up(model, cfg: DemoConfig) -> float:
    """Compile (or load from Numba's cache) the kernel for the extend and step shapes; returns seconds."""
    t0 = time.perf_counter()
    dec = make_decoder(cfg, cfg.layers, 4)
    engine_forward(model, dec, [0, 1])
    engine_forward(model, dec, [2])
    return time.perf_counter() - t0


def greedy_both(model, cfg, prompt, log):
    """Greedy decoding twice, step for step interleaved so that both see the same machine load: through one
    `Decoder` (prefill with ``extend``, then ``cfg.tokens`` single-token transactions) and through the naive
    concat cache. Each keeps its own token stream. Returns ``(decoder, {"engine": ..., "naive": ...})`` with
    per path ``tokens``, ``logits [prompt + tokens, vocab]``, ``seconds`` (the decode steps) and
    ``attend_seconds`` (inside cache + attention)."""
    dec = make_decoder(cfg, cfg.layers, cfg.prompt + cfg.tokens + 1)
    caches = [NaiveKVCache(cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.layers)]
    storage = np.dtype(cfg.dtype)
    paths = {"engine": lambda toks, timer=None: engine_forward(model, dec, toks, timer=timer),
             "naive": lambda toks, timer=None: naive_forward(model, caches, toks, storage, timer=timer)}
    runs = {}
    for name, forward in paths.items():
        first = forward(prompt)
        runs[name] = {"tokens": list(prompt) + [int(np.argmax(first[-1]))], "logits": [first],
                      "seconds": 0.0, "attend": [0.0]}
    bar = Progress(cfg.tokens, "decode (engine + naive)", cfg.progress, log)
    for _ in range(cfg.tokens):
        for name, forward in paths.items():
            run_ = runs[name]
            t0 = time.perf_counter()
            row = forward(run_["tokens"][-1:], run_["attend"])
            token = int(np.argmax(row[-1]))
            run_["seconds"] += time.perf_counter() - t0
            run_["logits"].append(row)
            run_["tokens"].append(token)
        bar.update()
    bar.close()
    for run_ in runs.values():
        run_["logits"] = np.concatenate(run_["logits"])
        run_["attend_seconds"] = run_.pop("attend")[0]
    return dec, runs


def speculative(model, cfg, prompt, log):
    """Greedy speculative decoding with rollback; returns (tokens, proposed, accepted, rounds, logits) with
    ``logits [cfg.tokens + 1, vocab]``: the target's logits at positions ``prompt - 1 ..`` (the verify passes).

    Invariant at the top of a round: ``target`` holds K/V of ``tokens[:-1]``; ``tokens[-1]`` (the pending
    token, the target's greedy choice) is not in any cache yet."""
    k_draft, draft_model = cfg.spec_k, model.quantized(cfg.draft_bits)
    capacity = cfg.prompt + cfg.tokens + k_draft + 2
    target = make_decoder(cfg, cfg.layers, capacity)
    draft = make_decoder(cfg, cfg.layers, capacity)
    first = engine_forward(model, target, prompt)
    engine_forward(draft_model, draft, prompt)
    tokens = list(prompt) + [int(np.argmax(first[-1]))]
    goal = cfg.prompt + cfg.tokens + 1                    # as many tokens as plain greedy decoding produced
    proposed = accepted = rounds = 0
    logits = {len(prompt) - 1: first[-1]}                 # position -> the target's logits there
    bar = Progress(cfg.tokens, "speculative", cfg.progress, log)
    while len(tokens) < goal:
        n = len(tokens) - 1                               # committed K/V in the target
        # the draft catches up on committed tokens it has not seen (at most one: the last round's bonus)
        missing = tokens[draft.length:n]
        if missing:
            engine_forward(draft_model, draft, missing)
        proposal = []
        for _ in range(k_draft):
            row = engine_forward(draft_model, draft, (tokens + proposal)[-1:])
            proposal.append(int(np.argmax(row[-1])))
        # verify: pending token + all drafts in one transaction, one extend per layer
        verify = engine_forward(model, target, [tokens[-1]] + proposal)
        greedy = np.argmax(verify, axis=-1)               # greedy[i]: the target's choice after draft i - 1
        m = 0
        while m < k_draft and proposal[m] == int(greedy[m]):
            m += 1
        for i in range(m + 1):
            logits[n + i] = verify[i]
        target.truncate(n + 1 + m)                        # drop the rejected drafts' K/V
        draft.truncate(min(draft.length, n + 1 + m))
        tokens += proposal[:m] + [int(greedy[m])]
        proposed, accepted, rounds = proposed + k_draft, accepted + m, rounds + 1
        bar.update(m + 1)
    bar.close()
    return tokens[:goal], proposed, accepted, rounds, np.array([logits[p] for p in range(len(prompt) - 1, goal - 1)])


def rollback_demo(model, dec: Decoder, token: int, log) -> dict:
    """Failing calls leave the cache exactly as it was: (a) NaN in the last layer's K, after the earlier layers
    of the same token were written; (b) a transaction bigger than the free pages."""
    cache, results = dec.cache, {}
    before, length = cache.fingerprint(), dec.length

    def poisoned(layer, q, k, v):
        if layer == model.cfg.layers - 1:
            k = k.copy()
            k[0, 0, 0] = np.nan
        return tx.step(layer, q[0], k[0], v[0])[None]

    raised = None
    try:
        with dec.transaction(1) as tx:
            model.forward([token], dec.length, poisoned)
    except ValueError as exc:
        raised = exc
        log(f"  NaN in layer {model.cfg.layers - 1}'s K: ValueError: {exc}")
    results["NaN in the last layer's K raises ValueError"] = raised is not None
    results["  ... and the cache is unchanged after it (fingerprint, length)"] = (
        cache.fingerprint() == before and dec.length == length)
    raised = None
    try:
        dec.transaction(cache.num_free_pages * dec.config.page_size + dec.config.page_size + 1)
    except CacheFullError as exc:
        raised = exc
        log(f"  oversized transaction: CacheFullError: {exc}")
    results["a transaction larger than the free pages raises CacheFullError"] = raised is not None
    results["  ... and the cache is unchanged after that too (fingerprint, length)"] = (
        cache.fingerprint() == before and dec.length == length)
    cache.check_invariants()
    return results


# ----------------------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------------------

def run(cfg: DemoConfig, log=print) -> DemoResult:
    """Every phase, printing as it goes; the result carries the figures and ``checks`` (name -> passed)."""
    check_config(cfg)
    res = DemoResult(config=cfg, tolerance=TOLERANCE[cfg.dtype])
    compute = np.float64 if cfg.dtype == "float64" else np.float32
    model = TinyTransformer(cfg, compute)
    log(f"model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.num_q_heads} query / {cfg.num_kv_heads} KV heads "
        f"(GQA) x head_dim {cfg.head_dim}, RoPE, RMSNorm, SwiGLU {cfg.d_ff}, vocab {cfg.vocab}, "
        f"{model.num_parameters / 1e6:.2f} M random parameters; arithmetic {np.dtype(compute).name}, "
        f"KV storage {cfg.dtype}, page size {cfg.page_size}")
    prompt = [int(t) for t in np.random.default_rng(cfg.seed + 1).integers(0, cfg.vocab, cfg.prompt)]
    log(f"prompt: {cfg.prompt} random tokens; greedy decoding {cfg.tokens} steps")

    res.compile_s = warm_up(model, cfg)
    log(f"kernel warm-up (Numba compile or cache load): {res.compile_s:.2f} s")
    dec = _greedy_and_reference(res, model, cfg, prompt, log)
    res.tokens_spec, proposed, accepted, res.spec_rounds, logits_spec = speculative(model, cfg, prompt, log)
    res.acceptance = accepted / proposed
    res.spec_logit_diff = float(np.max(np.abs(logits_spec - res.logits_engine[cfg.prompt - 1:])))
    _memory_figures(res, dec, cfg)
    log("failing calls (the cache must come out byte for byte unchanged)")
    res.rollback_checks = rollback_demo(model, dec, res.tokens_engine[-1], log)
    res.checks = _checks(res, dec.config.bytes_per_page)
    _log_summary(res, dec, (accepted, proposed), log)
    return res


def _greedy_and_reference(res: DemoResult, model, cfg: DemoConfig, prompt: list, log):
    """Greedy decoding by the engine and by the naive cache (`greedy_both`), then the no-cache float64
    recomputation over the final sequence (every position the engine produced logits for); fills ``res`` and
    returns the engine's decoder."""
    dec, runs = greedy_both(model, cfg, prompt, log)
    engine, naive = runs["engine"], runs["naive"]
    res.tokens_engine, res.logits_engine, res.tokens_naive = engine["tokens"], engine["logits"], naive["tokens"]
    res.engine_tokens_per_s, res.naive_tokens_per_s = cfg.tokens / engine["seconds"], cfg.tokens / naive["seconds"]
    res.engine_attn_us = 1e6 * engine["attend_seconds"] / cfg.tokens
    res.naive_attn_us = 1e6 * naive["attend_seconds"] / cfg.tokens
    seq = res.tokens_engine[:-1]                           # the last token was chosen, never fed
    res.logits_reference = reference_logits(model.astype(np.float64), seq)
    res.max_logit_error = float(np.max(np.abs(res.logits_engine - res.logits_reference)))
    res.max_logit_error_naive = float(np.max(np.abs(naive["logits"] - res.logits_reference)))
    top2 = np.sort(res.logits_reference[cfg.prompt - 1:], axis=-1)[:, -2:]
    res.min_margin = float(np.min(top2[:, 1] - top2[:, 0]))
    return dec


def _memory_figures(res: DemoResult, dec, cfg: DemoConfig) -> None:
    """Pages used, the formula's bytes and the pool's, beside each other."""
    cfg_cache = dec.config
    res.pages_total = cfg_cache.num_pages
    res.pages_used = cfg_cache.num_pages - dec.cache.num_free_pages
    res.formula_bytes = kv_bytes(cfg.layers, 1, dec.length, cfg.num_kv_heads, cfg.head_dim,
                                 cfg_cache.dtype.itemsize)
    res.used_page_bytes = res.pages_used * cfg_cache.bytes_per_page
    res.pool_bytes = dec.cache.pool.k_pages(0).nbytes * cfg.layers * 2


def _checks(res: DemoResult, bytes_per_page: int) -> dict:
    return {
        f"engine logits == float64 no-cache recomputation (max |error| {res.max_logit_error:.3g} "
        f"<= {res.tolerance:g})": res.max_logit_error <= res.tolerance,
        "naive concat cache decodes the same tokens": res.tokens_naive == res.tokens_engine,
        "speculative decoding tokens == greedy tokens": res.tokens_spec == res.tokens_engine,
        f"speculative verify logits == greedy step logits (max |diff| {res.spec_logit_diff:.3g})":
            res.spec_logit_diff <= res.tolerance,
        "formula bytes <= bytes of used pages < formula + one page":
            res.formula_bytes <= res.used_page_bytes < res.formula_bytes + bytes_per_page,
        **res.rollback_checks,
    }


def _log_summary(res: DemoResult, dec, drafts: tuple, log) -> None:
    cfg, itemsize = res.config, dec.config.dtype.itemsize
    accepted, proposed = drafts
    generated = res.tokens_engine[cfg.prompt:]
    log("")
    log("summary")
    log(f"  generated        {len(generated)} tokens ({len(set(generated))} distinct), first 16: {generated[:16]}")
    log(f"  throughput       engine {res.engine_tokens_per_s:8.1f} tokens/s   naive concat cache "
        f"{res.naive_tokens_per_s:8.1f} tokens/s   (x{res.engine_tokens_per_s / res.naive_tokens_per_s:.2f}; "
        f"whole model step, {cfg.layers} layers)")
    log(f"  cache+attention  engine {res.engine_attn_us:8.1f} us/token   naive concat cache "
        f"{res.naive_attn_us:8.1f} us/token   (x{res.naive_attn_us / res.engine_attn_us:.2f})")
    log(f"  cache pages      {res.pages_used} used / {res.pages_total} total "
        f"({dec.length} tokens, {cfg.page_size} per page)")
    log(f"  K/V bytes        formula 2*layers*batch*tokens*kv_heads*head_dim*bytes = 2*{cfg.layers}*1*{dec.length}"
        f"*{cfg.num_kv_heads}*{cfg.head_dim}*{itemsize} = {res.formula_bytes:,}; "
        f"used pages hold {res.used_page_bytes:,} (+{res.used_page_bytes - res.formula_bytes:,} in the last page's "
        f"empty slots); whole pool {res.pool_bytes:,}")
    log(f"  logits vs no-cache float64 recomputation: max |error| engine {res.max_logit_error:.3g}, "
        f"naive {res.max_logit_error_naive:.3g} over {len(res.tokens_engine) - 1} positions x {cfg.vocab} "
        f"(tolerance {res.tolerance:g} for {cfg.dtype} storage; smallest top-1/top-2 gap {res.min_margin:.3g})")
    log(f"  speculative      draft = the model with {cfg.draft_bits}-bit weights, k={cfg.spec_k}: "
        f"{accepted}/{proposed} drafts accepted ({100 * res.acceptance:.1f}%), {res.spec_rounds} verify passes "
        f"for {cfg.tokens} tokens, {proposed - accepted} rejected tokens truncated away")
    log("checks")
    for name, passed in res.checks.items():
        log(f"  {'PASS' if passed else 'FAIL'}  {name}")


def config_from_args(args) -> DemoConfig:
    cfg = DemoConfig()
    for name in ("tokens", "layers", "seed", "dtype", "prompt", "spec_k", "draft_bits"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(cfg, name, value)
    cfg.progress = not getattr(args, "no_progress", False)
    return cfg


def check_config(cfg: DemoConfig) -> None:
    """ValueError naming the first bad option."""
    for name, minimum in (("tokens", 1), ("layers", 1), ("prompt", 1), ("spec_k", 1), ("draft_bits", 2)):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    if cfg.dtype not in TOLERANCE:
        raise ValueError(f"dtype: expected one of {sorted(TOLERANCE)}, got {cfg.dtype!r}")


def main(args) -> int:
    t0 = time.perf_counter()
    cfg = config_from_args(args)
    try:
        check_config(cfg)
    except ValueError as exc:
        print(f"kvengine demo: {exc}", file=sys.stderr)
        return 2
    res = run(cfg)
    print(f"total time {time.perf_counter() - t0:.1f} s")
    if not res.ok:
        print("DEMO_FAILED")
        return 1
    print("DEMO_OK")
    return 0
