"""The OpenAI request/response shapes: validation of a request body into (prompt token ids, sampling arguments)
and the JSON of responses and stream chunks. Plain Python (no FastAPI), so it is tested on its own.

Every refusal is an `APIError` whose body is OpenAI's
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``: the message names the field,
what was expected and what was given. A parameter we do not implement (``n > 1``, ``logprobs``, ``echo``,
penalties, ``logit_bias``, tools, ...) is refused by name, never ignored; so is any field we do not know.
Validation happens before anything reaches the engine: a refused request changes nothing in the pool.

Extensions (vLLM's names): ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``return_token_ids``.
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
                 "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "ignore_eos",
                 "stop_token_ids", "return_token_ids"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                               "tool_choice", "response_format", "parallel_tool_calls"}
# field -> the values that mean "not used" (anything else is refused by name: we do not implement it)
NEUTRAL = {"n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
           "best_of": (None, 1), "suffix": (None,), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
           "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
           "parallel_tool_calls": (None, True, False)}
CHAT_ROLES = ("system", "user", "assistant")


class APIError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param)


@dataclass
class Limits:
    """What a request is checked against: the served names, the context length, the vocabulary."""
    model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int | None = None


@dataclass
class ParsedRequest:
    kind: str                                   # "completion" or "chat"
    model: str
    prompt_token_ids: list[int]
    sampling: dict                              # SamplingParams keyword arguments
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


# ---- field validators ------------------------------------------------------------------------------------------

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _opt_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"{name}: expected a boolean, got {value!r}")
    return value


def _token_ids(values, name: str, limits: Limits) -> list[int]:
    if not all(_is_int(t) and t >= 0 for t in values):
        raise bad(name, f"{name}: expected token ids (non-negative integers), got {values!r}"[:300])
    if limits.vocab_size is not None and values and max(values) >= limits.vocab_size:
        raise bad(name, f"{name}: expected token ids < the vocabulary size {limits.vocab_size}, "
                        f"got {max(values)}")
    return list(values)


def check_body(body, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise bad(None, f"request body: expected a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0], f"{unknown[0]}: unsupported parameter (this server implements "
                              f"{', '.join(sorted(allowed))})")
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if name in allowed and value is not None and not _is_neutral(value, neutral):
            raise bad(name, f"{name}: not supported by this server (expected it unset or "
                            f"{' / '.join(repr(v) for v in neutral if v is not None)}), got {value!r}")


def _is_neutral(value, neutral) -> bool:
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral if v is not None)


def check_model(body: dict, limits: Limits) -> str:
    model = body.get("model")
    if model is None:
        return limits.model_names[0]
    if not isinstance(model, str):
        raise bad("model", f"model: expected a string, got {model!r}")
    if model not in limits.model_names:
        raise APIError(404, f"The model `{model}` does not exist (this server serves "
                            f"{', '.join(limits.model_names)}).", "model", code="model_not_found")
    return model


def sampling_args(body: dict, limits: Limits, max_tokens) -> dict:
    """The SamplingParams keyword arguments, every field type- and range-checked."""
    args = {}
    if max_tokens is not None:
        args["max_tokens"] = max_tokens
    temperature = body.get("temperature")
    if temperature is not None:
        if not _is_number(temperature) or temperature < 0:
            raise bad("temperature", f"temperature: expected a number >= 0, got {temperature!r}")
        args["temperature"] = float(temperature)
    top_p = body.get("top_p")
    if top_p is not None:
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise bad("top_p", f"top_p: expected a number in (0, 1], got {top_p!r}")
        args["top_p"] = float(top_p)
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or not (top_k == -1 or top_k >= 1):
            raise bad("top_k", f"top_k: expected -1 (off) or an integer >= 1, got {top_k!r}")
        args["top_k"] = top_k
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not 0 <= seed < 2 ** 63:
            raise bad("seed", f"seed: expected an integer in [0, 2**63), got {seed!r}")
        args["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("stop", f"stop: expected a non-empty string or a list of them, got {stop!r}")
        args["stop"] = tuple(stops)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise bad("stop_token_ids", f"stop_token_ids: expected a list of token ids, got {ids!r}")
        args["stop_token_ids"] = tuple(_token_ids(ids, "stop_token_ids", limits))
    if body.get("ignore_eos") is not None:
        args["ignore_eos"] = _opt_bool(body, "ignore_eos")
    return args


def _max_tokens(body: dict, name: str):
    value = body.get(name)
    if value is not None and (not _is_int(value) or value < 1):
        raise bad(name, f"{name}: expected an integer >= 1, got {value!r}")
    return value


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad("stream_options", "stream_options: expected only with \"stream\": true, got it with stream off")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options", f"stream_options: expected {{\"include_usage\": bool}}, got {options!r}")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise bad("stream_options", f"stream_options.include_usage: expected a boolean, got {value!r}")
    return value


def check_length(prompt_ids: list[int], max_tokens, limits: Limits, prompt_name: str, tokens_name: str) -> int:
    """The prompt fits the context and leaves room for max_tokens; returns max_tokens (default: the rest)."""
    n = len(prompt_ids)
    if n == 0:
        raise bad(prompt_name, f"{prompt_name}: expected a non-empty prompt, got 0 tokens")
    if n >= limits.max_model_len:
        raise bad(prompt_name, f"{prompt_name}: this model's maximum context length is {limits.max_model_len} "
                               f"tokens; expected a prompt of at most {limits.max_model_len - 1} tokens (room for "
                               f"one generated token), got {n}")
    if max_tokens is None:
        return limits.max_model_len - n
    if n + max_tokens > limits.max_model_len:
        raise bad(tokens_name, f"{tokens_name}: this model's maximum context length is {limits.max_model_len} "
                               f"tokens; the prompt has {n}, so expected {tokens_name} <= "
                               f"{limits.max_model_len - n}, got {max_tokens}")
    return max_tokens


# ---- the two endpoints -----------------------------------------------------------------------------------------

def completion_prompt(body: dict, tokenizer, limits: Limits) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                              # a batch of one
    if isinstance(prompt, str):
        if tokenizer is None:
            raise bad("prompt", "prompt: this server has no tokenizer; expected a list of token ids")
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return _token_ids(prompt, "prompt", limits)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", f"prompt: expected one prompt (a string or a list of token ids), got a batch of "
                            f"{len(prompt)}; send one request per prompt")
    raise bad("prompt", f"prompt: expected a non-empty string or a non-empty list of token ids, got {prompt!r}"[:300])


def parse_completion(body, tokenizer, limits: Limits) -> ParsedRequest:
    check_body(body, COMPLETION_FIELDS)
    model = check_model(body, limits)
    stream = _opt_bool(body, "stream")
    include_usage = _stream_options(body, stream)
    max_tokens = _max_tokens(body, "max_tokens")
    sampling = sampling_args(body, limits, None)
    ids = completion_prompt(body, tokenizer, limits)
    sampling["max_tokens"] = check_length(ids, 16 if max_tokens is None else max_tokens, limits,
                                          "prompt", "max_tokens")
    return ParsedRequest("completion", model, ids, sampling, stream, include_usage,
                         _opt_bool(body, "return_token_ids"))


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"messages: expected a non-empty list of messages, got {messages!r}"[:300])
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise bad("messages", f"{where}: expected {{\"role\", \"content\"}} (names, tool calls are not "
                                  f"supported), got {message!r}"[:300])
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise bad("messages", f"{where}.role: expected one of {CHAT_ROLES}, got {role!r}")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) and set(p) == {"type", "text"}
                                             for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad("messages", f"{where}.content: expected a string or a list of text parts, got "
                                  f"{content!r}"[:300])
        out.append({"role": role, "content": content})
    return out


def parse_chat(body, tokenizer, limits: Limits) -> ParsedRequest:
    check_body(body, CHAT_FIELDS)
    model = check_model(body, limits)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("response_format", f"response_format: only {{\"type\": \"text\"}} is supported, got {fmt!r}")
    stream = _opt_bool(body, "stream")
    include_usage = _stream_options(body, stream)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(body, name)
    sampling = sampling_args(body, limits, None)
    messages = chat_messages(body)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad("messages", "messages: this model's tokenizer has no chat template; use /v1/completions")
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))
    sampling["max_tokens"] = check_length(ids, max_tokens, limits, "messages", name)
    return ParsedRequest("chat", model, ids, sampling, stream, include_usage, _opt_bool(body, "return_token_ids"))


# ---- responses -------------------------------------------------------------------------------------------------

def usage(num_prompt: int, num_generated: int, num_cached: int = 0) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_generated,
            "total_tokens": num_prompt + num_generated, "prompt_tokens_details": {"cached_tokens": num_cached}}


def _envelope(req: ParsedRequest, chunk: bool) -> dict:
    if req.kind == "completion":
        return {"id": "cmpl-" + req.request_id, "object": "text_completion", "created": req.created,
                "model": req.model}
    return {"id": "chatcmpl-" + req.request_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": req.created, "model": req.model}


def _choice(req: ParsedRequest, text: str, token_ids, finish_reason, stop_reason, chunk: bool, first=False) -> dict:
    if req.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None}
    elif chunk:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
    choice["finish_reason"] = finish_reason
    choice["stop_reason"] = stop_reason
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return choice


def final_response(req: ParsedRequest, out) -> dict:
    """The whole response of a non-streamed request from its last RequestOutput."""
    body = _envelope(req, chunk=False)
    body["choices"] = [_choice(req, out.text or "", out.output_token_ids, out.finish_reason, out.stop_reason, False)]
    body["usage"] = usage(out.num_prompt_tokens, len(out.output_token_ids), out.num_cached_tokens or 0)
    if req.return_token_ids:
        body["prompt_token_ids"] = list(out.prompt_token_ids)
    return body


def stream_chunk(req: ParsedRequest, out, first: bool) -> dict:
    """One SSE chunk: the new text (and token ids) of one RequestOutput."""
    body = _envelope(req, chunk=True)
    finish, stop = (out.finish_reason, out.stop_reason) if out.finished else (None, None)
    body["choices"] = [_choice(req, out.text_delta or "", out.new_token_ids, finish, stop, True, first)]
    if req.include_usage:
        body["usage"] = None
    return body


def usage_chunk(req: ParsedRequest, out) -> dict:
    body = _envelope(req, chunk=True)
    body["choices"] = []
    body["usage"] = usage(out.num_prompt_tokens, len(out.output_token_ids), out.num_cached_tokens or 0)
    return body


def model_card(name: str, created: int, random_weights: bool, max_model_len: int, description: str) -> dict:
    return {"id": name, "object": "model", "created": created,
            "owned_by": "kvengine (random weights, not a trained model)" if random_weights else "kvengine",
            "random_weights": random_weights, "max_model_len": max_model_len, "description": description}
