"""Token counting: offline encoding, exact short texts, conservative long-text estimates."""

from __future__ import annotations

import random

import pytest

from context import tokens as tokens_mod
from context.tokens import (
    EXACT_MAX_CHARS,
    FALLBACK_ENCODING,
    OFFLINE_ENCODING,
    TokenCounter,
    fallback_count,
)
from context.turns import to_openai
from gateway.types import Message, ToolCall


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


def test_damaged_offline_data_falls_back_to_the_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens_mod, "OFFLINE_DATA_SHA256", "0" * 64)
    counter = TokenCounter("gpt-4o-mini")
    assert counter.encoding_name == FALLBACK_ENCODING
    assert counter.count_text("abcdef") == 2  # 6 bytes / 3
    assert counter.count_text("上下文") == 3  # one per CJK character


def test_fallback_estimate_is_deterministic() -> None:
    assert fallback_count("") == 0
    assert fallback_count("a") == 1
    assert fallback_count("😀") == 2


def test_short_texts_are_exact(counter: TokenCounter) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 45
    assert len(text) <= EXACT_MAX_CHARS
    assert counter.count_text(text) == counter.count_exact(text)


def _long_texts() -> list[str]:
    rng = random.Random(3)
    words = "context budget token turn summary memory session gateway deploy config error".split()
    english = " ".join(rng.choice(words) for _ in range(8000))
    log = "\n".join(f"2026-11-0{i % 9 + 1}T10:00:00Z INFO worker[{i % 7}] {rng.choice(words)}" for i in range(3000))
    html = "\n".join(f'<div class="row-{i}"><a href="/p/{i}">link {i}</a></div>' for i in range(2000))
    cjk = "上下文窗口被塞满了工具调用返回了一大段日志历史信息会话记忆压缩预算模型回复用户" * 400
    mixed = english[:20000] + cjk[:8000]
    code = "\n".join(f"def f{i}(x):\n    return x * {i} + {rng.random()}" for i in range(1500))
    return [english, log, html, cjk, mixed, mixed[::-1], code]


def test_long_text_estimates_are_conservative_and_close(counter: TokenCounter) -> None:
    for text in _long_texts():
        assert len(text) > EXACT_MAX_CHARS
        exact, estimate = counter.count_exact(text), counter.count_text(text)
        assert exact <= estimate <= exact * 1.25, (exact, estimate)


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
