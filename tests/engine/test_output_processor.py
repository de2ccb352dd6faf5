"""Front-end output processing: incremental UTF-8-safe detokenization, stop strings, streaming holds."""
from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.demo.tokenizer import EOS_ID, build_tokenizer_json
from engine.messages import EngineCoreOutput
from engine.frontend.output_processor import IncrementalDetokenizer, RequestState
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
HYPO = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    (path / "tokenizer.json").write_text(build_tokenizer_json(512))
    return Tokenizer(path)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel BPE names byte tokens by)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
          + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@pytest.fixture(scope="module")
def byte_ids(tok) -> list[int]:
    table = _bytes_to_unicode()
    ids = [tok.backend.token_to_id(table[b]) for b in range(256)]
    assert None not in ids
    return ids


def byte_tokens(byte_ids, text: str) -> list[int]:
    return [byte_ids[b] for b in text.encode("utf-8")]


PIECES = ["a", "b", " ", "hello", " world", "é", "ü", "你", "好", "日本語", "🙂", "👍🏽", "\n", "ß", "€", "𝄞"]
texts = st.lists(st.sampled_from(PIECES), min_size=1, max_size=12).map("".join)


def segment(tok, byte_ids, text: str, cuts: list[int], modes: list[bool]) -> list[int]:
    """Tokens for `text`: split at character offsets `cuts`, each chunk BPE- or byte-encoded."""
    bounds = sorted({0, len(text), *[c % (len(text) + 1) for c in cuts]})
    tokens = []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        chunk = text[lo:hi]
        if modes[i % len(modes)]:
            tokens += tok.encode(chunk, add_special_tokens=False)
        else:
            tokens += byte_tokens(byte_ids, chunk)
    return tokens


def stream(detok: IncrementalDetokenizer, tokens: list[int]) -> list[str]:
    return [detok.add(t) for t in tokens]


# ------------------------------------------------------------------------------ detokenization

@HYPO
@given(text=texts, cuts=st.lists(st.integers(0, 100), max_size=5), modes=st.lists(st.booleans(), min_size=1, max_size=4),
       prompt=st.sampled_from(["", "hi ", "你好", "🙂 ok"]))
def test_incremental_equals_full_decode(tok, byte_ids, text, cuts, modes, prompt):
    tokens = segment(tok, byte_ids, text, cuts, modes)
    assert tok.decode(tokens) == text  # the byte-level tokenizer is lossless
    prompt_ids = tok.encode(prompt)
    chunks = stream(IncrementalDetokenizer(tok, prompt_ids), tokens)
    assert "".join(chunks) == text
    for chunk in chunks:
        assert REPLACEMENT not in chunk


def test_emoji_split_into_single_bytes_waits_for_the_last_byte(tok, byte_ids):
    detok = IncrementalDetokenizer(tok, tok.encode("hi"))
    tokens = byte_tokens(byte_ids, "a🙂b")
    assert len(tokens) == 6
    assert stream(detok, tokens) == ["a", "", "", "", "🙂", "b"]


def test_cjk_split_across_bpe_and_byte_tokens(tok, byte_ids):
    raw = "你好".encode()
    # First character: two bytes in one token? use byte tokens; second: BPE's own tokens.
    tokens = [byte_ids[raw[0]], byte_ids[raw[1]], byte_ids[raw[2]]] + tok.encode("好", add_special_tokens=False)
    chunks = stream(IncrementalDetokenizer(tok, [EOS_ID]), tokens)
    assert chunks[:3] == ["", "", "你"]
    assert "".join(chunks) == "你好"


@pytest.mark.parametrize("split", [1, 2, 3])
def test_a_character_split_between_prompt_and_output_stays_split(tok, byte_ids, split):
    """The prompt ends with the first `split` bytes of 🙂 and the completion starts with the rest:
    the completion's text is tokenizer.decode(output_ids) (U+FFFD for its dangling bytes), as
    vLLM reports it -- not the prompt's bytes borrowed to finish the character."""
    raw = "🙂".encode()
    prompt = tok.encode("hi ") + [byte_ids[b] for b in raw[:split]]
    out = [byte_ids[b] for b in raw[split:]] + tok.encode(" ok 你", add_special_tokens=False)
    text = "".join(stream(IncrementalDetokenizer(tok, prompt), out))
    assert text == tok.decode(out) and text.startswith(REPLACEMENT) and text.endswith(" ok 你")


def test_long_prompt_context_does_not_leak_into_output(tok):
    prompt = tok.encode("the cache keeps sixteen tokens per block " * 3)
    out = tok.encode(" and more", add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(tok, prompt), out)) == " and more"


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("ab", add_special_tokens=False) + [EOS_ID] + tok.encode("cd", add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(tok, [0], skip_special_tokens=True), ids)) == "abcd"
    kept = "".join(stream(IncrementalDetokenizer(tok, [0], skip_special_tokens=False), ids))
    assert kept == "ab<|end_of_text|>cd"


# ------------------------------------------------------------------------------ stop strings

def make_state(tok, **params) -> RequestState:
    return RequestState("r", tok.encode("prompt"), SamplingParams(**params), tok)


def feed(state: RequestState, tokens: list[int], finish_last: str | None = None) -> bool:
    stopped = False
    for i, t in enumerate(tokens):
        reason = finish_last if i == len(tokens) - 1 else None
        stopped = state.process(EngineCoreOutput("r", 0, [t], finish_reason=reason))
        if stopped:
            return True
    return stopped


def test_stop_string_spanning_two_tokens(tok):
    tokens = tok.encode("hello world again", add_special_tokens=False)
    pieces = [tok.decode([t]) for t in tokens]
    # Pick a stop string made of the end of one token and the start of the next.
    i = next(i for i in range(len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    prefix = "".join(pieces[:i + 1])[:-2]
    state = make_state(tok, stop=[stop], max_tokens=50)
    assert feed(state, tokens)
    sample = state.samples[0]
    assert sample.text == prefix
    assert sample.finish_reason == "stop" and sample.stop_reason == stop
    assert sample.token_ids == tokens[:i + 2]
    inc = make_state(tok, stop=[stop], max_tokens=50, include_stop_str_in_output=True)
    feed(inc, tokens)
    assert inc.samples[0].text == prefix + stop


def test_stop_string_inside_one_multi_token_output(tok, byte_ids):
    state = make_state(tok, stop=["XY"], max_tokens=50)
    tokens = byte_tokens(byte_ids, "abXYcd")
    assert state.process(EngineCoreOutput("r", 0, tokens))
    assert state.samples[0].text == "ab" and state.samples[0].token_ids == tokens[:4]
    # Later outputs for a finished sample are ignored.
    assert not state.process(EngineCoreOutput("r", 0, byte_tokens(byte_ids, "zz"), finish_reason="abort"))
    assert state.samples[0].text == "ab" and state.samples[0].finish_reason == "stop"


def test_multibyte_stop_string(tok, byte_ids):
    state = make_state(tok, stop=["好"], max_tokens=50)
    assert feed(state, byte_tokens(byte_ids, "你好吗"))
    assert state.samples[0].text == "你"


def test_engine_finish_reason_without_stop_string(tok, byte_ids):
    state = make_state(tok, stop=["zzz"], max_tokens=50)
    assert not feed(state, byte_tokens(byte_ids, "abc"), finish_last="length")
    assert state.samples[0].finish_reason == "length" and state.samples[0].text == "abc"
    assert state.finished


class _FakeTokenizer:
    """decode() over a fixed table: lets a test give one token a long text."""

    def __init__(self, table: dict[int, str]):
        self.table = table

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.table[i] for i in ids)


def test_stop_string_at_start_of_long_token():
    # Real vocabularies have such tokens, e.g. a newline followed by a run of indentation.
    fake = _FakeTokenizer({0: "x", 1: "ab", 2: "\n" + " " * 24, 3: "cd"})
    state = RequestState("r", [0], SamplingParams(stop=["\n"], max_tokens=10), fake)
    stopped = state.process(EngineCoreOutput("r", 0, [1, 2, 3]))
    assert stopped
    assert state.samples[0].text == "ab"


# ------------------------------------------------------------------------------ streaming

def test_unsent_holds_back_possible_partial_stop(tok, byte_ids):
    state = make_state(tok, stop=["world"], max_tokens=50)
    sample = state.samples[0]
    sent = []
    for ch in "hello wor":
        feed(state, byte_tokens(byte_ids, ch))
        text, _, _ = state.unsent(sample)
        sent.append(text)
        # Never more than len(text) - (len("world") - 1) characters have gone out.
        assert sample.emitted <= max(0, len(sample.text) - 4)
    assert "".join(sent) == "hello"
    assert feed(state, byte_tokens(byte_ids, "ld!"))
    text, tokens, _ = state.unsent(sample)
    assert "".join(sent) + text == "hello " and sample.finish_reason == "stop"
    assert tokens == byte_tokens(byte_ids, "ld")  # the '!' after the stop string is never processed


def test_unsent_tokens_and_text_flush_on_finish(tok, byte_ids):
    state = make_state(tok, stop=["zz"], max_tokens=50)
    sample = state.samples[0]
    tokens = byte_tokens(byte_ids, "abcz")
    feed(state, tokens[:3])
    text, toks, _ = state.unsent(sample)
    assert text == "ab" and toks == tokens[:3]
    feed(state, tokens[3:], finish_last="length")
    text, toks, _ = state.unsent(sample)
    assert text == "cz" and toks == tokens[3:]
    assert state.unsent(sample) == ("", [], [])


def test_unsent_without_stop_strings_sends_everything(tok, byte_ids):
    state = make_state(tok, max_tokens=50)
    feed(state, byte_tokens(byte_ids, "abc"))
    assert state.unsent(state.samples[0])[0] == "abc"


@HYPO
@given(text=st.text(alphabet="abc ", min_size=1, max_size=30), stop=st.text(alphabet="abc ", min_size=1, max_size=4),
       include=st.booleans(), per_call=st.integers(1, 3))
def test_streamed_text_equals_final_text_and_never_leaks_stop(tok, byte_ids, text, stop, include, per_call):
    state = make_state(tok, stop=[stop], max_tokens=100, include_stop_str_in_output=include)
    sample = state.samples[0]
    tokens = byte_tokens(byte_ids, text)
    sent = ""
    for i in range(0, len(tokens), per_call):
        last = i + per_call >= len(tokens)
        if state.process(EngineCoreOutput("r", 0, tokens[i:i + per_call], finish_reason="length" if last else None)):
            pass
        sent += state.unsent(sample)[0]
        if sample.finish_reason:
            break
    sent += state.unsent(sample)[0]
    position = text.find(stop)
    if position < 0:
        expected, reason = text, "length"
    else:
        expected, reason = text[:position + (len(stop) if include else 0)], "stop"
    assert sample.text == expected and sample.finish_reason == reason
    assert sent == expected
    if not include:
        assert stop not in sent
