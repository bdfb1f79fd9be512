"""The Telegram channel: python-telegram-bot's `Bot` for the Bot API, our own update loop.

Exactly-once (SPEC §3.1): an update is handed to the router and awaited *before* its
update_id is confirmed (the next getUpdates offset, or the webhook's 200). PTB's
Application/Updater confirm a batch before handlers finish, so we poll ourselves.

Parsing (`parse_update`) is pure and never raises: anything odd is dropped with a debug
log line. A message's file (the largest size of a photo, a document, a voice note, an
audio file, a round video note; the caption is the text) is fetched afterwards, only for
senders the router admits: getFile, then a download into the scope's `files/` capped
by `limits.max_inbound_file_mb` (the size Telegram reports is checked first, and the
bytes as they arrive). What becomes of the file is the turn's business (gateway/media.py).

Approvals (SPEC §5.7): the card comes with Allow and Deny buttons (channels/telegram/
approvals.py). A press arrives as a `callback_query` update in the same loop; it goes to
`hooks.decide` with the presser and the approval id from the button's data (nothing is
remembered here, so a card from before a restart still answers), and the query is
answered with the notice (Telegram shows it briefly; a refusal changes nothing). Once
decided the card is edited: the outcome in place of the last line, the buttons gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from telegram import (
    Bot,
    BotCommand,
    InlineKeyboardMarkup,
    MessageEntity,
    ReplyParameters,
)
from telegram.constants import ChatAction
from telegram.error import (
    BadRequest,
    ChatMigrated,
    Conflict,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
)
from yarl import URL

from channels.base import (
    AccessCheck,
    ApprovalCard,
    Decide,
    InboundHandler,
    ReplyRefSink,
    ReplyStream,
    StreamObserver,
    direct_inbound,
)
from channels.telegram.approvals import keyboard, parse_callback_data, render_card
from channels.telegram.bot import ALLOWED_UPDATES, POLL_READ_SLACK_S, RawBot
from channels.telegram.format import Chunk, render_markdown
from channels.telegram.stream import ChatPaces, TelegramReplyStream, parse_reply_ref
from channels.telegram.stream import is_format_error as _is_format_error
from channels.telegram.stream import retry_seconds as _retry_seconds
from channels.telegram.transport import AiohttpRequest
from channels.telegram.updates import (
    BotIdentity,
    ParsedClick,
    ParsedMessage,
    PendingFile,
    is_int,
    parse_callback,
    parse_update,
)
from gateway.config.checks import usable_webhook_secret
from gateway.config.schema import TelegramConfig
from gateway.http.proxy import env_proxy
from gateway.http.server import JsonBodyError, parse_json_body
from gateway.media import (
    FileRefused,
    ReplyFile,
    discard_saved,
    local_chunks,
    safe_file_name,
    save_download,
    too_large,
)
from gateway.types import Attachment, Inbound

log = logging.getLogger("channels.telegram")

DEFAULT_FILE_LIMIT = 20 * 1024 * 1024  # limits.max_inbound_file_mb's default (the cloud Bot API's own)
DOWNLOAD_TIMEOUT_S = 120.0
DOWNLOAD_READ_TIMEOUT_S = 30.0
TYPING_INTERVAL_S = 4.0  # Telegram shows "typing" for ~5 s
TYPING_DELAY_S = 0.5  # the indicator starts once a turn takes longer than this
SEND_ATTEMPTS = 5
PHOTO_MAX_BYTES = 10 * 1024 * 1024  # Bot API: photos a bot uploads
DOCUMENT_MAX_BYTES = 50 * 1024 * 1024  # Bot API: other files a bot uploads
HANDLER_ATTEMPTS = 3  # an update the router keeps failing on is dropped after this
READY_SLACK_S = 15.0
STOP_TIMEOUT_S = 5.0
POOL_CONNECTIONS = 32  # as many as turns may finish at once (limits.max_concurrent_model_calls)
# A reply waits this long for a free connection (the queue in front of the pool); the
# library's 1 s default turned a busy minute into undelivered replies.
POOL_WAIT_S = 30.0
TYPING_CONNECTIONS = 4  # of the pooled connections, at most this many send typing actions
MAX_NO_DRAFT_CHATS = 4096  # private chats remembered as refusing drafts (`auto`); the oldest go first
DECIDE_TIMEOUT_S = 10.0  # a press's answer waits this long for the decision (the query expires soon after)
CALLBACK_NOTICE_LIMIT = 200  # characters Telegram shows of a callback query's answer
SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"
NO_WEBHOOK_SECRET = ("telegram: webhook mode needs channels.telegram.webhook_secret "
                     "(16-256 characters of A-Z, a-z, 0-9, _ and -)")

Sleep = Callable[[float], Awaitable[None]]


# ---------------------------------------------------------------------------- channel


class _DownloadFailed(Exception):
    """The file could not be fetched from Telegram (an HTTP error, a lost connection)."""


class TelegramChannel:
    """Telegram via the Bot API, long polling or webhook (implements `Channel` and
    `WebhookChannel`)."""

    name = "telegram"
    webhook_path = "/telegram/webhook"

    def __init__(
        self,
        cfg: TelegramConfig,
        handler: InboundHandler,
        *,
        workspace_for: Callable[[Inbound], Path],
        commands: Sequence[tuple[str, str]] = (),
        sleep: Sleep = asyncio.sleep,
        admits: AccessCheck | None = None,
        stream_interval_s: float = 1.0,
        stream_interval: Callable[[], float] | None = None,
        observe: StreamObserver | None = None,
        file_limit: Callable[[], int] | None = None,
        decide: Decide | None = None,
    ) -> None:
        self._cfg = cfg
        self._decide = decide  # a press of Allow or Deny (SPEC §5.7); None: cards come without buttons
        self._handler = handler
        self._workspace_for = workspace_for
        # The largest file downloaded (limits.max_inbound_file_mb of the running config).
        self._file_limit = file_limit or (lambda: DEFAULT_FILE_LIMIT)
        self._downloads: aiohttp.ClientSession | None = None
        self._download_proxy: tuple[URL | None, aiohttp.BasicAuth | None] = (None, None)
        self._admits = admits
        self._commands = [(str(c), str(d)) for c, d in commands]
        self._sleep = sleep  # waits while sending (flood control, retries); injectable for tests
        self._bot: RawBot | None = None
        self._me: BotIdentity | None = None
        self._started = False
        self._connected = asyncio.Event()
        self._connector: asyncio.Task[None] | None = None  # retries a failed first connect
        self._poller: asyncio.Task[None] | None = None  # the receiving side in polling mode
        self._receiving = False
        self._polled_offset = 0  # the offset the last successful getUpdates sent (confirmed below it)
        self._typing_tasks: set[asyncio.Task[None]] = set()
        self._typing_slots = asyncio.Semaphore(TYPING_CONNECTIONS)
        self._offset = 0
        self._handler_failures: dict[int, int] = {}
        self._handling = 0  # polled batches being handled (stop_receiving lets them finish)
        self._stopping = False
        self._last_poll_ok: float | None = None
        self._webhook_ok = False
        # Least time between two updates of one chat: `stream_interval` (the running
        # config's `stream_interval_s`, read at each update) or a fixed value.
        self._stream_interval = stream_interval or (lambda: stream_interval_s)
        self._observe = observe
        self._paces = ChatPaces()
        self._stream_tasks: set[asyncio.Task[None]] = set()
        # Private chats where a draft was refused (`auto` then edits there), oldest first.
        self._no_drafts: dict[str, None] = {}

    @property
    def cfg(self) -> TelegramConfig:
        """The settings this instance runs with (the gateway restarts it when they change)."""
        return self._cfg

    # ------------------------------------------------------------ lifecycle

    @property
    def exclusive_receiver(self) -> bool:
        """Whether receiving must run on one gateway of a cluster at a time: Telegram
        answers a second concurrent getUpdates with 409. Webhooks reach any gateway."""
        return self._cfg.mode == "polling"

    async def start(self) -> None:
        """Both sides at once (one gateway alone, and the tests): `start_sending`, then
        `start_receiving`."""
        await self.start_sending()
        await self.start_receiving()

    async def start_sending(self) -> None:
        """Create the bot and connect (getMe, webhook setup, commands): what replies need,
        on every gateway. A bad token raises InvalidToken; other failures are retried in
        the background."""
        if self._started:
            return
        if self._cfg.mode == "webhook" and usable_webhook_secret(self._cfg) is None:
            raise ValueError(NO_WEBHOOK_SECRET)  # a config problem: retrying cannot fix it
        token = self._cfg.token.get_secret_value().strip() if self._cfg.token else ""
        self._bot = RawBot(
            token,
            base_url=self._cfg.base_url,
            base_file_url=self._file_url(),
            request=AiohttpRequest(pool_size=POOL_CONNECTIONS, read_timeout=20, write_timeout=20,
                                   pool_timeout=POOL_WAIT_S, proxy_for=self._cfg.base_url),
            get_updates_request=AiohttpRequest(
                pool_size=1, read_timeout=self._cfg.poll_timeout_s + POLL_READ_SLACK_S, proxy_for=self._cfg.base_url
            ),
        )
        self._stopping = False
        try:
            await self._connect()
        except InvalidToken:
            await self._close_bot()
            raise
        except Exception as exc:
            log.warning("telegram: cannot connect yet (%s); retrying in the background", exc)
            self._connector = asyncio.create_task(self._keep_connecting(), name="telegram-connect")
        self._started = True

    async def start_receiving(self) -> None:
        """Begin long polling (polling mode; webhooks need nothing). It waits for the
        connection when that is still being retried."""
        if not self._started or self._stopping or self._poller is not None or self._cfg.mode != "polling":
            return
        self._receiving = True
        self._poller = asyncio.create_task(self._receive(), name="telegram-poll")

    async def stop_receiving(self, *, lost: bool = False) -> None:
        """Stop polling: an update being handled finishes (bounded), an idle long poll is
        cancelled. What the router recorded is confirmed to Telegram so nobody is handed
        it again, unless the lead was `lost` (another gateway may poll already: a second
        getUpdates would cut its long poll); the new poller then re-reads what is
        unconfirmed and the dedup ledger drops what was already taken."""
        self._receiving = False
        task, self._poller = self._poller, None
        if task is None:
            return
        if not self._handling:
            task.cancel()  # idle in a long poll: nothing to lose
        done, _ = await asyncio.wait({task}, timeout=STOP_TIMEOUT_S)
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=1)
        if not lost and self._offset > self._polled_offset and self._bot is not None:
            # Confirm what the router already recorded, so a restart is not redelivered it.
            try:
                await asyncio.wait_for(self._bot.fetch_raw_updates(offset=self._offset, wait_s=0), 2)
                self._polled_offset = self._offset
            except Exception as exc:
                log.debug("telegram: final offset confirmation failed: %s", exc)
        self._last_poll_ok = None

    async def stop(self) -> None:
        self._stopping = True
        background = self._typing_tasks | self._stream_tasks
        for side_task in background:
            side_task.cancel()  # shutting down: the bot's connections close right after
        if background:
            await asyncio.wait(background, timeout=1)
        await self.stop_receiving()
        connector, self._connector = self._connector, None
        if connector is not None:
            connector.cancel()
            await asyncio.wait({connector}, timeout=1)
        self._started = False
        self._connected.clear()
        await self._close_bot()
        self._last_poll_ok = None
        self._webhook_ok = False

    def is_ready(self) -> bool:
        if not self._started or self._stopping or self._me is None:
            return False
        if self._cfg.mode == "webhook":
            return self._webhook_ok
        if self._poller is None:
            return True  # standby: another gateway of the cluster polls; replies go out from here
        if self._last_poll_ok is None:
            return False
        return time.monotonic() - self._last_poll_ok <= 2 * self._cfg.poll_timeout_s + READY_SLACK_S

    @property
    def identity(self) -> BotIdentity | None:
        return self._me

    def _file_url(self) -> str:
        if self._cfg.base_file_url:
            return self._cfg.base_file_url
        base = self._cfg.base_url
        head, sep, tail = base.rpartition("/bot")
        if sep:  # ".../bot" or ".../bot{token}" → ".../file/bot…"
            return f"{head}/file/bot{tail}"
        log.warning("telegram: cannot derive the file URL from base_url; set base_file_url")
        return "https://api.telegram.org/file/bot"

    async def _close_bot(self) -> None:
        downloads, self._downloads = self._downloads, None
        if downloads is not None:
            await downloads.close()
        bot, self._bot = self._bot, None
        if bot is None:
            return
        try:
            await asyncio.wait_for(bot.shutdown(), STOP_TIMEOUT_S)
        except Exception as exc:
            log.debug("telegram: shutdown: %s", exc)

    async def _connect(self) -> None:
        bot = self._require_bot()
        await bot.initialize()  # getMe
        user = bot.bot
        self._me = BotIdentity(user.id, user.username or "")
        if self._cfg.mode == "polling":
            await bot.delete_webhook(drop_pending_updates=False)
        else:
            secret = usable_webhook_secret(self._cfg)
            if secret is None:  # never a webhook anyone could post to
                raise ValueError(NO_WEBHOOK_SECRET)
            await bot.set_webhook(
                url=self._cfg.webhook_url or "",
                secret_token=secret,
                allowed_updates=list(ALLOWED_UPDATES),
            )
            self._webhook_ok = True
        await self._sync_commands(bot)
        self._connected.set()
        log.info("telegram: connected as @%s (%s mode)", self._me.username, self._cfg.mode)

    async def _sync_commands(self, bot: Bot) -> None:
        """setMyCommands only when Telegram's list differs: it is rate limited."""
        try:
            current = [(c.command, c.description) for c in await bot.get_my_commands()]
            if current == self._commands:
                return
            if self._commands:
                await bot.set_my_commands([BotCommand(c, d) for c, d in self._commands])
            else:
                await bot.delete_my_commands()
        except TelegramError as exc:
            log.warning("telegram: cannot update the command list: %s", exc)

    async def _keep_connecting(self) -> None:
        backoff = 1.0
        while not self._stopping:
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 60.0)
            try:
                await self._connect()
                return
            except Exception as exc:
                log.warning("telegram: connect failed (%s); retrying in %.0f s", exc, backoff)

    async def _receive(self) -> None:
        await self._connected.wait()  # the sending side connects (and retries) on its own
        await self._poll_forever()

    # ------------------------------------------------------------ polling

    async def _poll_forever(self) -> None:
        bot = self._require_bot()
        backoff = 1.0
        conflicted = False  # logged once per run of 409s, not at every retry
        while self._receiving:
            offset = self._offset
            # The first poll is short: it proves the link at once, where a long one would
            # keep /readyz at "not ready" for up to poll_timeout_s on a quiet bot.
            wait_s = self._cfg.poll_timeout_s if self._last_poll_ok is not None else 0
            try:
                batch = await bot.fetch_raw_updates(offset=offset, wait_s=wait_s)
            except asyncio.CancelledError:
                raise
            except RetryAfter as exc:
                await asyncio.sleep(_retry_seconds(exc))
                continue
            except Conflict as exc:
                # Another getUpdates for this bot: briefly during a hand-over between
                # gateways, or a second deployment with the same token.
                if not conflicted:
                    log.warning("telegram: another poller is using this bot (%s); backing off", exc)
                    conflicted = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            except Exception as exc:  # network down, 5xx, revoked token …
                log.warning("telegram: getUpdates failed (%s); retrying in %.0f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            self._last_poll_ok = time.monotonic()
            self._polled_offset = max(self._polled_offset, offset)
            if conflicted:
                log.info("telegram: polling again without conflict")
                conflicted = False
            backoff = 1.0
            if not self._receiving:
                return
            start_offset = self._offset
            retry = await self._consume_batch(batch)
            if retry or (batch and self._offset == start_offset):
                await asyncio.sleep(1.0)  # a router failure, or nothing confirmable: don't spin
            elif not batch and self._cfg.poll_timeout_s == 0:
                await asyncio.sleep(1.0)  # short polling

    async def _consume_batch(self, batch: list[Any]) -> bool:
        """Process a poll's updates and move the offset past those done; True when the
        router failed on one (it is fetched again after a pause).

        Each chat's updates go one after another, in the order the chat sent them; chats
        go side by side, so a poll's updates are recorded in one group commit instead of
        one commit each (a poll of 100 updates waited for 100 commits in a row). The offset
        stops before the first update not done; what was done after it in other chats
        comes again and the router's dedup drops it (SPEC §3.1)."""
        updates: list[tuple[int, Any]] = []
        for raw in batch:
            update_id = raw.get("update_id") if isinstance(raw, dict) else None
            if not is_int(update_id):
                log.debug("telegram: update without a usable update_id skipped")
                continue
            if update_id >= self._offset:
                updates.append((update_id, raw))
        if not updates:
            return False
        by_chat: dict[Any, list[tuple[int, Any]]] = {}
        for update_id, raw in updates:
            by_chat.setdefault(_chat_of(raw), []).append((update_id, raw))
        done: set[int] = set()

        async def chat_in_order(items: list[tuple[int, Any]]) -> None:
            for update_id, raw in items:
                if not self._receiving or not await self._consume(update_id, raw):
                    return  # the rest of this chat waits: its order is kept
                done.add(update_id)

        self._handling += 1
        try:
            if len(by_chat) == 1:
                await chat_in_order(updates)
            else:
                await asyncio.gather(*(chat_in_order(items) for items in by_chat.values()))
        finally:
            self._handling -= 1
        failed = False
        for update_id, _ in sorted(updates, key=lambda item: item[0]):
            if update_id not in done:
                failed = True
                break
            self._offset = update_id + 1
        return failed

    async def _consume(self, update_id: int, raw: Any) -> bool:
        """Process one polled update; False when the router failed and the update should
        be fetched again (up to HANDLER_ATTEMPTS times, then it is dropped)."""
        if not await self._process(raw):
            failures = self._handler_failures.get(update_id, 0) + 1
            self._handler_failures[update_id] = failures
            if failures < HANDLER_ATTEMPTS:
                return False
            log.error("telegram: update %s dropped after %d failed attempts", update_id, failures)
        self._handler_failures.pop(update_id, None)
        return True

    async def _process(self, raw: Any) -> bool:
        """Parse, fetch attachments, await the router. False only when the router failed."""
        me = self._me
        if me is None:
            return False
        if isinstance(raw, dict) and "callback_query" in raw:
            click = parse_callback(raw)
            if click is not None:
                self._in_handler = True
                try:
                    await self._on_click(click)
                except Exception:  # never a reason to hold the update loop up
                    log.exception("telegram: press %s not handled", click.query_id[:64])
                finally:
                    self._in_handler = False
            return True  # a press is answered once; a failure is the presser's notice, not a retry
        parsed = parse_update(raw, me, self._bot)
        if parsed is None:
            return True
        inbound = parsed.inbound
        try:
            if parsed.file is not None and (self._admits is None or await self._admits(inbound)):
                inbound = await self._with_files(parsed)
            taken = await self._handler(inbound)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("telegram: handling update %s failed", parsed.inbound.event_id)
            await discard_saved(self._workspace_for(inbound), inbound)  # fetched again on the retry
            return False
        if taken is False:  # a redelivery the router had seen: its first delivery has the file
            await discard_saved(self._workspace_for(inbound), inbound)
        return True

    # ------------------------------------------------------------ webhook

    async def handle_webhook(self, request: web.Request) -> web.StreamResponse:
        if self._cfg.mode != "webhook":
            return web.Response(status=404, text="telegram webhook is not enabled")
        # No usable secret configured means no request can prove it comes from Telegram.
        secret = usable_webhook_secret(self._cfg)
        given = request.headers.get(SECRET_HEADER, "")
        if secret is None or not hmac.compare_digest(given.encode("utf-8", "replace"), secret.encode("utf-8")):
            return web.Response(status=403, text="forbidden")
        if self._me is None or self._stopping:
            return web.Response(status=503, text="not connected yet")
        try:
            raw = await parse_json_body(await request.read())
        except JsonBodyError as err:
            return web.Response(status=400, text=str(err))
        if not isinstance(raw, dict):
            return web.Response(status=400, text="an update must be a JSON object")
        if not await self._process(raw):
            return web.Response(status=500, text="try again")  # Telegram redelivers
        return web.Response(text="ok")

    # ------------------------------------------------------------ attachments

    async def _with_files(self, parsed: ParsedMessage) -> Inbound:
        """The message with its file saved, or with what stopped it (the turn says so)."""
        inbound, pending = parsed.inbound, parsed.file
        if pending is None:
            return inbound
        try:
            attachment = await self._save_file(inbound, pending)
        except Exception as exc:  # the message still counts, without its file
            log.warning("telegram: file of message %s not saved: %s", inbound.message_id, exc)
            reason = str(exc) if isinstance(exc, FileRefused) else "the download from Telegram failed"
            attachment = Attachment(name=safe_file_name(pending.name), path="", mime=pending.mime,
                                    size=pending.size or 0, kind=pending.kind, duration_s=pending.duration_s,
                                    error=reason)
        return replace(inbound, attachments=(attachment,))

    async def _save_file(self, inbound: Inbound, pending: PendingFile) -> Attachment:
        limit = self._file_limit()
        if pending.size is not None and pending.size > limit:
            raise too_large(limit)  # never asked for: the size Telegram reported is enough
        try:
            tg_file = await self._require_bot().get_file(pending.file_id)
        except BadRequest as exc:
            if "too big" in str(exc).lower():
                raise FileRefused("it is larger than 20 MB, the most Telegram lets bots download") from None
            raise
        if is_int(tg_file.file_size) and tg_file.file_size > limit:
            raise too_large(limit)
        source = tg_file.file_path
        if not source:
            raise _DownloadFailed("Telegram gave no file path")
        if source.startswith(("http://", "https://")):
            chunks = self._fetch(source)
        else:  # a self-hosted Bot API server in --local mode hands out local paths
            chunks = local_chunks(Path(source))
        workspace = self._workspace_for(inbound)
        relative, size = await save_download(chunks, workspace, pending.name, limit=limit)
        return Attachment(name=safe_file_name(pending.name), path=relative, mime=pending.mime, size=size,
                          kind=pending.kind, duration_s=pending.duration_s)

    async def _fetch(self, url: str) -> AsyncIterator[bytes]:
        """The file's bytes as they arrive (the caller stops reading past its limit)."""
        if self._downloads is None:
            self._download_proxy = await asyncio.to_thread(env_proxy, URL(self._file_url()))
            timeout = aiohttp.ClientTimeout(total=DOWNLOAD_TIMEOUT_S, sock_read=DOWNLOAD_READ_TIMEOUT_S)
            self._downloads = aiohttp.ClientSession(timeout=timeout, cookie_jar=aiohttp.DummyCookieJar())
        proxy, proxy_auth = self._download_proxy
        async with self._downloads.get(URL(url, encoded=False), proxy=proxy, proxy_auth=proxy_auth) as resp:
            if resp.status != 200:
                raise _DownloadFailed(f"HTTP {resp.status}")
            async for block in resp.content.iter_chunked(65536):
                yield block

    # ------------------------------------------------------------ sending

    async def send_direct(self, user_id: str, text: str) -> None:
        """A DM to a person by user id (DirectChannel)."""
        await self.send(direct_inbound(self.name, user_id), text)

    async def send(self, inbound: Inbound, text: str) -> None:
        """Send a Markdown reply in chunks; raises TelegramError when a chunk cannot be
        delivered after the retries (earlier chunks stay sent)."""
        bot = self._require_bot()
        chunks = render_markdown(text)
        if not chunks:
            log.debug("telegram: empty reply to %s not sent", inbound.event_id)
            return
        chat: int | str = _chat_ref(inbound.chat_id)
        thread = _int_or_none(inbound.thread_id)
        reply_to = _int_or_none(inbound.message_id) if inbound.is_group else None
        for i, chunk in enumerate(chunks):
            chat = await self._send_chunk(bot, chat, chunk, thread, reply_to if i == 0 else None)

    async def send_files(self, inbound: Inbound, files: Sequence[ReplyFile]) -> None:
        """Files a reply names, after its text: images as photos (as documents when too
        large for one or refused as one), others as documents; a file over Telegram's
        limits, or refused, is logged and skipped."""
        bot = self._require_bot()
        chat: int | str = _chat_ref(inbound.chat_id)
        thread = _int_or_none(inbound.thread_id)
        for file in files:
            if file.size > DOCUMENT_MAX_BYTES:
                log.info("telegram: %s is too large to send (%d bytes)", file.name, file.size)
                continue
            data = await asyncio.to_thread(file.read_bytes)
            try:
                if file.is_image and len(data) <= PHOTO_MAX_BYTES:
                    try:
                        await bot.send_photo(chat_id=chat, photo=data, filename=file.name, message_thread_id=thread)
                        continue
                    except BadRequest as exc:  # Telegram takes it as a photo only within its rules
                        log.info("telegram: %s refused as a photo (%s); sending it as a file", file.name, exc)
                await bot.send_document(chat_id=chat, document=data, filename=file.name, message_thread_id=thread)
            except TelegramError as exc:
                log.warning("telegram: file %s not sent: %s", file.name, exc)

    async def _send_chunk(
        self, bot: RawBot, chat: int | str, chunk: Chunk, thread: int | None, reply_to: int | None
    ) -> int | str:
        """Returns the chat id to use from now on (a group may have become a supergroup)."""
        return (await self._deliver(bot, chat, chunk, thread, reply_to))[0]

    async def _deliver(
        self, bot: RawBot, chat: int | str, chunk: Chunk, thread: int | None, reply_to: int | None,
        reply_markup: InlineKeyboardMarkup | None = None,
    ) -> tuple[int | str, int]:
        """Send one message, waiting out flood control and following a migrated group;
        the chat id to use from now on, and the new message's id."""
        entities = list(chunk.entities)
        reply = {"message_id": reply_to, "allow_sending_without_reply": True} if reply_to else None
        attempt = 0
        while True:
            attempt += 1
            try:
                sent = await bot.send_text({
                    "chat_id": chat,
                    "text": chunk.text,
                    "entities": entities or None,
                    "message_thread_id": thread,
                    "reply_parameters": reply,
                    "link_preview_options": self._link_preview(),
                    "reply_markup": reply_markup,
                })
                return chat, sent
            except RetryAfter as exc:
                if attempt >= SEND_ATTEMPTS:
                    log.warning("telegram: still rate limited after %d attempts", attempt)
                    raise
                await self._sleep(_retry_seconds(exc))
            except ChatMigrated as exc:
                if attempt >= SEND_ATTEMPTS:
                    raise
                chat = exc.new_chat_id
            except BadRequest as exc:
                if entities and _is_format_error(exc):
                    log.info("telegram: formatting rejected (%s); sending plain text", exc)
                    entities = []
                    continue
                log.warning("telegram: message to %s refused: %s", chat, exc)
                raise
            except (Forbidden, InvalidToken) as exc:
                log.warning("telegram: cannot send to %s: %s", chat, exc)
                raise
            except NetworkError as exc:
                if attempt >= SEND_ATTEMPTS:
                    log.warning("telegram: sending to %s failed %d times: %s", chat, attempt, exc)
                    raise
                await self._sleep(min(2.0 ** (attempt - 1), 30.0))

    # ------------------------------------------------------------ approvals (SPEC §5.7)

    async def ask_approval(self, inbound: Inbound, card: ApprovalCard) -> str | None:
        """The card, with Allow and Deny under it, where the turn's message came from (its
        arguments as a file, and the files it names as messages, sent just before it when
        they do not fit); "chat:message id"."""
        bot = self._require_bot()
        chat: int | str = _chat_ref(inbound.chat_id)
        thread = _int_or_none(inbound.thread_id)
        reply_to = _int_or_none(inbound.message_id) if inbound.is_group else None
        shown = render_card(card)
        for file in shown.before:  # the named files that did not fit on the card, read first
            await self._deliver(bot, chat, Chunk(file.text, file.entities), thread, reply_to)
        if shown.document is not None:
            name, data = shown.document
            doc = await bot.send_document(chat_id=chat, document=data, filename=name, message_thread_id=thread,
                                          reply_parameters=ReplyParameters(reply_to, allow_sending_without_reply=True)
                                          if reply_to else None)
            reply_to = doc.message_id  # the card answers the file it names
        markup = keyboard(card) if self._decide is not None else None
        chat, sent = await self._deliver(bot, chat, Chunk(shown.text, shown.entities), thread, reply_to, markup)
        return f"{chat}:{sent}"

    async def settle_approval(self, inbound: Inbound, card: ApprovalCard, ref: str | None, outcome: str) -> None:
        """The card edited: the outcome in place of its last line, and no buttons (an edit
        without a keyboard removes it). A card that cannot be edited (deleted, never
        shown) gets the outcome as a message of its own."""
        bot = self._require_bot()
        place = _message_ref(ref)
        if place is not None:
            chat, message_id = place
            shown = render_card(card, outcome)
            entities: list[MessageEntity] | None = [MessageEntity.de_json(e, bot) for e in shown.entities]
            for attempt in range(1, SEND_ATTEMPTS + 1):
                try:
                    await bot.edit_message_text(shown.text, chat_id=chat, message_id=message_id, entities=entities,
                                                link_preview_options=self._link_preview())
                    return
                except RetryAfter as exc:
                    if attempt == SEND_ATTEMPTS:
                        raise
                    await self._sleep(_retry_seconds(exc))
                except BadRequest as exc:
                    if "not modified" in str(exc).lower():
                        return  # it says so already
                    if entities and _is_format_error(exc):
                        entities = None
                        continue
                    log.info("telegram: approval card %s not edited (%s); the outcome goes as a message",
                             card.id, exc)
                    with contextlib.suppress(TelegramError):  # at least no buttons left to press
                        await bot.edit_message_reply_markup(chat_id=chat, message_id=message_id)
                    break
                except NetworkError:
                    if attempt == SEND_ATTEMPTS:
                        raise
                    await self._sleep(min(2.0 ** (attempt - 1), 30.0))
        await self.send(inbound, f"Approval {card.id}: {outcome}")

    async def _on_click(self, click: ParsedClick) -> None:
        """A press of a card's button: the decision through `hooks.decide`, and the query
        answered with its notice (every query is answered, or the client keeps spinning)."""
        bot = self._require_bot()
        notice = ""
        wanted = parse_callback_data(click.data)
        if wanted is not None and click.who is not None and self._decide is not None:
            approval_id, allow = wanted
            try:
                async with asyncio.timeout(DECIDE_TIMEOUT_S):
                    notice = await self._decide(approval_id, click.who, allow)
            except Exception as exc:
                log.warning("telegram: the answer to approval %s was not recorded: %s", approval_id, exc)
                notice = "Your answer could not be recorded; please try again."
        if len(notice) > CALLBACK_NOTICE_LIMIT:
            notice = notice[:CALLBACK_NOTICE_LIMIT - 1] + "…"
        try:
            await bot.answer_callback_query(click.query_id, text=notice or None)
        except TelegramError as exc:  # too old (answered after a restart), or junk
            log.debug("telegram: callback query %s not answered: %s", click.query_id[:64], exc)

    def stream(self, inbound: Inbound, *, on_ref: ReplyRefSink | None = None,
               resume_ref: str | None = None) -> ReplyStream | None:
        """A reply shown as it grows (SPEC §5.1): as a draft in private chats (`auto`,
        `draft`), by editing messages elsewhere and in `edit` mode; None when `streaming`
        is "off" (the reply is then sent whole with `send()`)."""
        if self._cfg.streaming == "off":
            return None
        chat = _chat_ref(inbound.chat_id)
        return TelegramReplyStream(
            bot=self._require_bot,
            chat=chat,
            thread=_int_or_none(inbound.thread_id),
            reply_to=_int_or_none(inbound.message_id) if inbound.is_group else None,
            pace=self._paces.for_chat(chat),
            interval=self._stream_interval,
            tasks=self._stream_tasks,
            on_ref=on_ref,
            resume_ids=parse_reply_ref(resume_ref, chat),
            observe=self._observe,
            link_preview=self._link_preview(),
            drafts=self._drafts_in(inbound),
            on_drafts_refused=lambda: self._drafts_refused(str(chat)),
        )

    def _link_preview(self) -> dict[str, bool] | None:
        """No previews unless `link_previews` is on: a URL that an attacker got into a reply
        would otherwise be fetched by Telegram's servers before anyone clicks it (the Bot
        API's LinkPreviewOptions)."""
        return None if self._cfg.link_previews else {"is_disabled": True}

    def _drafts_in(self, inbound: Inbound) -> bool:
        """Drafts where Telegram shows them, private chats; `auto` stops trying them in a
        chat that refused one (a self-hosted Bot API server without them, say)."""
        mode = self._cfg.streaming
        if mode not in ("auto", "draft") or inbound.is_group:
            return False
        return mode == "draft" or str(_chat_ref(inbound.chat_id)) not in self._no_drafts

    def _drafts_refused(self, chat: str) -> None:
        if self._cfg.streaming != "auto":
            return
        self._no_drafts.pop(chat, None)
        self._no_drafts[chat] = None
        while len(self._no_drafts) > MAX_NO_DRAFT_CHATS:
            del self._no_drafts[next(iter(self._no_drafts))]

    @asynccontextmanager
    async def typing(self, inbound: Inbound) -> AsyncIterator[None]:
        done = asyncio.Event()
        # A reply that comes at once needs no indicator: that is half the Bot API calls of a
        # quick turn, and a person cannot tell the difference. Only a turn still running
        # after TYPING_DELAY_S gets the task that sends it (a timer costs less than a task).
        timer = asyncio.get_running_loop().call_later(TYPING_DELAY_S, self._start_typing, inbound, done)
        try:
            yield
        finally:
            timer.cancel()
            # Told to stop, never cancelled: a request cancelled in flight could leave its
            # pooled connection checked out (seen with uvloop), and after enough turns
            # replies waited for a connection that never came back. The reply does not wait.
            done.set()

    def _start_typing(self, inbound: Inbound, done: asyncio.Event) -> None:
        if self._stopping:
            return
        task = asyncio.create_task(self._keep_typing(inbound, done), name="telegram-typing")
        self._typing_tasks.add(task)
        task.add_done_callback(self._typing_tasks.discard)

    async def _keep_typing(self, inbound: Inbound, done: asyncio.Event) -> None:
        chat = _chat_ref(inbound.chat_id)
        thread = _int_or_none(inbound.thread_id)
        while self._bot is not None and not self._stopping and not done.is_set():
            # Typing may use a few of the HTTP pool's connections, never the ones replies
            # need: with many turns in flight a round is skipped instead of queued.
            if not self._typing_slots.locked():
                async with self._typing_slots:
                    try:
                        await self._bot.send_chat_action(chat, ChatAction.TYPING, message_thread_id=thread)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # a missing indicator is not worth a failure
                        log.debug("telegram: typing indicator failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TYPING_INTERVAL_S):
                    await done.wait()

    def _require_bot(self) -> RawBot:
        if self._bot is None:
            raise RuntimeError("the telegram channel is not started")
        return self._bot


def _chat_of(raw: Any) -> Any:
    """The chat an update belongs to (its own order), as Telegram sent it; None when it has
    none that can be read (such updates go in one group, in order)."""
    message = raw.get("message") if isinstance(raw, dict) else None
    chat = message.get("chat") if isinstance(message, dict) else None
    chat_id = chat.get("id") if isinstance(chat, dict) else None
    return chat_id if isinstance(chat_id, int | str) and not isinstance(chat_id, bool) else None


def _chat_ref(chat_id: str) -> int | str:
    try:
        return int(chat_id)
    except ValueError:
        return chat_id  # "@channelname"


def _message_ref(ref: str | None) -> tuple[int | str, int] | None:
    """(chat, message id) of a card's reference, "chat:message id"; None when unusable."""
    if not ref:
        return None
    chat, _, message_id = ref.rpartition(":")
    if not chat or not message_id.isdigit():
        return None
    return _chat_ref(chat), int(message_id)


def _int_or_none(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None
