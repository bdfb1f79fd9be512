"""A fake Telegram Bot API server for tests: real python-telegram-bot talks to it over
HTTP on 127.0.0.1 (`Bot(base_url=fake.base_url)`), no network, no mocks.

Routes: `POST /bot<TOKEN>/<method>` (JSON, urlencoded or multipart bodies, like the real
API) and `GET /file/bot<TOKEN>/<file_path>`. Every call is recorded; tests wait on
events with timeouts and script failures:

    fake.push_message(chat_id=1, user_id=1, text="hi")
    sent = await fake.wait_sent(1)
    fake.fail_next("sendMessage", 429, retry_after=1)
    fake.reject_formatting()             # next formatted send/edit → "can't parse entities"
    fake.shown(42)                       # what the person sees in chat 42, edits applied
    fake.draft(42)                       # the draft chat 42 shows now (sendMessageDraft), or None

Text is read as Telegram reads it (tests/fakes/telegram_text.py): `parse_mode` HTML and
MarkdownV2 are parsed and malformed markup is refused with "can't parse entities", and the
4096-unit limit applies to the text after parsing.

Flood control, per chat, as Telegram applies it: a message edited sooner than
`edit_interval_s` after the chat's previous edit, or a sendMessage beyond a burst of
`send_burst` refilled at `send_per_s`, gets 429 with `parameters.retry_after` (whole
seconds, as Telegram says it, unless the limit is a sub-second one set for a fast test);
a call made before a 429's retry_after has passed (scripted with `fail_next` or not) is
refused again. Every 429 the fake decides itself is listed in `rate_limited`.
An edit that changes nothing is refused as "message is not modified", an edit or delete
of a message that is gone as "message to edit/delete not found".

Drafts (`sendMessageDraft`, Bot API 9.3+): an animated preview of a reply being written,
in private chats only: in any other chat it is refused with 400 "TEXTDRAFT_PEER_INVALID",
as Telegram does. `draft_id` must be a non-zero integer; the text is read like a
message's (entities, parse modes, 4096 units after parsing; empty shows Telegram's
"Thinking…" placeholder). Drafts are under flood control too: one per `draft_interval_s`
per chat, and a 429's retry_after holds for every paced method of the chat. A draft is
not a message: drafts are recorded in `drafts` (never in `sent`, `history` or
`shown`), the chat's current one is `draft(chat)`, and it is gone once the bot sends a
message to that chat (or `DRAFT_TTL_S` after its last update).

One poller per bot, as the Bot API server does it (tdlib/telegram-bot-api, Client.cpp
`do_get_updates` / `abort_long_poll` / `fail_query_conflict`): a getUpdates that is about
to wait (a timeout and nothing pending) terminates the long poll already waiting, the
*older* request, with HTTP 409 "Conflict: terminated by other getUpdates request; make
sure that only one bot instance is running"; a getUpdates that answers at once (updates
pending, or timeout 0) terminates nothing. At most one 409 goes out per
`conflict_interval_s` (3 s there); a later one is held back that long first. Every 409
is listed in `conflicts`. A long poll whose client hung up is gone (it terminates
nothing and is not counted).

Inline keyboards and button presses, as the Bot API has them: `reply_markup` of
sendMessage, sendDocument, editMessageText and editMessageReplyMarkup must be an
InlineKeyboardMarkup (an array of rows of buttons, each with a non-empty `text` and one
action; `callback_data` of 1-64 bytes; at most 100 buttons), else 400. Editing a message's
text without `reply_markup` removes its keyboard (Telegram's behaviour), as does
editMessageReplyMarkup without one. `push_callback(...)` is a person pressing a button:
only a button the message shows now can be pressed (`stale=True` is a client that has
not seen the latest edit yet), and only a poller that asked for `callback_query` in
`allowed_updates` is handed it. Every query must be answered with answerCallbackQuery,
once, within `callback_answer_s` (else "query is too old"); the text shown is at most 200
characters. Answers are kept in `callback_answers`, by query id.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from tests.fakes.telegram_text import EntityError, Parsed, parse_message

DEFAULT_TOKEN = "123456:TEST-fake-token"
TEXT_LIMIT = 4096
GET_FILE_LIMIT = 20 * 1024 * 1024  # bots may download files up to 20 MB from the cloud Bot API

DRAFT_TTL_S = 30.0  # a draft is a 30-second preview unless updated or replaced by a message

# Methods under per-chat flood control: a 429's retry_after holds for all of them.
_PACED = frozenset({"sendmessage", "editmessagetext", "editmessagereplymarkup", "deletemessage",
                    "sendmessagedraft"})
CALLBACK_DATA_LIMIT = 64  # bytes
CALLBACK_TEXT_LIMIT = 200  # characters of an answerCallbackQuery notice
MAX_BUTTONS = 100
_BUTTON_ACTIONS = ("callback_data", "url", "web_app", "login_url", "switch_inline_query",
                   "switch_inline_query_current_chat", "switch_inline_query_chosen_chat", "copy_text",
                   "callback_game", "pay")

# Form fields that stay strings even when they look like JSON numbers.
_STRING_FIELDS = frozenset(
    {"text", "caption", "secret_token", "url", "description", "file_id", "action", "parse_mode"}
)


@dataclass(frozen=True, slots=True)
class _Failure:
    status: int
    description: str
    retry_after: float | None


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


class FakeTelegram:
    """The fake server. Start with `await start()` (or the `fake_telegram` fixture)."""

    def __init__(
        self,
        token: str = DEFAULT_TOKEN,
        *,
        bot_id: int = 7_000_001,
        bot_username: str = "gateway_test_bot",
        edit_interval_s: float | None = 1.0,
        draft_interval_s: float | None = 1.0,
        send_burst: int = 20,
        send_per_s: float | None = 1.0,
        conflict_interval_s: float = 3.0,
        callback_answer_s: float = 15.0,
    ) -> None:
        self.token = token
        self.callback_answer_s = callback_answer_s
        self._markups: dict[int, list[list[dict[str, Any]]]] = {}  # message id → its inline keyboard
        self._threads: dict[int, int] = {}  # message id → the topic it was sent to
        self._queries: dict[str, float] = {}  # unanswered callback query id → monotonic time pushed
        self.callback_answers: dict[str, dict[str, Any]] = {}  # query id → answerCallbackQuery params
        self.allowed_updates: list[str] | None = None  # as the last getUpdates asked
        self.conflict_interval_s = conflict_interval_s
        self.conflicts: list[float] = []  # monotonic time of every 409 a terminated getUpdates got
        self._long_poll: asyncio.Future[None] | None = None  # done: terminated by a newer one
        self._next_conflict_at = 0.0
        self.edit_interval_s = edit_interval_s  # None: edits are not rate limited
        self.draft_interval_s = draft_interval_s  # None: drafts are not rate limited
        self.send_burst = send_burst
        self.send_per_s = send_per_s  # None: sendMessage is not rate limited
        self.bot_id = bot_id
        self.bot_username = bot_username
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.call_times: list[float] = []  # monotonic arrival time of each of `calls`
        self.sent: list[dict[str, Any]] = []  # sendMessage params that succeeded, in order
        self.uploads: list[tuple[str, str, bytes]] = []  # (method, file name, bytes) of sendPhoto/sendDocument
        self.confirmed_offset = 0  # highest offset a getUpdates call confirmed
        self.commands: list[dict[str, Any]] = []  # what setMyCommands stored
        self.webhook: dict[str, Any] | None = None  # setWebhook params, None when deleted
        self.chat_actions: list[dict[str, Any]] = []
        self.edits: list[dict[str, Any]] = []  # editMessageText params that succeeded
        self.deleted: list[int] = []  # ids of the bot's messages deleted (by the bot or a person)
        self.drafts: list[dict[str, Any]] = []  # sendMessageDraft params that succeeded, in order
        # The draft each chat shows now: chat → (draft_id, text as read, monotonic time of its update).
        self._drafts: dict[str, tuple[int, Parsed, float]] = {}
        self._last_draft: dict[str, float] = {}  # chat → monotonic time of its last draft
        self._chat_types: dict[str, str] = {}  # chat → "private" / "group" / … as pushed
        self.rate_limited: list[str] = []  # the method of each call answered with 429
        # What happened to the bot's messages, in order: (method, chat id, message id,
        # visible text): every successful sendMessage, editMessageText and deleteMessage.
        self.history: list[tuple[str, Any, int, str]] = []
        # Every message the bot posted, by message id, as currently shown (edits applied).
        self._shown: dict[int, tuple[Any, Parsed]] = {}
        self._last_edit: dict[str, float] = {}  # chat → monotonic time of its last edit
        self._send_tokens: dict[str, tuple[float, float]] = {}  # chat → (tokens, at)
        self._blocked_until: dict[str, float] = {}  # chat → end of a scripted 429's retry_after
        self.port = 0
        self._updates: list[dict[str, Any]] = []  # pending (not yet confirmed), by update_id
        self._next_update_id = 1
        self._next_message_id = 1
        self._files: dict[str, tuple[bytes, str]] = {}  # file_id → (content, file_path)
        self._reported_sizes: dict[str, int] = {}  # file_id → a file_size getFile states instead
        self.downloads: list[str] = []  # file paths served
        self._failures: dict[str, deque[_Failure]] = defaultdict(deque)
        self._reject_formatting = 0
        self._cursors: dict[str, int] = defaultdict(int)  # wait_call position per method
        self._changed = asyncio.Event()
        self._closing = False
        self._runner: web.AppRunner | None = None

    # ---------------------------------------------------------------- lifecycle

    @property
    def base_url(self) -> str:
        """PTB's `base_url` (the token is appended by PTB)."""
        return f"http://127.0.0.1:{self.port}/bot"

    @property
    def base_file_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/file/bot"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/bot{token}/{method}", self._on_method)
        app.router.add_get("/bot{token}/{method}", self._on_method)
        app.router.add_get("/file/bot{token}/{path:.+}", self._on_file)
        self._runner = web.AppRunner(app, shutdown_timeout=1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        self._closing = True
        self._notify()  # long polls return at once
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---------------------------------------------------------------- test API

    def push_message(
        self,
        *,
        chat_id: int,
        user_id: int,
        text: str = "",
        chat_type: str = "private",
        thread_id: int | None = None,
        reply_to_bot: bool = False,
        entities: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> int:
        """Queue a `message` update from a person; returns its update_id. `extra` is merged
        into the message (e.g. `photo=[...]`, `caption=...`, `sticker={...}`)."""
        message_id = self._new_message_id()
        self._chat_types[str(chat_id)] = chat_type
        chat: dict[str, Any] = {"id": chat_id, "type": chat_type}
        if chat_type == "private":
            chat["first_name"] = f"User{user_id}"
        else:
            chat["title"] = f"Group {chat_id}"
        person = {"id": user_id, "is_bot": False, "first_name": f"User{user_id}",
                  "username": f"user{user_id}"}
        message: dict[str, Any] = {
            "message_id": message_id,
            "date": int(time.time()),
            "chat": chat,
            "from": person,
        }
        if text:
            message["text"] = text
        if entities:
            message["entities"] = entities
        if thread_id is not None:
            chat["is_forum"] = True
            message["message_thread_id"] = thread_id
            message["is_topic_message"] = True
            # In a topic every message "replies" to the topic's creation message.
            message["reply_to_message"] = {
                "message_id": thread_id,
                "date": int(time.time()) - 60,
                "chat": chat,
                "from": person,
                "message_thread_id": thread_id,
                "is_topic_message": True,
                "forum_topic_created": {"name": "Topic", "icon_color": 7322096},
            }
        if reply_to_bot:
            message["reply_to_message"] = {
                "message_id": self._new_message_id(),
                "date": int(time.time()) - 30,
                "chat": chat,
                "from": self.bot_user(),
                "text": "an earlier reply",
            }
        message.update(extra)
        return self.push_update({"message": message})

    def push_update(self, update: dict[str, Any]) -> int:
        """Queue any update (junk included); an update_id is assigned unless it has an int."""
        update = dict(update)
        uid = update.get("update_id")
        if not isinstance(uid, int) or isinstance(uid, bool) or uid < self._next_update_id:
            uid = self._next_update_id
            update["update_id"] = uid
        self._next_update_id = uid + 1
        self._updates.append(update)
        self._notify()
        return uid

    def push_callback(self, *, chat_id: int, user_id: int, message_id: int, data: str,
                      stale: bool = False) -> str:
        """A person presses the button with `data` under the bot's message `message_id`;
        returns the callback query id. Only a button the message shows now can be pressed,
        unless `stale` (a client that has not seen the latest edit yet)."""
        query_id, update = self.callback_update(chat_id=chat_id, user_id=user_id, message_id=message_id,
                                                data=data, stale=stale)
        self.push_update(update)
        return query_id

    def callback_update(self, *, chat_id: int, user_id: int, message_id: int, data: str,
                        stale: bool = False) -> tuple[str, dict[str, Any]]:
        """The query id and the `callback_query` update of such a press, not queued (for a
        webhook, which the test posts itself)."""
        shown = self._shown.get(message_id)
        if shown is None or str(shown[0]) != str(chat_id):
            raise AssertionError(f"message {message_id} is not shown in chat {chat_id}")
        rows = self._markups.get(message_id, [])
        if not stale and not any(b.get("callback_data") == data for row in rows for b in row):
            raise AssertionError(f"message {message_id} shows no button with data {data!r}")
        query_id = str(next_query_id())
        person = {"id": user_id, "is_bot": False, "first_name": f"User{user_id}", "username": f"user{user_id}"}
        message: dict[str, Any] = {"message_id": message_id, "date": int(time.time()),
                                   "chat": self._chat_of(chat_id), "from": self.bot_user(), "text": shown[1].text}
        if shown[1].entities:
            message["entities"] = shown[1].entities
        if rows:
            message["reply_markup"] = {"inline_keyboard": rows}
        thread = self._threads.get(message_id)
        if thread is not None:
            message["message_thread_id"] = thread
            message["is_topic_message"] = True
        self._queries[query_id] = time.monotonic()
        return query_id, {"update_id": self._next_update_id, "callback_query": {
            "id": query_id, "from": person, "message": message, "chat_instance": str(chat_id), "data": data}}

    def buttons(self, message_id: int) -> list[str]:
        """The texts of the buttons message `message_id` shows now, row by row."""
        return [str(b.get("text")) for row in self._markups.get(message_id, []) for b in row]

    def unanswered(self) -> list[str]:
        """Callback queries pushed and never answered."""
        return list(self._queries)

    async def wait_answer(self, query_id: str, timeout: float = 10) -> dict[str, Any]:
        """The answerCallbackQuery params that answered `query_id`."""
        await self._wait_for(lambda: query_id in self.callback_answers, timeout, f"an answer to query {query_id}")
        return self.callback_answers[query_id]

    def add_file(self, file_id: str, content: bytes, file_path: str, *, reported_size: int | None = None) -> None:
        """A file bots can fetch (getFile, then GET /file/bot<token>/<file_path>). With
        `reported_size`, getFile states that size instead of the real one."""
        self._files[file_id] = (content, file_path)
        if reported_size is not None:
            self._reported_sizes[file_id] = reported_size

    def fail_next(
        self, method: str, status: int, description: str = "", retry_after: float | None = None
    ) -> None:
        """The next call of `method` answers with this error (queued: call again for more)."""
        if not description:
            description = "Too Many Requests: retry later" if status == 429 else f"Error {status}"
        self._failures[method.lower()].append(_Failure(status, description, retry_after))

    def reject_formatting(self, times: int = 1) -> None:
        """The next `times` sendMessage, editMessageText or sendMessageDraft calls that
        carry entities or parse_mode get 400 "Bad Request: can't parse entities"."""
        self._reject_formatting += times

    def delete_by_person(self, message_id: int) -> None:
        """Someone deleted one of the bot's messages: it can no longer be edited."""
        shown = self._shown.pop(message_id, None)
        if shown is not None:
            self.deleted.append(message_id)
            self.history.append(("deleted", shown[0], message_id, ""))
            self._notify()

    def message_ids(self, chat_id: Any = None) -> list[int]:
        """The ids of the bot's messages (in `chat_id`) still visible, in order."""
        return [mid for mid, (chat, _) in self._shown.items()
                if chat_id is None or str(chat) == str(chat_id)]

    def versions(self, message_id: int) -> list[str]:
        """Every text message `message_id` showed, in order (sent, then each edit)."""
        return [text for method, _, mid, text in self.history
                if mid == message_id and method in ("sendMessage", "editMessageText")]

    def bot_user(self) -> dict[str, Any]:
        return {"id": self.bot_id, "is_bot": True, "first_name": "Gateway",
                "username": self.bot_username}

    def shown(self, chat_id: Any = None) -> list[str]:
        """The visible text of each message the bot posted (to `chat_id`), in order, as it
        reads now: markup parsed, escapes removed, edits applied."""
        return [parsed.text for chat, parsed in self._shown.values()
                if chat_id is None or str(chat) == str(chat_id)]

    def shown_parsed(self, chat_id: Any = None) -> list[Parsed]:
        """Like `shown`, with each message's entities as Telegram stored them."""
        return [parsed for chat, parsed in self._shown.values()
                if chat_id is None or str(chat) == str(chat_id)]

    async def wait_shown(self, chat_id: Any, ready: Callable[[list[str]], bool], timeout: float = 5) -> list[str]:
        """Wait until `ready(shown(chat_id))`; returns what is shown then."""
        await self._wait_for(lambda: ready(self.shown(chat_id)), timeout, f"text shown in {chat_id}")
        return self.shown(chat_id)

    def draft(self, chat_id: Any) -> str | None:
        """The text of the draft `chat_id` shows now, or None (none yet, replaced by a
        message, or expired)."""
        current = self._drafts.get(str(chat_id))
        if current is None or time.monotonic() - current[2] > DRAFT_TTL_S:
            return None
        return current[1].text

    async def wait_draft(self, chat_id: Any, ready: Callable[[str], bool], timeout: float = 5) -> str:
        """Wait until the chat shows a draft for which `ready(text)` holds; returns its text."""
        def shows() -> bool:
            text = self.draft(chat_id)
            return text is not None and ready(text)

        await self._wait_for(shows, timeout, f"a draft in {chat_id}")
        return self.draft(chat_id) or ""

    def methods(self, *names: str) -> list[str]:
        """The methods of the calls made so far that are among `names`, in order (refused
        calls included): e.g. drafts, then one sendMessage."""
        wanted = {n.lower() for n in names}
        return [name for name, _ in self.calls if name.lower() in wanted]

    def times_of(self, method: str) -> list[float]:
        """When each call of `method` arrived (time.monotonic(), the event loop's clock)."""
        return [at for (name, _), at in zip(self.calls, self.call_times, strict=True)
                if name.lower() == method.lower()]

    async def wait_calls(self, method: str, n: int, timeout: float = 5) -> list[dict[str, Any]]:
        """Wait until `method` was called at least `n` times (refused calls included)."""
        await self._wait_for(lambda: len(self.calls_of(method)) >= n, timeout, f"{n} calls of {method}")
        return self.calls_of(method)

    def calls_of(self, method: str) -> list[dict[str, Any]]:
        return [params for name, params in self.calls if name.lower() == method.lower()]

    @property
    def pending_updates(self) -> list[int]:
        return [u["update_id"] for u in self._updates]

    async def wait_sent(self, n: int, timeout: float = 5) -> list[dict[str, Any]]:
        """Wait until at least `n` messages were sent; returns all sent so far."""
        await self._wait_for(lambda: len(self.sent) >= n, timeout, f"{n} sent messages")
        return list(self.sent)

    async def wait_call(self, method: str, timeout: float = 5) -> dict[str, Any]:
        """The params of the next call of `method` not returned by an earlier wait_call
        (the first call on the first wait, the second on the second …)."""
        key = method.lower()
        index = self._cursors[key]
        await self._wait_for(lambda: len(self.calls_of(method)) > index, timeout, f"call {method}")
        self._cursors[key] = index + 1
        return self.calls_of(method)[index]

    async def wait_confirmed(self, offset: int, timeout: float = 5) -> None:
        """Wait until getUpdates confirmed every update below `offset`."""
        await self._wait_for(lambda: self.confirmed_offset >= offset, timeout, f"offset {offset}")

    # ---------------------------------------------------------------- internals

    def _new_message_id(self) -> int:
        mid = self._next_message_id
        self._next_message_id += 1
        return mid

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def _wait_for(self, ready: Callable[[], bool], within: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while not ready():
            remaining = deadline - loop.time()
            if remaining <= 0 or self._closing:
                raise TimeoutError(f"fake telegram: timed out waiting for {what}")
            event = self._changed
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                continue

    async def _params(self, request: web.Request) -> dict[str, Any]:
        params: dict[str, Any] = dict(request.query)
        if request.content_type == "application/json":
            body = await request.read()
            if body:
                data = json.loads(body)
                if not isinstance(data, dict):
                    raise ValueError("the body must be a JSON object")
                params.update(data)
        elif request.method == "POST":
            form = await request.post()
            for key, value in form.items():
                if isinstance(value, web.FileField):  # an uploaded file: its name and bytes
                    params[key] = {"filename": value.filename, "data": value.file.read()}
                else:
                    params[key] = _form_value(key, value) if isinstance(value, str) else str(value)
        return params

    async def _on_method(self, request: web.Request) -> web.Response:
        if request.match_info["token"] != self.token:
            return _error(401, "Unauthorized")
        method = request.match_info["method"]
        try:
            params = await self._params(request)
        except ValueError as exc:
            return _error(400, f"Bad Request: {exc}")
        self.calls.append((method, params))
        self.call_times.append(time.monotonic())
        self._notify()
        chat = str(params.get("chat_id"))
        if method.lower() in _PACED and self._blocked_until.get(chat, 0.0) > time.monotonic():
            # Called again before the retry_after Telegram gave: refused again.
            remaining = self._blocked_until[chat] - time.monotonic()
            return self._flooded(method, remaining, 1.0 if remaining >= 1 else 0.0)
        failures = self._failures.get(method.lower())
        if failures:
            failure = failures.popleft()
            if failure.status == 429 and failure.retry_after and method.lower() in _PACED:
                self._blocked_until[chat] = time.monotonic() + failure.retry_after
            return _error(failure.status, failure.description, failure.retry_after)
        if method.lower() == "getupdates":
            return await self._get_updates(params, request)
        handler = getattr(self, f"_api_{method.lower()}", None)
        if handler is None:
            return _error(404, "Not Found: method not found")
        try:
            return await handler(params)
        except (KeyError, TypeError, ValueError) as exc:
            return _error(400, f"Bad Request: {exc}")

    async def _on_file(self, request: web.Request) -> web.StreamResponse:
        if request.match_info["token"] != self.token:
            return _error(401, "Unauthorized")
        path = request.match_info["path"]
        for content, file_path in self._files.values():
            if file_path == path:
                self.downloads.append(path)
                self._notify()
                return web.Response(body=content, content_type="application/octet-stream")
        return _error(404, "Not Found")

    # Bot API methods (lower-case names: Telegram's method names are case-insensitive)

    async def _api_getme(self, params: dict[str, Any]) -> web.Response:
        me = self.bot_user() | {"can_join_groups": True, "can_read_all_group_messages": False,
                                "supports_inline_queries": False}
        return _ok(me)

    async def _get_updates(self, params: dict[str, Any], request: web.Request) -> web.Response:
        offset = params.get("offset")
        if isinstance(offset, int) and offset > 0:
            self._updates = [u for u in self._updates if u["update_id"] >= offset]
            if offset > self.confirmed_offset:
                self.confirmed_offset = offset
                self._notify()
        timeout = params.get("timeout") or 0
        limit = params.get("limit") or 100
        allowed = params.get("allowed_updates")
        if isinstance(allowed, list):
            self.allowed_updates = [str(kind) for kind in allowed]
        if not self._deliverable() and timeout > 0:
            terminated = await self._long_poll_wait(float(timeout), request)
            if terminated:
                return await self._conflict()
        return _ok(self._deliverable()[: int(limit)])

    def _deliverable(self) -> list[dict[str, Any]]:
        """Pending updates the poller asked for: button presses only when `allowed_updates`
        names them (other kinds always, so junk can be pushed)."""
        wanted = self.allowed_updates
        if wanted is not None and "callback_query" not in wanted:
            return [u for u in self._updates if "callback_query" not in u]
        return self._updates

    async def _long_poll_wait(self, timeout: float, request: web.Request) -> bool:
        """Wait for updates as the one long poll of this bot; True when a newer getUpdates
        terminated this one."""
        older = self._long_poll
        if older is not None and not older.done():
            older.set_result(None)  # the older request gets the 409
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._long_poll = mine
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while not self._deliverable() and not self._closing and not mine.done():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                transport = request.transport
                if transport is None or transport.is_closing():
                    return False  # the client hung up: its long poll is gone
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    # Short slices: a hang-up is only seen by looking. Whichever comes first
                    # (an update, a newer poll): waiting for both held every answer to the
                    # end of its slice, up to 50 ms late (Telegram answers at once).
                    await asyncio.wait({changed, mine}, timeout=min(remaining, 0.05),
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
            return mine.done()
        finally:
            if self._long_poll is mine:
                self._long_poll = None

    async def _conflict(self) -> web.Response:
        now = time.monotonic()
        if now < self._next_conflict_at:
            await asyncio.sleep(self.conflict_interval_s)  # the Bot API holds back a 409 this soon
        else:
            self._next_conflict_at = now + self.conflict_interval_s
        self.conflicts.append(time.monotonic())
        self._notify()
        return _error(409, "Conflict: terminated by other getUpdates request; "
                           "make sure that only one bot instance is running")

    def _message_text(self, text: Any, params: dict[str, Any]) -> Parsed | web.Response:
        """What a sent or edited message shows, or Telegram's refusal of its text (or of
        its link preview options, which must be a LinkPreviewOptions object)."""
        previews = params.get("link_preview_options")
        if previews is not None and (not isinstance(previews, dict) or not all(
                isinstance(previews.get(flag, False), bool) for flag in ("is_disabled", "prefer_small_media",
                                                                          "prefer_large_media", "show_above_text"))):
            return _error(400, "Bad Request: can't parse link preview options JSON object")
        refused = self._refused_formatting(text, params)
        if refused is not None:
            return refused
        return _read_text(text, params)

    async def _api_sendmessage(self, params: dict[str, Any]) -> web.Response:
        chat_id = params["chat_id"]
        text = params.get("text")
        entities = params.get("entities") or []
        parsed = self._message_text(text, params)
        if isinstance(parsed, web.Response):
            return parsed
        markup = _inline_keyboard(params)
        if isinstance(markup, web.Response):
            return markup
        flooded = self._send_flood(str(chat_id))
        if flooded is not None:
            return flooded
        message_id = self._new_message_id()
        self._shown[message_id] = (chat_id, parsed)
        if markup:
            self._markups[message_id] = markup
        if params.get("message_thread_id") is not None:
            self._threads[message_id] = params["message_thread_id"]
        self._drafts.pop(str(chat_id), None)  # the message takes the draft's place
        self.sent.append(params)
        self.history.append(("sendMessage", chat_id, message_id, parsed.text))
        self._notify()
        message: dict[str, Any] = {
            "message_id": message_id,
            "date": int(time.time()),
            "chat": _chat(chat_id),
            "from": self.bot_user(),
            "text": text,
        }
        if entities:
            message["entities"] = entities
        if markup:
            message["reply_markup"] = {"inline_keyboard": markup}
        if params.get("message_thread_id") is not None:
            message["message_thread_id"] = params["message_thread_id"]
        return _ok(message)

    async def _api_sendphoto(self, params: dict[str, Any]) -> web.Response:
        return self._upload("sendPhoto", "photo", params, PHOTO_MAX_BYTES)

    async def _api_senddocument(self, params: dict[str, Any]) -> web.Response:
        return self._upload("sendDocument", "document", params, DOCUMENT_MAX_BYTES)

    def _upload(self, method: str, field: str, params: dict[str, Any], limit: int) -> web.Response:
        """Telegram's limits for files a bot uploads: photos 10 MB, other files 50 MB."""
        file = params.get(field)
        if not isinstance(file, dict):
            return _error(400, f"Bad Request: there is no {field} in the request")
        if len(file["data"]) > limit:
            return _error(413, "Request Entity Too Large")
        markup = _inline_keyboard(params)
        if isinstance(markup, web.Response):
            return markup
        chat_id = params["chat_id"]
        message_id = self._new_message_id()
        self.uploads.append((method, file["filename"], file["data"]))
        self.history.append((method, chat_id, message_id, file["filename"]))
        self._notify()
        return _ok({"message_id": message_id, "date": int(time.time()),
                    "chat": _chat(chat_id),
                    "from": self.bot_user(), field: {"file_id": f"up{message_id}", "file_unique_id": f"u{message_id}"}
                    if field == "document" else [{"file_id": f"up{message_id}", "file_unique_id": f"u{message_id}",
                                                  "width": 1, "height": 1}]})

    async def _api_editmessagetext(self, params: dict[str, Any]) -> web.Response:
        text = params.get("text")
        chat_id = params["chat_id"]
        message_id = params["message_id"]
        shown = self._shown.get(message_id)
        if shown is None or str(shown[0]) != str(chat_id):
            return _error(400, "Bad Request: message to edit not found")
        parsed = self._message_text(text, params)
        if isinstance(parsed, web.Response):
            return parsed
        markup = _inline_keyboard(params)  # none given: the keyboard goes, as on Telegram
        if isinstance(markup, web.Response):
            return markup
        flooded = self._edit_flood(str(chat_id))
        if flooded is not None:
            return flooded
        if (parsed.text, parsed.entities, markup) == (shown[1].text, shown[1].entities,
                                                      self._markups.get(message_id, [])):
            return _not_modified()
        self._last_edit[str(chat_id)] = time.monotonic()
        self._shown[message_id] = (chat_id, parsed)
        self._set_markup(message_id, markup)
        self.edits.append(params)
        self.history.append(("editMessageText", chat_id, message_id, parsed.text))
        self._notify()
        return _ok({
            "message_id": params["message_id"],
            "date": int(time.time()),
            "edit_date": int(time.time()),
            "chat": _chat(chat_id),
            "from": self.bot_user(),
            "text": text,
        })

    async def _api_editmessagereplymarkup(self, params: dict[str, Any]) -> web.Response:
        chat_id, message_id = params["chat_id"], params["message_id"]
        shown = self._shown.get(message_id)
        if shown is None or str(shown[0]) != str(chat_id):
            return _error(400, "Bad Request: message to edit not found")
        markup = _inline_keyboard(params)
        if isinstance(markup, web.Response):
            return markup
        flooded = self._edit_flood(str(chat_id))
        if flooded is not None:
            return flooded
        if markup == self._markups.get(message_id, []):
            return _not_modified()
        self._last_edit[str(chat_id)] = time.monotonic()
        self._set_markup(message_id, markup)
        self.edits.append(params)
        self.history.append(("editMessageReplyMarkup", chat_id, message_id, shown[1].text))
        self._notify()
        return _ok({"message_id": message_id, "date": int(time.time()), "edit_date": int(time.time()),
                    "chat": _chat(chat_id), "from": self.bot_user(), "text": shown[1].text})

    async def _api_answercallbackquery(self, params: dict[str, Any]) -> web.Response:
        query_id = str(params.get("callback_query_id", ""))
        pushed = self._queries.get(query_id)
        if pushed is None or time.monotonic() - pushed > self.callback_answer_s:
            return _error(400, "Bad Request: query is too old and response timeout expired or query ID is invalid")
        text = params.get("text")
        if text is not None and (not isinstance(text, str) or len(text) > CALLBACK_TEXT_LIMIT):
            return _error(400, "Bad Request: MESSAGE_TOO_LONG")
        del self._queries[query_id]
        self.callback_answers[query_id] = params
        self._notify()
        return _ok(True)

    def _set_markup(self, message_id: int, markup: list[list[dict[str, Any]]]) -> None:
        if markup:
            self._markups[message_id] = markup
        else:
            self._markups.pop(message_id, None)

    def _chat_of(self, chat_id: Any) -> dict[str, Any]:
        kind = self._chat_types.get(str(chat_id)) or ("private" if int(chat_id) > 0 else "supergroup")
        return {"id": chat_id, "type": kind}

    async def _api_sendmessagedraft(self, params: dict[str, Any]) -> web.Response:
        chat = str(params["chat_id"])
        draft_id = params.get("draft_id")
        if not self._is_private(chat):
            return _error(400, "Bad Request: TEXTDRAFT_PEER_INVALID")
        if not isinstance(draft_id, int) or isinstance(draft_id, bool) or draft_id == 0:
            return _error(400, "Bad Request: DRAFT_ID_INVALID")
        text = params.get("text")
        refused = self._refused_formatting(text, params)
        if refused is not None:
            return refused
        if text is None or text == "":
            parsed = Parsed("", [])  # Telegram's "Thinking…" placeholder
        else:
            read = _read_text(text, params)
            if isinstance(read, web.Response):
                return read
            parsed = read
        flooded = self._draft_flood(chat)
        if flooded is not None:
            return flooded
        now = time.monotonic()
        self._last_draft[chat] = now
        self._drafts[chat] = (draft_id, parsed, now)
        self.drafts.append(params)
        self._notify()
        return _ok(True)

    def _is_private(self, chat: str) -> bool:
        """Private chats as pushed; otherwise by Telegram's ids (people's are positive)."""
        kind = self._chat_types.get(chat)
        if kind is not None:
            return kind == "private"
        try:
            return int(chat) > 0
        except ValueError:
            return False  # "@channelname"

    async def _api_deletemessage(self, params: dict[str, Any]) -> web.Response:
        chat_id, message_id = params["chat_id"], params["message_id"]
        shown = self._shown.get(message_id)
        if shown is None or str(shown[0]) != str(chat_id):
            return _error(400, "Bad Request: message to delete not found")
        del self._shown[message_id]
        self.deleted.append(message_id)
        self.history.append(("deleteMessage", chat_id, message_id, ""))
        self._notify()
        return _ok(True)

    def _refused_formatting(self, text: Any, params: dict[str, Any]) -> web.Response | None:
        formatted = bool(params.get("entities")) or bool(params.get("parse_mode"))
        if isinstance(text, str) and formatted and self._reject_formatting > 0:
            self._reject_formatting -= 1
            return _error(400, "Bad Request: can't parse entities: unsupported start tag at byte offset 0")
        return None

    def _edit_flood(self, chat: str) -> web.Response | None:
        """429 when this chat's previous edit was less than `edit_interval_s` ago."""
        if self.edit_interval_s is None or chat not in self._last_edit:
            return None
        wait = self._last_edit[chat] + self.edit_interval_s - time.monotonic()
        return self._flooded("editMessageText", wait, self.edit_interval_s) if wait > 0 else None

    def _draft_flood(self, chat: str) -> web.Response | None:
        """429 when this chat's previous draft was less than `draft_interval_s` ago."""
        if self.draft_interval_s is None or chat not in self._last_draft:
            return None
        wait = self._last_draft[chat] + self.draft_interval_s - time.monotonic()
        return self._flooded("sendMessageDraft", wait, self.draft_interval_s) if wait > 0 else None

    def _send_flood(self, chat: str) -> web.Response | None:
        """A token bucket per chat: `send_burst` messages at once, then `send_per_s`."""
        if self.send_per_s is None:
            return None
        now = time.monotonic()
        tokens, at = self._send_tokens.get(chat, (float(self.send_burst), now))
        tokens = min(float(self.send_burst), tokens + (now - at) * self.send_per_s)
        if tokens < 1:
            self._send_tokens[chat] = (tokens, now)
            return self._flooded("sendMessage", (1 - tokens) / self.send_per_s, 1 / self.send_per_s)
        self._send_tokens[chat] = (tokens - 1, now)
        return None

    def _flooded(self, method: str, wait: float, rule_s: float) -> web.Response:
        self.rate_limited.append(method)
        self._notify()
        # Telegram says whole seconds; a sub-second rule (a fast test) says the exact wait.
        retry: float = max(1, math.ceil(wait)) if rule_s >= 1 else max(round(wait, 3), 0.001)
        return _error(429, f"Too Many Requests: retry after {retry}", retry_after=retry)

    async def _api_sendchataction(self, params: dict[str, Any]) -> web.Response:
        self.chat_actions.append(params)
        return _ok(True)

    async def _api_setmycommands(self, params: dict[str, Any]) -> web.Response:
        commands = params.get("commands")
        if not isinstance(commands, list):
            return _error(400, "Bad Request: commands must be a list")
        self.commands = [{"command": c["command"], "description": c["description"]} for c in commands]
        return _ok(True)

    async def _api_getmycommands(self, params: dict[str, Any]) -> web.Response:
        return _ok(self.commands)

    async def _api_deletemycommands(self, params: dict[str, Any]) -> web.Response:
        self.commands = []
        return _ok(True)

    async def _api_deletewebhook(self, params: dict[str, Any]) -> web.Response:
        self.webhook = None
        return _ok(True)

    async def _api_setwebhook(self, params: dict[str, Any]) -> web.Response:
        if not params.get("url"):
            return _error(400, "Bad Request: bad webhook: an HTTPS URL must be provided")
        self.webhook = params
        return _ok(True)

    async def _api_getwebhookinfo(self, params: dict[str, Any]) -> web.Response:
        url = self.webhook.get("url", "") if self.webhook else ""
        return _ok({"url": url, "has_custom_certificate": False,
                    "pending_update_count": len(self._updates)})

    async def _api_getfile(self, params: dict[str, Any]) -> web.Response:
        file_id = params.get("file_id")
        if file_id not in self._files:
            return _error(400, "Bad Request: invalid file_id")
        content, path = self._files[file_id]
        if len(content) > GET_FILE_LIMIT:
            return _error(400, "Bad Request: file is too big")  # the cloud Bot API's rule
        size = self._reported_sizes.get(file_id, len(content))
        return _ok({"file_id": file_id, "file_unique_id": f"u-{file_id}",
                    "file_size": size, "file_path": path})


PHOTO_MAX_BYTES = 10 * 1024 * 1024
DOCUMENT_MAX_BYTES = 50 * 1024 * 1024


def _form_value(key: str, value: str) -> Any:
    if key in _STRING_FIELDS:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _read_text(text: Any, params: dict[str, Any]) -> Parsed | web.Response:
    """The message text as Telegram reads it, or the error Telegram answers with. The
    length limit counts the text after parsing (`&lt;` is one unit, not four)."""
    if not isinstance(text, str) or not text.strip():
        return _error(400, "Bad Request: message text is empty")
    try:
        parsed = parse_message(text, params.get("parse_mode"), params.get("entities"))
    except EntityError as exc:
        return _error(400, f"Bad Request: can't parse entities: {exc}")
    if not parsed.text.strip():
        return _error(400, "Bad Request: message text is empty")
    if utf16_len(parsed.text) > TEXT_LIMIT:
        return _error(400, "Bad Request: message is too long")
    return parsed


_query_ids = itertools.count(4_000_000_000_000_000_001)


def next_query_id() -> int:
    return next(_query_ids)


def _inline_keyboard(params: dict[str, Any]) -> list[list[dict[str, Any]]] | web.Response:
    """The rows of buttons `reply_markup` asks for ([] for none), or Telegram's refusal."""
    markup = params.get("reply_markup")
    if markup is None:
        return []
    if isinstance(markup, str):
        try:
            markup = json.loads(markup)
        except ValueError:
            return _error(400, "Bad Request: can't parse reply keyboard markup JSON object")
    if not isinstance(markup, dict) or "inline_keyboard" not in markup:
        return _error(400, "Bad Request: can't parse reply keyboard markup JSON object")
    rows = markup["inline_keyboard"]
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        return _error(400, "Bad Request: field \"inline_keyboard\" of the InlineKeyboardMarkup should be an Array "
                           "of Arrays")
    if sum(len(row) for row in rows) > MAX_BUTTONS:
        return _error(400, "Bad Request: too many inline keyboard buttons")
    for row in rows:
        for button in row:
            if not isinstance(button, dict) or not isinstance(button.get("text"), str) or not button["text"].strip():
                return _error(400, "Bad Request: can't parse inline keyboard button: Text is empty")
            actions = [key for key in _BUTTON_ACTIONS if key in button]
            if len(actions) != 1:
                return _error(400, "Bad Request: can't parse inline keyboard button: Text buttons are unallowed "
                                   "in the inline keyboard")
            data = button.get("callback_data")
            if "callback_data" in button and (
                    not isinstance(data, str) or not 1 <= len(data.encode("utf-8")) <= CALLBACK_DATA_LIMIT):
                return _error(400, "Bad Request: BUTTON_DATA_INVALID")
    return [row for row in rows if row]


def _not_modified() -> web.Response:
    return _error(400, "Bad Request: message is not modified: specified new message content and reply markup "
                       "are exactly the same as a current content and reply markup of the message")


def _ok(result: Any) -> web.Response:
    return web.json_response({"ok": True, "result": result})


def _error(status: int, description: str, retry_after: float | None = None) -> web.Response:
    body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
    if retry_after is not None:
        body["parameters"] = {"retry_after": retry_after}
    return web.json_response(body, status=status)


@pytest.fixture
async def fake_telegram() -> AsyncIterator[FakeTelegram]:
    fake = FakeTelegram()
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


def _chat(chat_id: Any) -> dict[str, Any]:
    """The chat of a message the bot sent: ids above zero are private chats."""
    return {"id": chat_id, "type": "private" if int(chat_id) > 0 else "supergroup"}
