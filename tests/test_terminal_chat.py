"""`gateway chat` in a real pseudo-terminal, read the way a person reads it: the window
(a pyte terminal emulator fed everything the chat printed). Each answer follows its own
question, also after a crash cut a turn and across a restart; Ctrl+C during an answer
stops it (/stop) and the prompt comes back; lines typed while an answer comes in are
answered in order; warnings never land inside an answer or the
prompt; and the chat never touches another channel's pending events."""

from __future__ import annotations

import asyncio
import codecs
import fcntl
import os
import re
import struct
import sys
import termios
from pathlib import Path
from typing import Any

import pyte

from channels.terminal.channel import TerminalChannel
from gateway.store.postgres import PgStore
from gateway.store.sqlite import Store
from gateway.types import Inbound, inbound_to_dict
from tests.conftest import GatewayFactory, write_config
from tests.fakes.openai_server import FakeModel
from tests.pg import PgServer, create_database

COLUMNS, ROWS = 100, 60  # tall enough that nothing scrolls out of the emulated window


def _controlling_terminal() -> None:
    # In the child, after setsid: the pty becomes its terminal, so ^C sends SIGINT.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Window:
    """A chat process on a pty, and the screen it draws."""

    def __init__(self, columns: int = COLUMNS, rows: int = ROWS) -> None:
        self.columns, self.rows = columns, rows
        self.screen = pyte.Screen(columns, rows)
        self.stream = pyte.Stream(self.screen)
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.raw = ""
        self.changed = asyncio.Event()
        self.closed = asyncio.Event()
        self.master = -1
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, config: Path, cwd: Path) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", self.rows, self.columns, 0, 0))
        self.master = master
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TERM": "xterm-256color", "COLUMNS": str(self.columns),
               "LINES": str(self.rows)}
        env.pop("NO_COLOR", None)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "chat", "--config", str(config), cwd=cwd, env=env,
            stdin=slave, stdout=slave, stderr=slave, start_new_session=True, preexec_fn=_controlling_terminal)
        os.close(slave)
        os.set_blocking(master, False)
        asyncio.get_running_loop().add_reader(master, self._read)

    def _read(self) -> None:
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the child closed the terminal
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(self.master)
            self.closed.set()
            return
        text = self.decoder.decode(data)
        self.raw += text
        self.stream.feed(text)
        self.changed.set()

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    @property
    def lines(self) -> list[str]:
        """The window's rows with text, top to bottom."""
        return [row.rstrip() for row in self.screen.display if row.strip()]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    async def until(self, pattern: str, timeout: float = 30) -> None:
        """Until the window matches `pattern` (re.S)."""
        try:
            async with asyncio.timeout(timeout):
                while re.search(pattern, self.text, re.S) is None:
                    if self.closed.is_set():
                        raise AssertionError(f"the chat ended before showing {pattern!r}:\n{self.text}")
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise AssertionError(f"the window never showed {pattern!r}:\n{self.text}") from None

    async def at_prompt(self) -> None:
        """Until the last row is an empty prompt."""
        await self.until(r"you>\Z")

    async def exit_code(self, timeout: float = 30) -> int:
        assert self.proc is not None
        code = await asyncio.wait_for(self.proc.wait(), timeout)
        await asyncio.wait_for(self.closed.wait(), timeout)
        return code

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self.master >= 0:
            asyncio.get_running_loop().remove_reader(self.master)
            os.close(self.master)
            self.master = -1


def _order(lines: list[str], *wanted: str) -> list[int]:
    """The index of the first row equal to each of `wanted`, in order after the one before."""
    found, start = [], 0
    for text in wanted:
        index = next((i for i in range(start, len(lines)) if lines[i] == text), None)
        assert index is not None, f"{text!r} not found after row {start}:\n" + "\n".join(lines)
        found.append(index)
        start = index + 1
    return found


async def _telegram_pending(data: Path) -> None:
    """A Telegram message accepted by a `gateway run` that died before answering it."""
    store = await Store.open(data / "gateway.sqlite3")
    inbound = Inbound(channel="telegram", chat_id="5", user_id="5", text="hello from telegram", event_id="tg-1")
    await store.record_event("telegram", "tg-1", session_key="telegram:dm:5", inbound=inbound_to_dict(inbound))
    await store.close()


async def _event_status(data: Path, channel: str, event_id: str) -> str | None:
    store = await Store.open(data / "gateway.sqlite3")
    try:
        return await store.event_status(channel, event_id)
    finally:
        await store.close()


async def test_each_answer_follows_its_question_across_a_crash_and_a_restart(
        fake_model: FakeModel, tmp_path: Path) -> None:
    config = write_config(tmp_path, fake_model)
    data = tmp_path / "data"

    first = Window()
    try:
        await first.start(config, tmp_path)
        await first.at_prompt()
        fake_model.reply("Answer **one**\n\n- apples\n- pears", chunks=["Answer ", "**one**\n\n", "- apples\n- pears"],
                         chunk_delay=0.05)
        first.type("question one\r")
        await first.until(r"pears.*you>\Z")
        # Streamed as plain text, then shown rendered in its place: no ** left, once.
        rows = first.lines
        q1, a1 = _order(rows, "you> question one", "bot> Answer one")
        assert a1 == q1 + 1 and "**" not in first.text and first.text.count("Answer one") == 1
        assert [row.strip() for row in rows[a1 + 1:a1 + 3]] == ["• apples", "• pears"]

        fake_model.hang(60)  # question two never gets its answer in this run
        first.type("question two\r")
        await fake_model.wait_requests(2)
        assert first.proc is not None
        first.proc.kill()  # the chat dies mid-turn (a crash, a closed terminal)
        await first.exit_code()
        assert "Traceback" not in first.raw
    finally:
        await first.close()

    await _telegram_pending(data)
    fake_model.clear()
    fake_model.reply("Answer two", chunks=["Answer ", "two"], chunk_delay=0.1)  # the resumed turn
    fake_model.reply("Answer three", chunks=["Answer ", "three"], chunk_delay=0.4)
    fake_model.reply("Answer four")
    fake_model.error(400, {"error": {"message": "the provider refused"}})  # a warning is logged

    second = Window()
    try:
        await second.start(config, tmp_path)
        # The question cut by Ctrl+C is answered before the first prompt, labelled.
        await second.until(r"Answer two.*you>\Z")
        label, quote, answer, _prompt = _order(
            second.lines, "The chat stopped before answering this earlier question:", "you> question two",
            "bot> Answer two", "you>")
        assert quote == label + 1 and answer == quote + 1

        # Question four is typed while answer three is still coming in.
        second.type("question three\r")
        await second.until(r"you> question three\nbot> Answer")
        second.type("question four\r")
        await second.until(r"Answer four.*you>\Z")
        rows = second.lines
        _order(rows, "you> question three", "bot> Answer three", "you> question four", "bot> Answer four", "you>")
        assert second.text.count("question four") == 1  # not echoed into answer three

        second.type("question five\r")
        await second.until(r"the provider refused.*you>\Z")
        rows = second.lines
        reply, warning, prompt = _order(
            rows, "bot> The model provider rejected the request (HTTP 400): the provider refused",
            'warning: model error session="terminal:local" kind="bad_request" detail="the provider refused"',
            "you>")
        assert reply < warning < prompt == len(rows) - 1  # between the answer and the next prompt

        second.type("\x04")  # Ctrl+D
        assert await second.exit_code() == 0
    finally:
        await second.close()

    asked = [request["messages"][-1]["content"] for request in fake_model.requests]
    assert asked == ["question one", "question two", "question two", "question three", "question four",
                     "question five"]
    # The Telegram message waits for `gateway run`: chat neither answered it nor sent it to the model.
    assert await _event_status(data, "telegram", "tg-1") == "accepted"
    log = (data / "chat.log").read_text()
    assert log.count('"turn ended"') == 5  # one, two (resumed), three, four, five
    assert "question" not in log


async def test_ctrl_c_mid_answer_stops_it_and_nothing_is_asked_again(fake_model: FakeModel, tmp_path: Path) -> None:
    config = write_config(tmp_path, fake_model)
    chunks = [f"word{i} " for i in range(100_000)]  # streams for longer than the test runs
    fake_model.reply("".join(chunks), chunks=chunks, chunk_delay=0.02)
    window = Window()
    try:
        await window.start(config, tmp_path)
        await window.at_prompt()
        window.type("tell me everything\r")
        await window.until(r"word5 ")
        window.type("\x03")  # Ctrl+C mid-answer: /stop
        await window.until(r"\[stopped\]\nyou>\Z")
        assert await fake_model.wait_disconnects(1) == [0]
        window.type("and then?\r")
        await window.until(r"bot> echo: and then\?\nyou>\Z")
        assert window.proc is not None and window.proc.returncode is None  # the chat goes on
        _order(window.lines, "you> tell me everything", "     [stopped]", "you> and then?", "bot> echo: and then?")
        window.type("\x04")
        assert await window.exit_code() == 0
        assert "Traceback" not in window.raw
    finally:
        await window.close()
    store = await Store.open(tmp_path / "data" / "gateway.sqlite3")
    try:
        rows = await store.messages("terminal:local")
    finally:
        await store.close()
    assert [m.role for m in rows] == ["user", "assistant", "user", "assistant"]
    assert rows[1].content.startswith("word0 word1 word2 word3 word4") and rows[1].content.endswith("\n\n[stopped]")

    again = Window()  # nothing is asked again at the next start
    try:
        await again.start(config, tmp_path)
        await again.at_prompt()
        assert "earlier question" not in again.text
        again.type("\x04")
        assert await again.exit_code() == 0
    finally:
        await again.close()
    assert [r["messages"][-1]["content"] for r in fake_model.requests] == ["tell me everything", "and then?"]


async def test_ctrl_c_at_the_prompt_ends_the_chat_and_restores_the_terminal(
        fake_model: FakeModel, tmp_path: Path) -> None:
    config = write_config(tmp_path, fake_model)
    window = Window()
    try:
        await window.start(config, tmp_path)
        await window.at_prompt()
        window.type("half a line")
        await window.until(r"you> half a line\Z")
        window.type("\x03")
        assert await window.exit_code() == 0
        assert "Traceback" not in window.raw
        # readline had the terminal in raw mode: the shell gets its line editing and echo back.
        flags = termios.tcgetattr(window.master)[3]
        assert flags & termios.ECHO and flags & termios.ICANON
    finally:
        await window.close()
    assert fake_model.requests == []


async def test_run_leaves_the_terminals_pending_turn_to_the_chat(
        make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    store = await Store.open(data / "gateway.sqlite3")
    for channel, chat_id, text in (("terminal", "local", "asked in the terminal"),
                                   ("web", "alice", "asked on the web")):
        inbound = Inbound(channel=channel, chat_id=chat_id, user_id=chat_id, text=text, event_id=f"{channel}-1")
        await store.record_event(channel, f"{channel}-1", session_key=f"{channel}:{chat_id}",
                                 inbound=inbound_to_dict(inbound))
    await store.close()

    gw = await make_gateway()  # `gateway run`: web, no terminal
    assert gw.services is not None
    for _ in range(200):
        if await gw.services.store.event_status("web", "web-1") in ("answered", "undelivered"):
            break
        await asyncio.sleep(0.05)
    assert await gw.services.store.event_status("web", "web-1") in ("answered", "undelivered")
    assert await gw.services.store.event_status("terminal", "terminal-1") == "accepted"
    assert [request["messages"][-1]["content"] for request in fake_model.requests] == ["asked on the web"]


class Tty:
    """stdout of a terminal, as text (what the chat writes to it)."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None: ...

    def isatty(self) -> bool:
        return True


def _window(text: str, columns: int, rows: int) -> list[str]:
    screen = pyte.HistoryScreen(columns, rows, history=1000)
    pyte.Stream(screen).feed(text.replace("\n", "\r\n"))  # the tty's ONLCR
    scrolled = ["".join(line[x].data for x in range(columns)) for line in screen.history.top]
    return [row.rstrip() for row in scrolled + screen.display if row.strip()]


async def test_a_reply_taller_than_the_window_is_rendered_and_shown_once(monkeypatch: Any) -> None:
    monkeypatch.setattr("shutil.get_terminal_size", lambda *a, **k: os.terminal_size((40, 10)))
    reply = "\n".join(f"- item **{n}**" for n in range(15))  # 15 rows in a 10-row window
    out = Tty()
    terminal = TerminalChannel(out=out)  # type: ignore[arg-type]
    stream = terminal.stream(Inbound(channel="terminal", chat_id="local", user_id="local", text="q", event_id="e"))
    for line in reply.split("\n"):
        await stream.append(line + "\n" if not line.endswith("14**") else line)
        await asyncio.sleep(0)
    await stream.finish(reply)
    shown = _window(out.text, 40, 10)
    # Rendered while it grew: what scrolled above the window was written once, for good.
    assert shown == ["bot>  • item 0", *(f"      • item {n}" for n in range(1, 15))]

    short = TerminalChannel(out=Tty())
    stream = short.stream(Inbound(channel="terminal", chat_id="local", user_id="local", text="q", event_id="f"))
    await stream.append("- item **1**\n- item **2**")
    await stream.finish("- item **1**\n- item **2**")
    assert _window(short.out.text, 40, 10) == ["bot>  • item 1", "      • item 2"]  # type: ignore[attr-defined]


async def test_chat_on_a_shared_database_answers_here_and_leaves_other_channels_to_their_gateways(
        fake_model: FakeModel, tmp_path: Path, pg_server: PgServer) -> None:
    """`gateway chat` beside gateways on PostgreSQL (SPEC §10): it runs the terminal's
    turns and takes over no Telegram session, since it could not deliver the answer."""
    url = await create_database(pg_server)
    store = await PgStore.open(url)
    try:
        inbound = Inbound(channel="telegram", chat_id="5", user_id="5", text="hello from telegram", event_id="tg-1")
        await store.record_event("telegram", "tg-1", session_key="telegram:dm:5", inbound=inbound_to_dict(inbound))
        await store.mark_event("telegram", "tg-1", "queued")  # waiting, and no gateway holds the session
    finally:
        await store.close()
    fake_model.reply("hello, terminal")
    window = Window()
    try:
        await window.start(write_config(tmp_path, fake_model, store={"url": url}), tmp_path)
        await window.at_prompt()
        window.type("hi there\r")
        await window.until(r"hello, terminal.*you>\Z")
        await asyncio.sleep(2.5)  # two sweeps of the database for waiting sessions
        window.type("\x03")
        assert await window.exit_code() == 0
    finally:
        await window.close()
    assert [r["messages"][-1]["content"] for r in fake_model.requests] == ["hi there"]
    store = await PgStore.open(url)
    try:
        assert await store.event_status("telegram", "tg-1") == "queued"
    finally:
        await store.close()


async def test_an_approval_is_a_y_or_n_question_in_the_terminal(fake_model: FakeModel, tmp_path: Path) -> None:
    config = write_config(tmp_path, fake_model, approvals={"tools": {"current_time": "ask"}})
    window = Window()
    try:
        await window.start(config, tmp_path)
        await window.at_prompt()
        fake_model.tool_call("current_time", {"timezone": "Asia/Tokyo"})
        fake_model.reply("It is morning in Tokyo.")
        window.type("what time is it in Tokyo?\r")
        await window.until(r"Allow current_time\? \[y/N\]\Z")
        assert '"timezone": "Asia/Tokyo"' in window.text and len(fake_model.requests) == 1
        window.type("y\r")
        await window.until(r"It is morning in Tokyo\..*you>\Z")
        assert "Approval " in window.text and "Allowed by terminal:local." in window.text
        assert "JST" in str(fake_model.requests[-1]["messages"][-1]["content"])

        fake_model.tool_call("current_time", {})
        fake_model.reply("No time, then.")
        window.type("and now?\r")
        await window.until(r"Allow current_time\? \[y/N\]\Z")
        window.type("n\r")
        await window.until(r"No time, then\..*you>\Z")
        assert "Denied by terminal:local." in window.text
        assert "not run" in str(fake_model.requests[-1]["messages"][-1]["content"])
        window.type("\x04")  # Ctrl+D
        assert await window.exit_code() == 0
        assert "Traceback" not in window.raw
    finally:
        await window.close()


async def test_an_approval_card_shows_a_hidden_command_as_escapes(fake_model: FakeModel, tmp_path: Path) -> None:
    """Issue 31: `rm MEMORY.md` hidden behind a carriage return and an erase-line showed as
    `ls -la` on this card. Now the window shows the escapes, and so the real command."""
    config = write_config(tmp_path, fake_model, tools={"exec": {"enabled": True}}, approvals={"tools": {"exec": "ask"}})
    window = Window()
    try:
        await window.start(config, tmp_path)
        await window.at_prompt()
        fake_model.tool_call("exec", {"command": "rm MEMORY.md\r\x1b[2Kls -la\necho \u202eok\u200b"})
        fake_model.reply("Not run.")
        window.type("tidy up\r")
        await window.until(r"Allow exec\? \[y/N\]\Z")
        assert "rm MEMORY.md\\r\\x1b[2Kls -la" in window.lines
        assert "echo \\u202eok\\u200b" in window.lines
        window.type("n\r")
        await window.until(r"Not run\..*you>\Z")
        assert "Denied by terminal:local." in window.text
        window.type("\x04")
        assert await window.exit_code() == 0
    finally:
        await window.close()


# -- long answers as a newcomer reads them --------------------------------------------------

ESCAPES = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def _stream_in(columns: int, rows: int, monkeypatch: Any) -> tuple[Tty, Any]:
    monkeypatch.setattr("shutil.get_terminal_size", lambda *a, **k: os.terminal_size((columns, rows)))
    out = Tty()
    terminal = TerminalChannel(out=out)  # type: ignore[arg-type]
    return out, terminal.stream(Inbound(channel="terminal", chat_id="local", user_id="local", text="q",
                                        event_id="e"))


async def _until_shown(out: Tty, columns: int, rows: int, wanted: str) -> list[str]:
    async with asyncio.timeout(10):
        while True:
            shown = _window(out.text, columns, rows)
            if any(wanted in row for row in shown):
                return shown
            await asyncio.sleep(0.02)


async def test_a_long_answer_is_markdown_while_it_streams(monkeypatch: Any) -> None:
    out, stream = _stream_in(40, 10, monkeypatch)
    items = [f"- item **{n}**\n" for n in range(30)]
    for item in items[:20]:
        await stream.append(item)
        await asyncio.sleep(0)
    # Mid-answer, taller than the window already: rendered, no Markdown as written.
    shown = await _until_shown(out, 40, 10, "• item 19")
    assert "**" not in "".join(shown) and not any(row.lstrip().startswith("- item") for row in shown)
    for item in items[20:]:
        await stream.append(item)
    await stream.finish("".join(items))
    shown = _window(out.text, 40, 10)
    assert shown == ["bot>  • item 0", *(f"      • item {n}" for n in range(1, 30))]  # each once, in order


async def test_words_are_never_cut_at_the_windows_edge(monkeypatch: Any) -> None:
    words = [f"{'word' if n % 3 else 'longerword'}{n}" for n in range(160)]
    text = " ".join(words)  # far taller than the window at 30 columns
    out, stream = _stream_in(30, 8, monkeypatch)
    for n in range(0, len(words), 7):
        await stream.append(" ".join(words[n:n + 7]) + " ")
        await asyncio.sleep(0)
        shown = _window(out.text, 30, 8)
        # Whatever moment one looks: every row holds whole words.
        assert all(word in words for row in shown for word in row.removeprefix("bot>").split()), shown
    await stream.finish(text)
    shown = _window(out.text, 30, 8)
    assert " ".join(shown).removeprefix("bot>").split() == words


async def test_a_code_line_stays_one_line_and_links_show_their_address(monkeypatch: Any) -> None:
    long_line = "total = " + " + ".join(f"value_{n}" for n in range(12))  # 158 characters
    reply = (f"See [the docs](https://example.org/docs) or <https://example.org/faq>.\n\n"
             f"```python\n{long_line}\nprint(total)\n```")
    out, stream = _stream_in(40, 30, monkeypatch)
    await stream.append(reply[:30])
    await stream.append(reply[30:])
    await stream.finish(reply)
    shown = _window(out.text, 40, 30)
    prose = " ".join(" ".join(shown[:3]).split())
    assert "See the docs (https://example.org/docs) or https://example.org/faq." in prose
    # The code line was written as one line (the terminal soft-wraps it): never broken
    # by a newline, never re-flowed at its spaces.
    plain = ESCAPES.sub("", out.text)
    assert f"     {long_line}\n" in plain.replace("\r", "")
    first = next(i for i, row in enumerate(shown) if row.startswith("     total = "))
    assert "".join(shown[first:first + 5]).startswith("     " + long_line)
    assert "print(total)" in shown[first + 4]


class TallWindow(Window):
    """A chat on a pty in a small window: what scrolls away is kept (pyte's history), and
    every state of the window is kept too."""

    def __init__(self, columns: int, rows: int) -> None:
        super().__init__(columns, rows)
        self.screen = pyte.HistoryScreen(columns, rows, history=2000)
        self.stream = pyte.Stream(self.screen)
        self.snapshots: list[str] = []

    def _read(self) -> None:
        super()._read()
        self.snapshots.append("\n".join(self.screen.display))

    @property
    def transcript(self) -> list[str]:
        scrolled = ["".join(line[x].data for x in range(self.columns)) for line in self.screen.history.top]
        return [row.rstrip() for row in scrolled + self.screen.display if row.strip()]


async def test_the_chat_renders_a_long_answer_as_it_streams(fake_model: FakeModel, tmp_path: Path) -> None:
    """`gateway chat` in a 60×14 window: a streamed answer far taller than it is Markdown at
    every moment, its words whole, and once in the scrollback."""
    items = [f"- point **{n}**: the gateway keeps each session's turns in order\n" for n in range(24)]
    chunks = ["## Plan\n\n", *items, "\nDone, see [the guide](https://example.org/guide)."]
    fake_model.reply("".join(chunks), chunks=chunks, chunk_delay=0.05)
    window = TallWindow(60, 14)
    try:
        await window.start(write_config(tmp_path, fake_model), tmp_path)
        await window.at_prompt()
        window.type("make a plan\r")
        await window.until(r"the guide \(https://example\.org/guide\)\..*you>\Z")
        assert not any("**" in shot or "- point" in shot for shot in window.snapshots)
        rows = window.transcript
        answer = rows[rows.index("you> make a plan") + 1:-1]
        assert answer[0] == "bot> Plan"
        assert [row.split(":")[0].strip() for row in answer if "•" in row] == [f"• point {n}" for n in range(24)]
        expected = "".join(chunks).replace("**", "").replace("## ", "").replace("- ", "").replace(
            "[the guide](https://example.org/guide)", "the guide (https://example.org/guide)")
        assert [word for row in answer for word in row.removeprefix("bot>").split() if word != "•"] == \
            expected.split()  # all of it, once, no word cut at the edge
        window.type("\x04")
        assert await window.exit_code() == 0
    finally:
        await window.close()
