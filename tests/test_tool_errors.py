"""Bad tool arguments get a clear "error: …" result the model can act on, never
"failed unexpectedly" and never a logged traceback (SPEC §5.2)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from gateway.keys import workspace_dir
from tests.conftest import GatewayFactory, chat
from tests.fakes.openai_server import FakeModel

CASES: list[tuple[str, dict[str, Any], str]] = [
    ("read_file", {"path": "notes.md", "start_line": 0}, "start_line"),
    ("read_file", {"path": "notes.md", "start_line": 2, "offset": 3}, "either"),
    ("read_file", {"path": "notes.md", "offset": -1}, "offset"),
    ("read_file", {"path": "a" * 5000}, "path"),
    ("read_file", {"path": "a/" * 2500 + "x"}, "path"),
    ("read_file", {"path": ["notes.md"]}, "path"),
    ("read_file", {"path": "notes.md", "lines": 3}, "lines"),
    ("read_file", {"path": "b" * 300}, "path"),
    ("read_file", {"path": "."}, "directory"),
    ("current_time", {"timezone": "America"}, "time zone"),
    ("current_time", {"timezone": 5}, "time zone"),
    ("current_time", {"timezone": "Mars/Olympus"}, "time zone"),
    ("current_time", {"timezone": ["UTC"]}, "time zone"),
    ("current_time", {"timezone": "x" * 5000}, "time zone"),
    ("current_time", {"timezone": "zone.tab"}, "time zone"),
]


async def test_bad_tool_arguments_are_answered_clearly(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    gw = await make_gateway()
    assert gw.services is not None
    workspace = workspace_dir(gw.services.data_dir, "web:alice")
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / "notes.md").write_text("one\ntwo\nthree\n")
    fake_model.tool_calls([(name, args) for name, args, _ in CASES])
    fake_model.reply("done")
    with caplog.at_level(logging.WARNING):
        assert await chat(gw, "alice", "try the tools") == "done"

    results = [m["content"] for m in fake_model.requests[1]["messages"] if m["role"] == "tool"]
    assert len(results) == len(CASES)
    for (name, args, says), result in zip(CASES, results, strict=True):
        assert result.startswith("error: ") and says in result, (name, str(args)[:80], result[:300])
        assert "unexpectedly" not in result and "Traceback" not in result
        assert len(result) < 400  # a 5,000-character argument is not echoed back whole
    assert not [r for r in caplog.records if r.exc_info], "a bad argument logged a traceback"
