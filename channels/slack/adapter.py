"""The Slack channel: slack-bolt in Socket Mode or HTTP mode (SPEC §3, §6, §9).

Inbound: DMs (`message`, channel_type "im"), mentions (`app_mention`), and `message`
events in channels when the app subscribes to them (the router's group trigger decides).
A `message`/`app_mention` twin of one post and Slack's retries all map to the same
`Inbound.event_id` (`<channel>:<ts>`), so the router's dedup keeps one turn. The bolt app
runs with `process_before_response`, so an event is acknowledged only after the router's
handler returned (exactly-once, SPEC §3.1); a handler error leaves it unacknowledged and
Slack redelivers.

Replies go where the message was written: into its thread when it was in one (a thread
is a session of its own). A top-level channel message that mentions the bot is answered in
a thread under it with `reply_to_mode: "thread"` (the default; the mention opens that
thread's session), at the top level with "channel". Other top-level messages and DMs are
answered at the top level (the channel's top level is one session per person, or one
shared, per `group_session_scope`). Slash commands
(`/context`, `/config`, …) are acknowledged at once (Slack's 3 s deadline) and answered
ephemerally, only to the person who ran them: through the command's `response_url`
(no channel membership needed; at most 5 posts within 30 minutes), falling back to
`chat.postEphemeral` when the URL is used up, expired or refused.

Approvals (SPEC §5.7): the card is a Block Kit message with Allow and Deny buttons
(channels/slack/approvals.py). A press reaches the app as a `block_actions` interaction,
over Socket Mode (an `interactive` envelope) or in HTTP mode as a signed form post to the
Interactivity Request URL, which is /slack/events too; it is acknowledged at once, goes to
`hooks.decide` with the presser and the approval id from the button, and the presser gets
the notice ephemerally (a refusal changes nothing). Once decided the card is updated
(`chat.update`): the outcome in place of the buttons.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
from aiohttp import web
from slack_bolt.adapter.socket_mode.async_internals import send_async_response
from slack_bolt.adapter.socket_mode.internals import build_headers
from slack_bolt.app.async_app import AsyncApp
from slack_bolt.context.ack.async_ack import AsyncAck
from slack_bolt.context.async_context import AsyncBoltContext
from slack_bolt.request.async_request import AsyncBoltRequest
from slack_bolt.response import BoltResponse
from slack_sdk.errors import SlackApiError
from slack_sdk.socket_mode.aiohttp import SocketModeClient
from slack_sdk.socket_mode.request import SocketModeRequest
from slack_sdk.web.async_client import AsyncWebClient
from slack_sdk.web.async_slack_response import AsyncSlackResponse

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
from channels.slack.approvals import ACTIONS, card_blocks, code_pieces, file_name, summary
from channels.slack.events import (
    ParsedClick,
    ParsedEvent,
    SlackFile,
    parse_block_action,
    parse_command,
    parse_event,
    profile_name,
    reply_thread,
    slack_id,
    verify_signature,
)
from channels.slack.format import split_message, to_mrkdwn
from channels.slack.stream import SlackReplyStream
from channels.slack.stream import describe as _describe
from channels.slack.stream import error_code as _error_code
from channels.slack.stream import retry_after as _retry_after
from gateway.config.schema import SlackConfig
from gateway.http.server import JsonBodyError, JsonTooDeep, parse_json_body
from gateway.media import (
    FileRefused,
    ReplyFile,
    discard_saved,
    safe_file_name,
    save_download,
    too_large,
)
from gateway.types import Attachment, Inbound
from gateway.workspace import PathNotAllowed

log = logging.getLogger("channels.slack")
FILE_MAX_BYTES = 50 * 1024 * 1024  # files a reply names: read whole into memory, so kept modest (Slack takes 1 GB)

SLASH_COMMANDS = ("/context", "/config", "/compact", "/help", "/new")
WORKING_REACTION = "hourglass_flowing_sand"
DEFAULT_FILE_LIMIT = 20 * 1024 * 1024  # limits.max_inbound_file_mb's default
RATE_LIMIT_RETRIES = 3
RESPONSE_URL_USES = 5  # Slack accepts at most 5 posts to one response_url
API_TIMEOUT_S = 15
SIDE_CALL_TIMEOUT_S = 5.0  # reactions, users.info: best effort, never hold a turn up
TAKEN_KEPT = 2048  # event ids remembered so a post's twin event does not fetch its files again
DECIDE_TIMEOUT_S = 10.0  # a press waits this long for the decision before the presser is told it failed

# Set in a request's bolt context when the event must stay unacknowledged (Slack redelivers).
_DEFER = "gateway_defer_ack"

Sleep = Callable[[float], Awaitable[None]]


# ---------------------------------------------------------------------------- the channel


@dataclass
class _InFlight:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class SlackChannel:
    """Slack through slack-bolt; implements channels.base.Channel and WebhookChannel."""

    name = "slack"
    webhook_path = "/slack/events"

    def __init__(
        self,
        cfg: SlackConfig,
        handler: InboundHandler,
        *,
        workspace_for: Callable[[Inbound], Path],
        sleep: Sleep = asyncio.sleep,  # waits out Retry-After; tests inject their own
        start_timeout_s: float = 15.0,
        ping_interval_s: float = 10.0,
        admits: AccessCheck | None = None,
        stream_interval_s: float = 1.0,
        stream_interval: Callable[[], float] | None = None,
        observe: StreamObserver | None = None,
        file_limit: Callable[[], int] | None = None,
        decide: Decide | None = None,
    ) -> None:
        self._cfg = cfg
        self._decide = decide  # a press of Allow or Deny (SPEC §5.7); None: cards come without buttons
        # The largest file downloaded (limits.max_inbound_file_mb of the running config).
        self._file_limit = file_limit or (lambda: DEFAULT_FILE_LIMIT)
        # The running config's `stream_interval_s`, read as each reply starts, or a fixed value.
        self._stream_interval = stream_interval or (lambda: stream_interval_s)
        self._observe = observe
        self._handler = handler
        self._workspace_for = workspace_for
        self._admits = admits
        self._sleep = sleep
        self._start_timeout_s = start_timeout_s
        self._ping_interval_s = ping_interval_s
        self._bot_token = cfg.bot_token.get_secret_value() if cfg.bot_token else ""
        self._trusted_hosts = {"slack.com", urlsplit(cfg.base_url).hostname or "slack.com"}
        self._session: aiohttp.ClientSession | None = None
        self._client: AsyncWebClient | None = None
        self._app: AsyncApp | None = None
        self._socket: SocketModeClient | None = None
        self._connect_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._inflight: dict[str, _InFlight] = {}
        self._taken: OrderedDict[str, None] = OrderedDict()  # event ids the router took lately
        self._user_names: dict[str, tuple[str | None, float]] = {}
        self.bot_user_id: str | None = None
        self.bot_id: str | None = None
        self._running = False

    @property
    def cfg(self) -> SlackConfig:
        """The settings this instance runs with (the gateway restarts it when they change)."""
        return self._cfg

    # -- lifecycle

    @property
    def exclusive_receiver(self) -> bool:
        """Whether receiving must run on one gateway of a cluster at a time (Socket Mode:
        one connection, so each event reaches one gateway). HTTP events reach any gateway."""
        return self._cfg.mode == "socket"

    async def start(self) -> None:
        """Both sides at once (one gateway alone, and the tests)."""
        await self.start_sending()
        try:
            await self.start_receiving()
        except Exception:
            await self.stop()
            raise

    async def start_sending(self) -> None:
        """Sign in (auth.test) and build the Web API client: what replies need, on every
        gateway; in HTTP mode also what receives events."""
        if self._running:
            return
        self._session = aiohttp.ClientSession()
        self._client = AsyncWebClient(
            token=self._bot_token, base_url=self._cfg.base_url, session=self._session, timeout=API_TIMEOUT_S
        )
        try:
            auth = await asyncio.wait_for(self._client.auth_test(), self._start_timeout_s)
        except Exception as err:  # bad token, unreachable base_url, …: the caller logs it
            await self._close_session()
            raise RuntimeError(f"slack: auth.test failed: {_describe(err)}") from None
        self.bot_user_id = slack_id(auth.get("user_id"))
        self.bot_id = slack_id(auth.get("bot_id"))
        self._app = self._build_app(self._client)
        self._running = True
        log.info("slack: signed in as %s (%s mode)", self.bot_user_id, self._cfg.mode)

    async def start_receiving(self) -> None:
        """Open the Socket Mode connection (socket mode; HTTP mode needs nothing). Raises
        when the connection is refused, so another gateway may try."""
        if not self._running or self._socket is not None or self._cfg.mode != "socket":
            return
        assert self._app is not None
        app_token = self._cfg.app_token.get_secret_value() if self._cfg.app_token else ""
        self._socket = SocketModeClient(
            app_token=app_token, web_client=self._client, ping_interval=self._ping_interval_s,
            logger=logging.getLogger("channels.slack.socket"),
        )
        self._socket.socket_mode_request_listeners.append(self._on_socket_request)
        # The client retries a failed connect forever; it runs as our task, so a Slack
        # outage at start leaves us "not ready" and still trying instead of stuck here.
        self._connect_task = asyncio.create_task(self._socket.connect(), name="slack-connect")
        done, _ = await asyncio.wait({self._connect_task}, timeout=self._start_timeout_s)
        if not done:
            log.warning("slack: socket mode not connected after %.0fs; still trying", self._start_timeout_s)
            return
        err = self._connect_task.exception()
        if err is not None:
            await self.stop_receiving()
            raise RuntimeError(f"slack: socket mode connect failed: {_describe(err)}")

    async def stop_receiving(self, *, lost: bool = False) -> None:
        """Close the Socket Mode connection: Slack sends what comes next to the connection
        another gateway opens; an event not yet acknowledged here is redelivered there.
        `lost` (the lead went to another gateway) changes nothing here."""
        connect, self._connect_task = self._connect_task, None
        if connect is not None and not connect.done():
            connect.cancel()
            await asyncio.wait({connect}, timeout=5)
        if self._socket is not None:
            socket, self._socket = self._socket, None
            try:
                await asyncio.wait_for(socket.close(), 5)
            except Exception as err:  # closing a dead socket must not stop the shutdown
                log.debug("slack: socket close: %s", _describe(err))

    async def stop(self) -> None:
        self._running = False
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        self._tasks.clear()
        await self.stop_receiving()
        await self._close_session()
        self._app = None

    async def _close_session(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(session.close(), 5)

    def is_ready(self) -> bool:
        if not self._running:
            return False
        if self._cfg.mode == "http":
            return self.bot_user_id is not None
        if self._socket is None:
            # Standby: another gateway of the cluster holds the connection; replies go out from here.
            return self.bot_user_id is not None
        client = self._socket
        ws = client.current_session
        if client.closed or client.stale or ws is None or ws.closed:
            return False
        # Pongs answer our pings every ping_interval; none for long means a dead link.
        last = client.last_ping_pong_time
        return last is None or time.time() - last < self._ping_interval_s * 4 + 5

    # -- bolt wiring

    def _build_app(self, client: AsyncWebClient) -> AsyncApp:
        app = AsyncApp(
            client=client,
            name="gateway",
            logger=logging.getLogger("channels.slack.bolt"),
            # Listeners finish (the router has recorded the event) before the ack goes out.
            process_before_response=True,
            # handle_webhook verifies signatures itself (401 for bad or stale ones).
            request_verification_enabled=False,
        )
        app.event("message")(self._on_event)
        app.event("app_mention")(self._on_event)
        app.event(re.compile(".*"))(self._on_other_event)  # acknowledged, never answered
        app.command(re.compile(r"^/"))(self._on_command)
        app.action(ACTIONS)(self._on_approval_click)
        return app

    async def _on_socket_request(self, client: SocketModeClient, req: SocketModeRequest) -> None:
        started = time.time()
        response = await self._dispatch(
            lambda: AsyncBoltRequest(mode="socket_mode", body=req.payload, headers=build_headers(req))
        )
        if response is not None:
            await send_async_response(client, req, response, started)

    async def _dispatch(self, make_request: Callable[[], AsyncBoltRequest]) -> BoltResponse | None:
        """Run bolt; None when the request must stay unacknowledged, so Slack redelivers it:
        our handler failed, we are stopping, bolt's authorization (auth.test) or another
        middleware failed (5xx). What can never succeed is acknowledged: a payload bolt
        cannot even parse, and kinds we have no listener for (404)."""
        app = self._app
        if app is None or not self._running:
            return None
        try:
            request = make_request()
        except Exception as err:
            log.warning("slack: dropped a payload bolt cannot parse (%s)", _describe(err))
            return BoltResponse(status=200, body="")
        if _malformed_event(request.body):
            # Bolt itself raises on these shapes; a retry could never succeed: ack and drop.
            log.warning("slack: dropped an event callback with a malformed event")
            return BoltResponse(status=200, body="")
        response = await app.async_dispatch(request)
        # Bolt answers an auth.test failure with a 200 "user-facing" message: not an ack.
        authorized = request.context.authorize_result is not None or request.body.get("type") in (
            "url_verification", "ssl_check",
        )
        if request.context.get(_DEFER) or not authorized or response.status >= 500:
            return None
        if response.status >= 400:
            log.info("slack: acknowledged a request bolt answered %s", response.status)
            return BoltResponse(status=200, body="")
        return response

    async def _on_other_event(self, body: dict[str, Any]) -> None:
        log.debug("slack: ignored event type %r", _event_type(body))

    async def _on_event(self, body: dict[str, Any], context: AsyncBoltContext) -> None:
        if not self._running:
            # Unacknowledged: Slack redelivers to the instance that replaces us.
            context[_DEFER] = True
            return
        try:
            parsed = parse_event(
                body.get("event"), bot_user_id=self.bot_user_id, bot_id=self.bot_id, team_id=body.get("team_id"),
                reply_to_mode=self._cfg.reply_to_mode,
            )
        except Exception:
            log.warning("slack: dropped a malformed event", exc_info=True)
            return
        if parsed is None:
            log.debug("slack: ignored %r event", _event_type(body))
            return
        # Twins and retries of one post arrive together; one at a time lets the router's
        # dedup see the first before the second (and files are fetched once).
        async with self._one_at_a_time(parsed.inbound.event_id):
            # The twin of a post already taken is dropped by the router: its files are not fetched.
            twin = parsed.inbound.event_id in self._taken
            inbound = await self._complete(parsed, fetch_files=not twin)
            try:
                taken = await self._handler(inbound)
            except Exception:
                log.exception("slack: handler failed for %s; left unacknowledged", inbound.event_id)
                context[_DEFER] = True
                await self._discard(inbound)  # fetched again when Slack redelivers
                return
            if taken is False:
                await self._discard(inbound)  # a redelivery: the first delivery has the files
            self._taken[inbound.event_id] = None
            while len(self._taken) > TAKEN_KEPT:
                self._taken.popitem(last=False)

    async def _on_command(self, ack: AsyncAck, body: dict[str, Any]) -> None:
        await ack()  # Slack's 3 s deadline; the reply comes later, ephemerally
        try:
            inbound = parse_command(body)
        except Exception:
            log.warning("slack: dropped a malformed slash command", exc_info=True)
            return
        if inbound is None:
            log.debug("slack: ignored slash command payload")
            return
        self._spawn(self._deliver(inbound), name=f"slack-command-{inbound.event_id}")

    async def _on_approval_click(self, ack: AsyncAck, body: dict[str, Any]) -> None:
        await ack()  # Slack's 3 s deadline; the notice follows
        click = parse_block_action(body)
        if click is None:
            log.debug("slack: ignored a block action that is not an approval card's")
            return
        self._spawn(self._answer_click(click), name=f"slack-approval-{click.approval_id}")

    async def _answer_click(self, click: ParsedClick) -> None:
        """The decision through `hooks.decide`, and its notice to the presser alone."""
        if self._decide is None:
            return
        try:
            async with asyncio.timeout(DECIDE_TIMEOUT_S):
                notice = await self._decide(click.approval_id, click.who, click.allow)
        except Exception as exc:
            log.warning("slack: the answer to approval %s was not recorded: %s", click.approval_id, exc)
            notice = "Your answer could not be recorded; please try again."
        url = click.response_url
        if url is not None and self._trusted(url) and await self._post_response_url(url, notice):
            return
        try:
            params: dict[str, Any] = {"channel": click.who.chat_id, "user": click.who.user_id, "text": notice}
            if click.who.thread_id:
                params["thread_ts"] = click.who.thread_id
            await self._call(self._require_client().chat_postEphemeral, **params)
        except Exception as exc:  # the card still shows the outcome once decided
            log.info("slack: approval notice not delivered: %s", _describe(exc))

    async def _deliver(self, inbound: Inbound) -> None:
        try:
            await self._handler(inbound)
        except Exception:
            log.exception("slack: handler failed for %s", inbound.event_id)

    def _spawn(self, coro: Awaitable[None], *, name: str) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)  # cancelled by stop()
        task.add_done_callback(self._tasks.discard)
        return task

    @asynccontextmanager
    async def _one_at_a_time(self, event_id: str) -> AsyncIterator[None]:
        entry = self._inflight.setdefault(event_id, _InFlight())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                self._inflight.pop(event_id, None)

    # -- enrichment: names and files (best effort, never blocks delivery)

    async def _discard(self, inbound: Inbound) -> None:
        if any(a.path for a in inbound.attachments):
            await discard_saved(await asyncio.to_thread(self._workspace_for, inbound), inbound)

    async def _complete(self, parsed: ParsedEvent, *, fetch_files: bool = True) -> Inbound:
        inbound = parsed.inbound
        if inbound.user_name is None:
            name = await self._user_name(inbound.user_id)
            if name:
                inbound = replace(inbound, user_name=name)
        if fetch_files and parsed.files and (self._admits is None or await self._admits(inbound)):
            try:
                inbound = await self._attach(inbound, parsed.files)
            except Exception:
                log.warning("slack: could not save files of %s", inbound.event_id, exc_info=True)
        return inbound

    async def _user_name(self, user_id: str) -> str | None:
        cached = self._user_names.get(user_id)
        if cached is not None and (cached[0] is not None or time.monotonic() - cached[1] < 600):
            return cached[0]
        name: str | None = None
        try:
            assert self._client is not None
            resp = await asyncio.wait_for(self._client.users_info(user=user_id), SIDE_CALL_TIMEOUT_S)
            user = resp.get("user")
            if isinstance(user, dict):
                name = profile_name(user.get("profile")) or profile_name(user)
        except Exception as err:  # needs users:read; a missing name is fine
            log.debug("slack: users.info %s: %s", user_id, _describe(err))
        if len(self._user_names) > 5000:
            self._user_names.clear()
        self._user_names[user_id] = (name, time.monotonic())
        return name

    async def _attach(self, inbound: Inbound, files: tuple[SlackFile, ...]) -> Inbound:
        """The message with its files saved under the scope's files/, or with what stopped
        each one (the turn says so)."""
        workspace = await asyncio.to_thread(self._workspace_for, inbound)
        limit = self._file_limit()
        attachments: list[Attachment] = []
        for f in files:
            try:
                if f.size > limit:
                    raise too_large(limit)  # never fetched: the size Slack reported is enough
                relative, size = await save_download(self._download(f), workspace, f.name, limit=limit)
            except FileRefused as err:
                attachments.append(self._refused(f, str(err)))
                continue
            except (PathNotAllowed, OSError, aiohttp.ClientError, TimeoutError, _DownloadRefused) as err:
                log.warning("slack: file %s of %s not saved: %s", f.id, inbound.event_id, _describe(err))
                attachments.append(self._refused(f, "it could not be downloaded from Slack"))
                continue
            attachments.append(Attachment(name=safe_file_name(f.name), path=relative, mime=f.mime, size=size,
                                          kind=f.kind, duration_s=f.duration_s))
        return replace(inbound, attachments=inbound.attachments + tuple(attachments))

    @staticmethod
    def _refused(f: SlackFile, reason: str) -> Attachment:
        return Attachment(name=safe_file_name(f.name), path="", mime=f.mime, size=f.size, kind=f.kind,
                          duration_s=f.duration_s, error=reason)

    async def _download(self, f: SlackFile) -> AsyncIterator[bytes]:
        """The file's bytes as they arrive (the caller stops reading past its limit)."""
        if not self._trusted(f.url):
            # The bot token goes along: never to a host that is not Slack's (or base_url's).
            raise _DownloadRefused(f"untrusted host in {f.url[:80]!r}")
        assert self._session is not None
        headers = {"Authorization": f"Bearer {self._bot_token}"}
        timeout = aiohttp.ClientTimeout(total=120, sock_read=30)
        async with self._session.get(f.url, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                raise _DownloadRefused(f"HTTP {resp.status}")
            if resp.content_type == "text/html" and f.mime != "text/html":
                raise _DownloadRefused("got a login page (token lacks files:read?)")
            async for block in resp.content.iter_chunked(65536):
                yield block

    def _trusted(self, url: str) -> bool:
        try:
            parts = urlsplit(url)
        except ValueError:
            return False
        host = (parts.hostname or "").lower()
        if parts.scheme not in ("https", "http") or not host:
            return False
        return host in self._trusted_hosts or host.endswith(".slack.com")

    # -- replies

    async def send_direct(self, user_id: str, text: str) -> None:
        """A DM to a person by user id (DirectChannel)."""
        await self.send(direct_inbound(self.name, user_id), text)

    async def send(self, inbound: Inbound, text: str) -> None:
        chunks = split_message(to_mrkdwn(text))
        if not chunks:
            log.debug("slack: empty reply to %s not sent", inbound.event_id)
            return
        if inbound.extra.get("command"):
            await self._send_ephemeral(inbound, chunks)
            return
        thread_ts = reply_thread(inbound)
        for chunk in chunks:
            await self._post_chunk(inbound.chat_id, chunk, thread_ts)

    async def send_files(self, inbound: Inbound, files: Sequence[ReplyFile]) -> None:
        """Files a reply names, after its text, in one files_upload_v2 call into the
        reply's thread; files over FILE_MAX_BYTES are skipped. Not for slash commands
        (their replies are ephemeral)."""
        if self._client is None or inbound.extra.get("command"):
            return
        uploads: list[dict[str, Any]] = []
        for file in files:
            if file.size > FILE_MAX_BYTES:
                log.info("slack: %s is too large to send (%d bytes)", file.name, file.size)
                continue
            data = await asyncio.to_thread(file.read_bytes)
            uploads.append({"content": data, "filename": file.name, "title": file.name})
        if not uploads:
            return
        try:
            await self._client.files_upload_v2(file_uploads=uploads, channel=inbound.chat_id,
                                               thread_ts=reply_thread(inbound))
        except SlackApiError as exc:
            log.warning("slack: files not sent: %s", exc.response.get("error"))

    # -- approvals (SPEC §5.7)

    async def ask_approval(self, inbound: Inbound, card: ApprovalCard) -> str | None:
        """The card with Allow and Deny where the turn's message came from (the arguments
        uploaded as a file first when they are too long for the blocks); "channel:ts"."""
        client = self._require_client()
        thread_ts = reply_thread(inbound)
        if code_pieces(card.arguments) is None:
            await self._call(client.files_upload_v2, channel=inbound.chat_id, thread_ts=thread_ts,
                             file_uploads=[{"content": card.arguments.encode("utf-8", "backslashreplace"),
                                            "filename": file_name(card), "title": file_name(card)}])
        params: dict[str, Any] = {"channel": inbound.chat_id, "text": summary(card),
                                  "blocks": card_blocks(card, buttons=self._decide is not None), **self._unfurl()}
        if thread_ts:
            params["thread_ts"] = thread_ts
        resp = await self._call(client.chat_postMessage, **params)
        return f"{resp.get('channel') or inbound.chat_id}:{resp['ts']}"

    async def settle_approval(self, inbound: Inbound, card: ApprovalCard, ref: str | None, outcome: str) -> None:
        """The card updated: the outcome where the buttons were. A card that cannot be
        updated (deleted, never shown) gets the outcome as a message of its own."""
        channel, _, ts = (ref or "").partition(":")
        if slack_id(channel) is not None and slack_id(ts) is not None:
            try:
                await self._call(self._require_client().chat_update, channel=channel, ts=ts,
                                 text=summary(card, outcome), blocks=card_blocks(card, outcome=outcome))
                return
            except SlackApiError as err:
                log.info("slack: approval card %s not updated (%s); the outcome goes as a message",
                         card.id, _error_code(err))
        await self.send(inbound, f"Approval {card.id}: {outcome}")

    def stream(
        self, inbound: Inbound, *, on_ref: ReplyRefSink | None = None, resume_ref: str | None = None
    ) -> ReplyStream | None:
        """The reply shown as it grows (SPEC §5.1, channels/slack/stream.py): `native` Slack
        streams in a thread, else (or where Slack refuses them) `update` edits. None when
        `streaming` is off, and for slash commands (their ephemeral replies cannot be edited)."""
        mode = self._cfg.streaming
        if mode == "off" or self._client is None or inbound.extra.get("command"):
            return None
        recipient: dict[str, str] = {}
        native = mode == "native"
        if inbound.is_group and slack_id(inbound.user_id) is None:
            native = False  # a turn no member started (a webhook's): no recipient to stream to; edits
        elif inbound.is_group:  # Slack wants to know who a stream in a channel is for
            recipient["recipient_user_id"] = inbound.user_id
            team = inbound.extra.get("team_id")
            if isinstance(team, str) and team:
                recipient["recipient_team_id"] = team
        return SlackReplyStream(
            self._client, channel=inbound.chat_id, thread_ts=reply_thread(inbound), native=native,
            recipient=recipient, interval_s=self._stream_interval(), sleep=self._sleep,
            spawn=lambda coro, name: self._spawn(coro, name=name), name=f"slack-stream-{inbound.event_id}",
            observe=self._observe, on_ref=on_ref, resume_ref=resume_ref, unfurl=self._unfurl(),
        )

    def _unfurl(self) -> dict[str, bool]:
        """No unfurls unless `unfurl_links` is on: a URL that an attacker got into a reply
        would otherwise be fetched by Slack's servers before anyone clicks it."""
        on = self._cfg.unfurl_links
        return {"unfurl_links": on, "unfurl_media": on}

    async def _post_chunk(self, channel: str, chunk: str, thread_ts: str | None) -> None:
        client = self._require_client()
        params: dict[str, Any] = {"channel": channel, "text": chunk, **self._unfurl()}
        if thread_ts:
            params["thread_ts"] = thread_ts
        try:
            await self._call(client.chat_postMessage, **params)
        except SlackApiError as err:
            if _error_code(err) in _PERMANENT_ERRORS:
                raise
            # Formatting rejected (or an odd error): the same words, unformatted, once.
            log.warning("slack: chat.postMessage failed (%s); retrying as plain text", _error_code(err))
            await self._call(client.chat_postMessage, **params, mrkdwn=False)

    async def _send_ephemeral(self, inbound: Inbound, chunks: list[str]) -> None:
        client = self._require_client()
        url = inbound.extra.get("response_url")
        use_url = isinstance(url, str) and self._trusted(url)
        for i, chunk in enumerate(chunks):
            if use_url and i < RESPONSE_URL_USES and await self._post_response_url(str(url), chunk):
                continue
            use_url = False  # used up or refused: the rest go the other way, in order
            await self._call(
                client.chat_postEphemeral, channel=inbound.chat_id, user=inbound.user_id, text=chunk
            )

    async def _post_response_url(self, url: str, chunk: str) -> bool:
        assert self._session is not None
        # Never in place of the message the URL came with (an approval card's).
        body = {"response_type": "ephemeral", "replace_original": False, "text": chunk}
        try:
            timeout = aiohttp.ClientTimeout(total=API_TIMEOUT_S)
            async with self._session.post(url, json=body, timeout=timeout) as resp:
                if resp.status == 200:
                    return True
                log.info("slack: response_url answered HTTP %s; using chat.postEphemeral", resp.status)
        except (aiohttp.ClientError, TimeoutError) as err:
            log.info("slack: response_url failed (%s); using chat.postEphemeral", _describe(err))
        return False

    async def _call(
        self, method: Callable[..., Awaitable[AsyncSlackResponse]], **params: Any
    ) -> AsyncSlackResponse:
        """A Web API call that waits out rate limits (Retry-After, capped) a bounded number of times."""
        for attempt in range(RATE_LIMIT_RETRIES + 1):
            try:
                return await method(**params)
            except SlackApiError as err:
                if err.response.status_code != 429 or attempt == RATE_LIMIT_RETRIES:
                    raise
                delay = _retry_after(err.response.headers)
                log.info("slack: rate limited; retrying in %.1fs", delay)
                await self._sleep(delay)
        raise AssertionError("unreachable")

    def _require_client(self) -> AsyncWebClient:
        if self._client is None:
            raise RuntimeError("slack channel is not started")
        return self._client

    # -- typing: a reaction on the person's message while the agent works

    def typing(self, inbound: Inbound) -> AbstractAsyncContextManager[None]:
        return self._working(inbound)

    @asynccontextmanager
    async def _working(self, inbound: Inbound) -> AsyncIterator[None]:
        added = False
        if inbound.message_id and self._client is not None:
            added = await self._react("reactions_add", inbound)
        try:
            yield
        finally:
            if added:
                await self._react("reactions_remove", inbound)

    async def _react(self, method: str, inbound: Inbound) -> bool:
        client = self._client
        if client is None:
            return False
        call = getattr(client, method)
        try:
            await asyncio.wait_for(
                call(channel=inbound.chat_id, timestamp=inbound.message_id, name=WORKING_REACTION),
                SIDE_CALL_TIMEOUT_S,
            )
        except SlackApiError as err:
            code = _error_code(err)
            log.debug("slack: %s: %s", method, code)
            return code == "already_reacted"
        except Exception as err:  # a reaction is decoration; never fail a turn for it
            log.debug("slack: %s: %s", method, _describe(err))
            return False
        return True

    # -- HTTP mode

    async def handle_webhook(self, request: web.Request) -> web.StreamResponse:
        app = self._app
        if app is None or not self._running or self._cfg.mode != "http":
            return web.Response(status=503, text="slack channel not running in http mode")
        body = await request.read()
        secret = self._cfg.signing_secret.get_secret_value() if self._cfg.signing_secret else ""
        if not verify_signature(
            secret, body,
            request.headers.get("X-Slack-Request-Timestamp"),
            request.headers.get("X-Slack-Signature"),
            now=time.time(),
        ):
            log.warning("slack: refused a request with a bad or stale signature")
            return web.Response(status=401, text="invalid signature")
        text = body.decode("utf-8", "replace")
        try:
            payload = await _payload(text, request.content_type)
        except JsonTooDeep as err:  # bolt's own json.loads would raise RecursionError: a 500
            log.warning("slack: refused a request nested too deeply")
            return web.Response(status=400, text=str(err))
        if request.content_type == "application/json":
            challenge = _url_verification(payload)
            if challenge is not None:
                return web.json_response({"challenge": challenge})
        query, headers = request.query_string, dict(request.headers)
        resp = await self._dispatch(
            lambda: AsyncBoltRequest(body=text, query=query, headers=headers, mode="http")
        )
        if resp is None:  # Slack retries a failed delivery (X-Slack-Retry-Num)
            return web.Response(status=500, text="not processed")
        return web.Response(
            status=resp.status, body=resp.body.encode(), headers=resp.first_headers_without_set_cookie()
        )


class _DownloadRefused(Exception):
    pass


_PERMANENT_ERRORS = frozenset({
    "channel_not_found", "not_in_channel", "is_archived", "invalid_auth", "not_authed",
    "token_revoked", "account_inactive", "missing_scope", "ratelimited", "restricted_action",
})


async def _payload(text: str, content_type: str) -> Any:
    """The JSON a Slack request carries (the body, or a form's `payload` field), depth
    checked; None when there is none or it does not parse (bolt drops those itself).
    Raises JsonTooDeep."""
    if content_type == "application/x-www-form-urlencoded":
        text = next(iter(parse_qs(text).get("payload", [])), "")
        if not text:
            return None
    elif content_type != "application/json":
        return None
    try:
        return await parse_json_body(text)
    except JsonTooDeep:
        raise
    except JsonBodyError:
        return None


def _url_verification(payload: Any) -> str | None:
    if isinstance(payload, dict) and payload.get("type") == "url_verification":
        challenge = payload.get("challenge")
        return challenge if isinstance(challenge, str) else ""
    return None


def _malformed_event(body: Any) -> bool:
    """A body whose `event` is not an object (whatever the body's type), or an Events API
    callback whose event has no string `type`: bolt raises on both."""
    if not isinstance(body, dict) or "event" not in body:
        return False
    event = body["event"]
    if not isinstance(event, dict):
        return True
    return body.get("type") == "event_callback" and not isinstance(event.get("type"), str)


def _event_type(body: Any) -> Any:
    event = body.get("event") if isinstance(body, dict) else None
    return event.get("type") if isinstance(event, dict) else None
