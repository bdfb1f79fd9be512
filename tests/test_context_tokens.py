"""Token counting: offline encoding, exact counts for every text, and a fallback that is
a provable upper bound (SPEC §4.3)."""

from __future__ import annotations

import random

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from context import tokens as tokens_mod
from context.tokens import (
    FALLBACK_ENCODING,
    OFFLINE_ENCODING,
    TokenCounter,
    fallback_count,
)
from context.turns import to_openai
from gateway.types import Message, ToolCall
from tests.test_context_invariants import KINDS, make_text

ENCODING = tiktoken.get_encoding(OFFLINE_ENCODING)


def exact(text: str) -> int:
    return len(ENCODING.encode_ordinary(text))


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter("gpt-4o-mini")


def test_loads_the_offline_encoding_without_network(counter: TokenCounter) -> None:
    # gpt-4o-mini's own o200k_base is not cached here, so the offline cl100k is used.
    assert counter.encoding_name == OFFLINE_ENCODING
    assert counter.count_text("hello world") == 2


def test_unknown_model_names_use_the_offline_encoding() -> None:
    assert TokenCounter("deepseek-chat").encoding_name == OFFLINE_ENCODING
    assert TokenCounter(None).encoding_name == OFFLINE_ENCODING


def test_damaged_offline_data_falls_back_to_the_byte_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens_mod, "OFFLINE_DATA_SHA256", "0" * 64)
    counter = TokenCounter("gpt-4o-mini")
    assert counter.encoding_name == FALLBACK_ENCODING
    assert counter.count_text("abcdef") == 6  # one per UTF-8 byte
    assert counter.count_text("上下文") == 9


def test_fallback_is_the_utf8_length() -> None:
    assert fallback_count("") == 0
    assert fallback_count("a") == 1
    assert fallback_count("😀") == 4
    assert fallback_count("a\ud800b") == 5  # a lone surrogate: 3 bytes, as tiktoken's U+FFFD


def _sampler_blind_spot(chars: int) -> str:
    """English where a sampling estimate looks (the middle of each eighth), dense Chinese
    everywhere else: the mixed English/Chinese text that was estimated 3× too low."""
    rng = random.Random(5)
    eighth = chars // 8
    out = []
    for _ in range(8):
        english = " ".join(rng.choice(["the", "log", "line", "said", "ok"]) for _ in range(60))[:300]
        side = (eighth - len(english)) // 2
        out.append("".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(side)))
        out.append(english)
        out.append("".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(eighth - side - len(english))))
    return "".join(out)


def test_the_sampler_blind_spot_is_counted_exactly(counter: TokenCounter) -> None:
    text = _sampler_blind_spot(24_000)
    assert counter.count_text(text) == exact(text) > 3 * len(text) // 2


@pytest.mark.parametrize("kind", sorted(set(KINDS)))
@pytest.mark.parametrize("size", [1, 700, 2049, 5000, 60_000])
def test_counts_are_exact_for_every_kind_and_length(counter: TokenCounter, kind: str, size: int) -> None:
    for seed in range(3):
        text = make_text(kind, size, seed)
        assert counter.count_text(text) == exact(text), (kind, size, seed)
        assert counter.count_text(text) == exact(text)  # cached: the same


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300) | st.from_regex(r"[\s\S]{0,50}", fullmatch=True))
def test_counts_are_exact_and_the_fallback_never_lower_for_any_text(text: str) -> None:
    counter = COUNTER
    assert counter.count_text(text) == exact(text)
    # Every BPE token stands for at least one byte of the UTF-8 text: bytes bound it.
    assert fallback_count(text) >= exact(text)


@pytest.mark.parametrize("kind", sorted(set(KINDS)))
def test_the_fallback_bounds_long_texts_of_every_kind(kind: str) -> None:
    for size in (2049, 60_000):
        text = make_text(kind, size, 1)
        assert fallback_count(text) >= exact(text), kind


def test_without_an_encoder_whole_requests_are_never_counted_low(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens_mod, "OFFLINE_DATA_SHA256", "0" * 64)
    bound = TokenCounter("gpt-4o-mini")
    assert bound.encoding_name == FALLBACK_ENCODING
    messages = [
        {"role": "system", "content": make_text("english", 700, 1)},
        {"role": "user", "content": make_text("patchy", 5000, 2)},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "read_file", "arguments": '{"path": "日本.md"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": make_text("mixed", 30_000, 3)},
    ]
    assert bound.count_request(messages, []) >= COUNTER.count_request(messages, [])


COUNTER = TokenCounter("gpt-4o-mini")


def test_message_count_includes_framing_tool_calls_and_ids(counter: TokenCounter) -> None:
    plain = Message("assistant", "done")
    call = Message("assistant", "", tool_calls=(ToolCall("call_1", "read_file", '{"path": "a.md"}'),))
    result = Message("tool", "file text", tool_call_id="call_1")
    assert counter.count_message(plain) == 4 + counter.count_text("done")
    assert counter.count_message(call) > counter.count_text('{"path": "a.md"}') + 8
    assert counter.count_message(result) > counter.count_text("file text") + 4
    for msg in (plain, call, result):  # the dict form counts the same
        assert counter.count_dict(to_openai(msg)) == counter.count_message(msg)


def test_images_in_content_parts_are_counted(counter: TokenCounter) -> None:
    msg = {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {}}]}
    assert counter.count_dict(msg) == 4 + counter.count_text("look") + tokens_mod.IMAGE_TOKENS


def test_tool_schemas_are_counted_and_cached(counter: TokenCounter) -> None:
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    first = counter.count_tools(tools)
    assert first > 10
    assert counter.count_tools([dict(tools[0])]) == first  # same JSON, same count
    assert counter.count_tools([]) == 0


def test_request_count_adds_framing(counter: TokenCounter) -> None:
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    expected = 3 + sum(counter.count_dict(m) for m in messages)
    assert counter.count_request(messages, []) == expected
