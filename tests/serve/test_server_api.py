"""The official `openai` client against `kvengine serve`'s app (in-process, 127.0.0.1, free port): completions,
chat, streaming, stop, max_tokens, seed, usage counts; bad requests refused by name with the pool untouched."""
import json

import httpx2
import openai
import pytest
from transformers import AutoTokenizer

from .harness import MODEL_NAME, completion_body, engine_stats, metric

GREEDY = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def client(pool_checked):
    with openai.OpenAI(base_url=pool_checked.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def token_ids(choice) -> list:
    return choice.model_extra["token_ids"]


def test_models_and_health_label_the_random_weights(client, pool_checked):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["random_weights"] is True and "random weights" in models[0].owned_by
    assert httpx2.get(pool_checked.url + "/health").json() == {"status": "ok"}
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    r = httpx2.get(pool_checked.url + "/v1/embeddings")
    assert r.status_code in (404, 405) and "/v1/embeddings" in r.json()["error"]["message"]


def test_completion_text_prompt_usage_and_max_tokens(client, tokenizer):
    prompt = "Kato rine so la mi, the quick ones"
    for max_tokens in (1, 5, 9):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body=GREEDY)
        ids = token_ids(r.choices[0])
        assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert r.usage.completion_tokens == len(ids) == max_tokens
        assert r.usage.total_tokens == r.usage.prompt_tokens + max_tokens
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    default = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0, extra_body=GREEDY)
    assert default.usage.completion_tokens == 16                      # OpenAI's default max_tokens
    assert token_ids(default.choices[0])[:9] == ids                   # greedy: a longer run extends the shorter


def test_completion_token_id_prompt(client):
    prompt = [5, 17, 300, 42, 42, 8, 260]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body=GREEDY)
    assert r.usage.prompt_tokens == len(prompt) and r.model_extra["prompt_token_ids"] == prompt
    batch_of_one = client.completions.create(model=MODEL_NAME, prompt=[prompt], max_tokens=4, temperature=0,
                                             extra_body=GREEDY)
    assert token_ids(batch_of_one.choices[0]) == token_ids(r.choices[0])


def test_chat_goes_through_the_chat_template(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Kato la mi?"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                       extra_body=GREEDY)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.model_extra["prompt_token_ids"] == list(expected)
    assert r.usage.prompt_tokens == len(expected) and r.usage.completion_tokens == 6
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tokenizer.decode(token_ids(r.choices[0]), skip_special_tokens=True)


def test_stream_equals_the_whole_response(client):
    kwargs = dict(model=MODEL_NAME, prompt="So la mi du pe", max_tokens=10, temperature=0, extra_body=GREEDY)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [t for c in text_chunks for t in token_ids(c.choices[0])] == token_ids(whole.choices[0])
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.usage is None for c in text_chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_stream_and_sse_framing(client, pool_checked):
    messages = [{"role": "user", "content": "Du pe an el?"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=7, temperature=0,
                                           extra_body=GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=7, temperature=0,
                                                 stream=True, extra_body=GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 3, "stream": True}
    with httpx2.stream("POST", pool_checked.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


def test_stop_strings_and_stop_token_ids(client, tokenizer):
    kwargs = dict(model=MODEL_NAME, prompt="La mi du", temperature=0)
    base = client.completions.create(max_tokens=14, extra_body=GREEDY, **kwargs)
    text, ids = base.choices[0].text, token_ids(base.choices[0])
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    r = client.completions.create(max_tokens=14, stop=[stop], extra_body=GREEDY, **kwargs)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.usage.completion_tokens == len(token_ids(r.choices[0])) < 14
    stop_id = ids[6]
    first = ids.index(stop_id)
    r = client.completions.create(max_tokens=14, extra_body={**GREEDY, "stop_token_ids": [stop_id]}, **kwargs)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop_id
    assert token_ids(r.choices[0])[:first] == ids[:first] and len(token_ids(r.choices[0])) in (first, first + 1)


def test_seed_reproduces_and_is_independent_of_the_batch(client):
    def sample(seed):
        r = client.completions.create(model=MODEL_NAME, prompt="An el or is", max_tokens=12, temperature=1.0,
                                      seed=seed, extra_body=GREEDY)
        return token_ids(r.choices[0])

    first = sample(123)
    assert sample(123) == first
    assert len({tuple(sample(seed)) for seed in (1, 2, 3, 4)}) > 1
    # the same seeded request, now alongside others in the batch
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(sample, [123, 5, 6, 123, 7, 8]))
    assert results[0] == results[3] == first


BAD_COMPLETIONS = [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "3"}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"temperature": -0.1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"), ({"n": 2}, "n"), ({"logprobs": 1}, "logprobs"),
    ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 1}, "frequency_penalty"), ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"suffix": "x"}, "suffix"), ({"bogus_option": 1}, "bogus_option"), ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"), ({"stop": 5}, "stop"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": []}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, 10 ** 9]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": list(range(1, 600))}, "prompt"),
    ({"prompt": list(range(1, 400)), "max_tokens": 200}, "max_tokens"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"stream": 1}, "stream"),
]
BAD_CHATS = [
    ({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "name": "a"}]}, "messages"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"logprobs": True}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
]


def _post(server, path, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx2.post(server.url + path, content=data, headers={"content-type": "application/json"}, timeout=60)


def _pool_state(server):
    stats = engine_stats(server)
    return {k: stats[k] for k in ("pages_in_use", "prefix_cached_pages", "prompt_tokens_total",
                                  "requests_running", "requests_waiting")}, server.loop.stats()["loop_added"]


@pytest.mark.parametrize("change,param", BAD_COMPLETIONS)
def test_bad_completion_is_400_naming_the_field_and_changes_nothing(pool_checked, change, param):
    before = _pool_state(pool_checked)
    r = _post(pool_checked, "/v1/completions", {"model": MODEL_NAME, "prompt": "La mi", "max_tokens": 3, **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and param in error["message"]
    assert "expected" in error["message"] or "not supported" in error["message"] or "unsupported" in error["message"]
    assert _pool_state(pool_checked) == before


@pytest.mark.parametrize("change,param", BAD_CHATS)
def test_bad_chat_is_400_naming_the_field(pool_checked, change, param):
    before = _pool_state(pool_checked)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **change}
    r = _post(pool_checked, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert _pool_state(pool_checked) == before


def test_malformed_json_unknown_model_and_openai_exceptions(client, pool_checked):
    r = _post(pool_checked, "/v1/completions", b'{"prompt": "x", ')
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = _post(pool_checked, "/v1/completions", [1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="x", max_tokens=2)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, n=2)
    assert info.value.body["param"] == "n"


def test_prompt_larger_than_the_pool_is_refused(start_server):
    small = start_server(max_tokens=64)                     # 4 pages of 16: the pool caps the context at 64
    assert small.loop.engine.max_model_len == 64
    before = _pool_state(small)
    r = _post(small, "/v1/completions", completion_body(list(range(1, 101)), 4))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "64" in r.json()["error"]["message"] and "100" in r.json()["error"]["message"]
    r = _post(small, "/v1/completions", completion_body(list(range(1, 41)), 30))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert _pool_state(small) == before
    ok = _post(small, "/v1/completions", completion_body(list(range(1, 21)), 4))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_metrics_expose_the_pool_and_latency(client, pool_checked):
    generated = metric(pool_checked, "kvengine_generation_tokens_total")
    ttft = metric(pool_checked, "kvengine_time_to_first_token_seconds_count")
    client.completions.create(model=MODEL_NAME, prompt="Mi du pe", max_tokens=5, temperature=0, extra_body=GREEDY)
    assert metric(pool_checked, "kvengine_generation_tokens_total") == generated + 5
    assert metric(pool_checked, "kvengine_time_to_first_token_seconds_count") == ttft + 1
    assert metric(pool_checked, "kvengine_inter_token_latency_seconds_count") >= 4
    stats = engine_stats(pool_checked)
    for name in ("pages_total", "pages_in_use", "requests_running", "requests_waiting"):
        assert metric(pool_checked, f"kvengine_{name}") == stats[name]
    for name in ("preemptions_total", "prefix_cache_hit_tokens_total"):
        assert metric(pool_checked, f"kvengine_{name}") == stats[name]
