"""The request messages' JSON cache: the same bytes as encoding afresh, and bounded."""

from __future__ import annotations

import json
from typing import Any

from gateway.model.transport import MessageJson


def test_the_cache_encodes_what_json_dumps_does_and_stays_bounded() -> None:
    cache = MessageJson(limit=8, max_bytes=1 << 20, max_item_bytes=200)
    kept: list[dict[str, Any]] = []
    for round_ in range(30):
        kept.append({"role": "user", "content": f"message {round_} é \u2028"})
        window = [*kept[-12:], {"role": "assistant", "content": "x" * 300}]  # too big to keep
        assert json.loads(cache.encode(window)) == window
        assert cache.encode(window) == json.dumps(window).encode()
        assert len(cache._new) + len(cache._old) <= 16  # two generations of `limit`


def test_a_new_dict_at_a_reused_address_is_encoded_afresh() -> None:
    cache = MessageJson()
    first = {"role": "user", "content": "one"}
    assert cache.encode([first]) == b'[{"role": "user", "content": "one"}]'
    key = id(first)
    # What the cache holds keeps `first` alive, so no other dict can take its address;
    # a different dict is never answered with its bytes even if the key matched.
    cache._new[key] = ({"role": "user", "content": "other"}, b"stale")
    assert cache.encode([first]) == b'[{"role": "user", "content": "one"}]'


def test_the_byte_bound_retires_a_generation() -> None:
    cache = MessageJson(limit=1000, max_bytes=100, max_item_bytes=1000)
    messages = [{"role": "user", "content": "y" * 40} for _ in range(10)]
    for m in messages:
        cache.encode([m])
    assert cache._new_bytes <= 100 + 60 and len(cache._new) + len(cache._old) < 10
