"""What a caller hands the engine and what it gets back: `SamplingParams` (validated at construction),
`RequestOutput` (one per request per step that produced something) and `RequestRejected` (a request refused
before anything changed; ``.param`` names the field, the message says what was expected and what was given).
"""
import math
import numbers
from dataclasses import dataclass, field


class RequestRejected(ValueError):
    """A request the engine refuses (bad sampling parameters, a prompt too long for the model or the pool, ...);
    nothing in the engine or its pool changed. ``param``: the field at fault (``"max_tokens"``,
    ``"prompt_token_ids"``, ...), so a server can name it in an OpenAI-style error body."""

    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(f"{param}: {message}")


def _int(name, value, minimum=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RequestRejected(name, f"expected an integer, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise RequestRejected(name, f"expected an integer >= {minimum}, got {value}")
    return int(value)


def _real(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RequestRejected(name, f"expected a finite number, got {type(value).__name__} {value!r}")
    return float(value)


def _token_ids(name, values) -> tuple:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise RequestRejected(name, f"expected a list of token ids, got {type(values).__name__}")
    return tuple(_int(f"{name}[{i}]", v, 0) for i, v in enumerate(values))


def _strings(name, values) -> tuple:
    if isinstance(values, str):
        values = (values,)
    if not hasattr(values, "__iter__"):
        raise RequestRejected(name, f"expected a string or a list of strings, got {type(values).__name__}")
    values = tuple(values)
    for i, s in enumerate(values):
        if not isinstance(s, str) or not s:
            raise RequestRejected(name, f"expected non-empty strings, got {s!r} at index {i}")
    return values


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    max_tokens      new tokens at most (an int >= 1); the request also stops at the engine's ``max_model_len``
    temperature     >= 0; 0 = greedy (argmax; top_p / top_k are then ignored)
    top_p           in (0, 1]: sample from the smallest set of tokens whose probability reaches top_p
    top_k           -1 (all tokens) or an int >= 1
    seed            None or an int >= 0: the request draws from a generator of its own (its samples do not
                    depend on the other requests of the batch); None: the engine's shared generator
    stop_token_ids  token ids that end the request (finish_reason "stop", stop_reason = the id); the id is kept
                    in output_token_ids
    stop            strings that end the request when they appear in the detokenized text (needs a tokenizer);
                    the text is cut before the stop string, stop_reason = the string
    ignore_eos      keep going past the model's end-of-sequence token(s)
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple = field(default=())
    stop: tuple = field(default=())
    ignore_eos: bool = False

    def __post_init__(self):
        put = object.__setattr__
        put(self, "max_tokens", _int("max_tokens", self.max_tokens, 1))
        temperature = _real("temperature", self.temperature)
        if temperature < 0:
            raise RequestRejected("temperature", f"expected a number >= 0, got {temperature}")
        put(self, "temperature", temperature)
        top_p = _real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise RequestRejected("top_p", f"expected a number in (0, 1], got {top_p}")
        put(self, "top_p", top_p)
        top_k = _int("top_k", self.top_k)
        if top_k == 0 or top_k < -1:
            raise RequestRejected("top_k", f"expected -1 (all tokens) or an integer >= 1, got {top_k}")
        put(self, "top_k", top_k)
        if self.seed is not None:
            put(self, "seed", _int("seed", self.seed, 0))
        put(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        put(self, "stop", _strings("stop", self.stop))
        if not isinstance(self.ignore_eos, bool):
            raise RequestRejected("ignore_eos", f"expected a bool, got {type(self.ignore_eos).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestOutput:
    """One request's state after a step (returned by `Engine.step` for every request that produced a token or
    finished in it).

    new_token_ids / text_delta are this step's; output_token_ids / text everything so far (text is None without
    a tokenizer; the concatenated deltas equal text). finish_reason: None while running, "stop" (eos, a stop
    token or a stop string; stop_reason says which, None for eos), "length" (max_tokens or max_model_len) or
    "abort". num_cached_tokens: prompt tokens served from the prefix cache at admission. Times are
    `time.monotonic()` seconds."""

    request_id: str
    prompt_token_ids: list
    new_token_ids: list
    output_token_ids: list
    text: str | None
    text_delta: str | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    first_token_time: float | None
    arrival_time: float
