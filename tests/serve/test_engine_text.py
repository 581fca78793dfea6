"""Text out of the engine: incremental detokenization (partial UTF-8 characters held back), stop strings (the
text cut before them, never streamed), text prompts."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from decode.serve import Engine, SamplingParams  # noqa: E402
from decode.serve.output_text import OutputText  # noqa: E402
from decode.serve.fixtures import (AsciiTokenizer, ByteTokenizer, random_prompts, reference_greedy,  # noqa: E402
                                  tiny_llama)

VOCAB = 256


@pytest.fixture(scope="module")
def served():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                  # tiny model: see test_engine.py
    yield tiny_llama(torch.float64, vocab=VOCAB, seed=5)
    torch.set_num_threads(threads)


def feed(text: OutputText, ids) -> list:
    deltas = []
    for token in ids:
        text.add(token)
        deltas.append(text.delta(False))
    text.flush()
    deltas.append(text.delta(True))
    return deltas


def test_partial_utf8_characters_are_held_back():
    words = "añb€c😀d"
    ids = ByteTokenizer().encode(words)
    assert len(ids) > len(words)                               # multi-byte characters span several tokens
    deltas = feed(OutputText(ByteTokenizer()), ids)
    assert "".join(deltas) == words
    assert not any("\ufffd" in d for d in deltas)


def test_an_unfinished_character_at_the_end_is_decoded_as_the_full_decode_would():
    ids = ByteTokenizer().encode("ab€")[:-1]                  # the euro sign cut short
    deltas = feed(OutputText(ByteTokenizer()), ids)
    assert "".join(deltas) == ByteTokenizer().decode(ids) == "ab\ufffd"


@pytest.mark.parametrize("stop", [("cde",), ("zz", "de"), ("e",)])
def test_stop_strings_cut_the_text_and_never_stream_it(stop):
    ids = ByteTokenizer().encode("abcdefgh")
    text = OutputText(ByteTokenizer(), stop)
    deltas = []
    for token in ids:
        text.add(token)
        deltas.append(text.delta(text.stopped_by is not None))
        if text.stopped_by:
            break
    first = min(("abcdefgh".find(s), s) for s in stop if s in "abcdefgh")
    assert text.stopped_by == first[1]
    assert "".join(deltas) == text.text == "abcdefgh"[:first[0]]
    assert len(text.ids) == first[0] + len(first[1])          # stopped at the token completing it


def test_engine_stop_string_and_text_match_the_reference(served):
    reference, model = served
    tok = AsciiTokenizer()
    eng = Engine(model, tok, max_tokens=2048, block_size=8)
    prompt = random_prompts(1, 14, 15, VOCAB, seed=7)[0]
    expected, _ = reference_greedy(reference, prompt, 24)
    full = tok.decode(expected)
    at = next(i for i in range(4, 20) if full.find(full[i:i + 2]) == i)   # a 2-character stop string, first at i
    stop = full[at:at + 2]
    outs = list(eng.stream(prompt, SamplingParams(max_tokens=24, temperature=0, stop=[stop])))
    last = outs[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert last.text == full[:at] and "".join(o.text_delta for o in outs) == last.text
    assert last.output_token_ids == expected[:at + 2]
    plain = eng.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    assert plain.text == full and plain.output_token_ids == expected
    eng.check_invariants()


def test_text_prompts_are_encoded_with_the_tokenizer(served):
    reference, model = served
    tok = AsciiTokenizer()
    eng = Engine(model, tok, max_tokens=2048, block_size=8)
    words = "a text prompt!"
    out = eng.generate([words], SamplingParams(max_tokens=6, temperature=0))[0]
    assert out.prompt_token_ids == tok.encode(words)
    assert out.output_token_ids == reference_greedy(reference, tok.encode(words), 6)[0]
    eng.check_invariants()
