"""The Discord channel: discord.py's gateway websocket for receiving, its REST client for
sending (SPEC §1, §3, §5.1, §10).

Two sides, as with Telegram polling: sending (REST only: `start_sending`) works on every
gateway of a cluster; receiving (`start_receiving`: a `discord.Client` holding the
gateway websocket, with the DM, guild message and message content intents) runs on the
one gateway that leads (`exclusive_receiver`), since every connected session of a bot is
handed every message. discord.py keeps the websocket alive: heartbeats, and after a drop
a RESUME (op 6) with the last sequence number it saw, so Discord replays what was missed;
a message it replays that was already handled is the same event (`Inbound.event_id` is
the message id) and the router's dedup drops it, also across restarts.

Messages are handled beside the receiving, in lanes (channels/discord/lanes.py): each chat
and person's messages one at a time, in the order they arrived, lanes side by side, so one
person's slow files never hold up anyone else's message. A file is downloaded only for a
sender the router admits (`hooks.admits`), capped by `limits.max_inbound_file_mb`, at most
PERSON_DOWNLOADS at once per person and PERSON_QUEUED_FILES waiting (more are refused, and
the turn says so). Replies go where the message was written (a thread is a
channel of its own), quoting the person's message in guild channels; nobody is pinged
by what the model writes. `send(..., components=...)` carries Discord message
components (buttons) on the last message of a reply.

Approvals (SPEC §5.7): the card comes with Allow and Deny buttons (channels/discord/
approvals.py). A press arrives over the gateway websocket as an INTERACTION_CREATE; it goes
to `hooks.decide` with the presser and the approval id from the button's custom id, and the
interaction is answered (within Discord's 3 s) with the notice, seen only by the presser (a
refusal changes nothing). Once decided the card is edited: the outcome in place of its last
line, the buttons gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import aiohttp
import discord
from discord.voice_client import VoiceClient
from yarl import URL

from channels.base import ApprovalCard, ChannelHooks, ReplyRefSink, ReplyStream, direct_inbound
from channels.discord.approvals import card_content, components, file_messages, file_name, in_file
from channels.discord.format import render_markdown
from channels.discord.lanes import Lanes, PersonFiles
from channels.discord.messages import (
    BotIdentity,
    ParsedMessage,
    PendingFile,
    Place,
    parse_click,
    parse_message,
    place_of_channel,
    place_of_payload,
)
from channels.discord.stream import ChannelPaces, DiscordReplyStream, parse_reply_ref
from channels.discord.transport import DiscordHttp, DiscordRest, Upload, new_nonce
from gateway.config.schema import DiscordConfig
from gateway.http.proxy import env_proxy
from gateway.media import FileRefused, ReplyFile, discard_saved, safe_file_name, save_download, too_large
from gateway.types import Attachment, Inbound
from gateway.workspace import PathNotAllowed

log = logging.getLogger(__name__)

INTENTS = discord.Intents(guilds=True, guild_messages=True, dm_messages=True, message_content=True)
CALL_TIMEOUT_S = 60.0  # one REST call, discord.py's own rate-limit waits included
LOGIN_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
DRAIN_TIMEOUT_S = 10.0  # messages received before receiving stopped still reach the router
GUILD_READY_TIMEOUT_S = 0.5  # discord.py's wait for GUILD_CREATEs before on_ready (not readiness)
INBOX_SIZE = 10_000  # received messages not handed to the router yet
HANDLER_ATTEMPTS = 3  # a message the router keeps failing on is dropped after this
SEND_ATTEMPTS = 5
TYPING_INTERVAL_S = 8.0  # Discord shows "typing" for 10 s
TYPING_DELAY_S = 0.5  # the indicator starts once a turn takes longer than this
UPLOAD_MAX_BYTES = 10 * 1024 * 1024  # what a bot may upload to any server without boosts
DOWNLOAD_TIMEOUT_S = 120.0
PERSON_DOWNLOADS = 2  # files of one person fetched at once
PERSON_QUEUED_FILES = 50  # files of one person waiting in messages not handled yet; more are refused
TOO_MANY_FILES = "you sent more files than I fetch at once; send this one again in a moment"
DOWNLOAD_READ_TIMEOUT_S = 30.0
PLACES_CACHE = 4096  # channels whose kind was looked up over REST
# A press must be answered within 3 s; the decision gets most of that, then the presser is
# told it is still being recorded (it goes on, and the card shows the outcome).
DECIDE_BUDGET_S = 1.5
INTENT_HELP = ("discord: Discord refused the gateway intents; turn on the Message Content intent "
               "(Developer Portal → your app → Bot → Privileged Gateway Intents)")

# We never join voice: without this discord.py warns once that voice libraries are missing.
VoiceClient.warn_nacl = False
if hasattr(VoiceClient, "warn_dave"):
    VoiceClient.warn_dave = False


class _DownloadFailed(Exception):
    """A file could not be fetched from Discord's CDN."""


class _Receiver(discord.Client):
    """discord.py's client holding the gateway websocket, its events handed to the channel."""

    def __init__(self, channel: DiscordChannel, http: DiscordHttp) -> None:
        super().__init__(intents=INTENTS, max_messages=None, chunk_guilds_at_startup=False,
                         guild_ready_timeout=GUILD_READY_TIMEOUT_S)
        # The client's own HTTP client would use discord.com; ours follows api_base.
        self.http = http
        self._connection.http = http
        self._channel = channel

    async def on_connect(self) -> None:  # READY received
        self._channel._set_connected(True)

    async def on_resumed(self) -> None:  # RESUMED received: missed events were replayed before it
        self._channel._set_connected(True)

    async def on_disconnect(self) -> None:
        self._channel._set_connected(False)

    async def on_message(self, message: discord.Message) -> None:
        self._channel._received(message)

    async def on_interaction(self, interaction: discord.Interaction) -> None:
        self._channel._pressed(interaction)


class DiscordChannel:
    """Discord via discord.py (implements `Channel` and `StreamingChannel`)."""

    name = "discord"
    # Every session connected with a bot's token is handed every message: one receiver
    # per cluster, like Telegram polling (SPEC §10).
    exclusive_receiver = True

    def __init__(self, cfg: DiscordConfig, hooks: ChannelHooks) -> None:
        self._cfg = cfg
        self._hooks = hooks
        self._rest: DiscordRest | None = None
        self._me: BotIdentity | None = None
        self._started = False
        self._stopping = False
        self._logged_in = asyncio.Event()
        self._connector: asyncio.Task[None] | None = None  # retries a failed first login
        self._receiver: asyncio.Task[None] | None = None  # the websocket side while leading
        self._consumer: asyncio.Task[None] | None = None  # hands received messages to the router
        self._receiving = False
        self._connected = False
        self._inbox: asyncio.Queue[discord.Message] = asyncio.Queue(maxsize=INBOX_SIZE)
        # (message, whether its files may be fetched), handled per chat and person
        self._lanes: Lanes[tuple[discord.Message, bool]] = Lanes(self._handle_received, backlog=INBOX_SIZE,
                                                                 name="discord-message")
        self._person_files = PersonFiles(at_once=PERSON_DOWNLOADS, queued=PERSON_QUEUED_FILES)
        self._places: OrderedDict[int, Place] = OrderedDict()
        self._downloads: aiohttp.ClientSession | None = None
        self._paces = ChannelPaces()
        self._side_tasks: set[asyncio.Task[None]] = set()  # typing indicators and reply streams

    @property
    def cfg(self) -> DiscordConfig:
        """The settings this instance runs with (the gateway restarts it when they change)."""
        return self._cfg

    @property
    def identity(self) -> BotIdentity | None:
        return self._me

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Both sides at once (one gateway alone, and the tests)."""
        await self.start_sending()
        await self.start_receiving()

    async def start_sending(self) -> None:
        """Sign in over REST (what replies need, on every gateway). A refused token raises
        discord.LoginFailure; other failures are retried in the background."""
        if self._started:
            return
        self._stopping = False
        try:
            await self._login()
        except discord.LoginFailure:
            raise  # a config problem: retrying cannot fix it
        except Exception as exc:
            log.warning("discord: cannot sign in yet (%s); retrying in the background", exc)
            self._connector = asyncio.create_task(self._keep_logging_in(), name="discord-login")
        self._started = True

    async def start_receiving(self) -> None:
        """Open the gateway websocket (it waits for the sign-in when that is being retried)."""
        if not self._started or self._stopping or self._receiver is not None:
            return
        self._receiving = True
        self._lanes.reopen()
        self._receiver = asyncio.create_task(self._receive(), name="discord-gateway")
        self._consumer = asyncio.create_task(self._consume(), name="discord-inbox")

    async def stop_receiving(self, *, lost: bool = False) -> None:
        """Close the websocket, then hand what was already received to the router (bounded)
        before stopping: Discord does not deliver it again to whoever receives next. `lost`
        changes nothing here: a new receiver opens a session of its own."""
        self._receiving = False
        receiver, self._receiver = self._receiver, None
        consumer, self._consumer = self._consumer, None
        if receiver is not None:
            # Cancelled first, closed after (in its `finally`): a client closed under a
            # running connect() would still dispatch events into a loop it no longer has.
            receiver.cancel()
            await asyncio.wait({receiver}, timeout=STOP_TIMEOUT_S + 1)
        if consumer is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DRAIN_TIMEOUT_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._inbox.join(), DRAIN_TIMEOUT_S)
            await self._lanes.join(max(0.0, deadline - loop.time()))
            consumer.cancel()
            await asyncio.wait({consumer}, timeout=STOP_TIMEOUT_S)
        await self._lanes.close(STOP_TIMEOUT_S)
        self._connected = False

    async def stop(self) -> None:
        self._stopping = True
        side = set(self._side_tasks)
        for task in side:
            task.cancel()
        if side:
            await asyncio.wait(side, timeout=1)
        await self.stop_receiving()
        connector, self._connector = self._connector, None
        if connector is not None:
            connector.cancel()
            await asyncio.wait({connector}, timeout=1)
        downloads, self._downloads = self._downloads, None
        if downloads is not None:
            await downloads.close()
        await self._close_rest()
        self._started = False
        self._logged_in.clear()

    def is_ready(self) -> bool:
        """Signed in and, where this gateway receives, the websocket connected (READY or
        RESUMED seen, no disconnect since)."""
        if not self._started or self._stopping or self._me is None:
            return False
        if self._receiver is None:
            return True  # standby: another gateway of the cluster receives; replies go out from here
        return self._connected

    async def _new_http(self) -> DiscordHttp:
        proxy, auth = await asyncio.to_thread(env_proxy, URL(self._cfg.api_base))
        return DiscordHttp(self._cfg.api_base, proxy=str(proxy) if proxy else None, proxy_auth=auth)

    def _token(self) -> str:
        return self._cfg.token.get_secret_value().strip() if self._cfg.token else ""

    async def _login(self) -> None:
        rest = DiscordRest(await self._new_http())
        try:
            user = await asyncio.wait_for(rest.login(self._token()), LOGIN_TIMEOUT_S)
            me = BotIdentity(int(user["id"]), str(user.get("username") or ""))
        except BaseException:
            await rest.close()  # each sign-in opens its own HTTP session
            raise
        self._rest, self._me = rest, me
        self._logged_in.set()
        log.info("discord: signed in as %s (%s)", self._me.name, self._me.id)

    async def _keep_logging_in(self) -> None:
        backoff = 1.0
        while not self._stopping:
            await asyncio.sleep(backoff)
            try:
                await self._login()
                return
            except discord.LoginFailure as exc:
                log.error("discord: the token was refused: %s", exc)
                backoff = 60.0
            except Exception as exc:
                log.warning("discord: cannot sign in yet: %s", exc)
                backoff = min(backoff * 2, 30.0)

    async def _close_rest(self) -> None:
        rest, self._rest = self._rest, None
        if rest is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(rest.close(), STOP_TIMEOUT_S)

    # ------------------------------------------------------------ receiving

    def _set_connected(self, connected: bool) -> None:
        self._connected = connected and self._receiving

    def _received(self, message: discord.Message) -> None:
        # Called first thing in discord.py's event task: tasks start in the order events
        # arrived, so the inbox keeps Discord's order.
        try:
            self._inbox.put_nowait(message)
        except asyncio.QueueFull:
            log.error("discord: %d messages wait for the router; message %s dropped", INBOX_SIZE, message.id)

    async def _receive(self) -> None:
        """Hold the websocket while leading: a new client (and session) after a failure that
        discord.py does not resume by itself (a refused token, refused intents, an outage)."""
        await self._logged_in.wait()
        backoff = 1.0
        while self._receiving:
            client = _Receiver(self, await self._new_http())
            try:
                await asyncio.wait_for(client.login(self._token()), LOGIN_TIMEOUT_S)
                backoff = 1.0
                await client.connect(reconnect=True)  # returns once the client is closed
            except asyncio.CancelledError:
                raise
            except discord.PrivilegedIntentsRequired:
                log.error(INTENT_HELP)
                backoff = 60.0
            except discord.LoginFailure as exc:
                log.error("discord: the token was refused: %s", exc)
                backoff = 60.0
            except Exception as exc:
                if self._receiving:  # else: the client was closed under it on purpose
                    log.warning("discord: gateway connection failed: %s", exc)
            finally:
                self._connected = False
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.close(), STOP_TIMEOUT_S)
            if not self._receiving:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 60.0)

    async def _consume(self) -> None:
        """The inbox, in Discord's order, into the lanes: one per chat and person."""
        while True:
            message = await self._inbox.get()
            try:
                counted = self._person_files.take(message.author.id, len(message.attachments))
                await self._lanes.put((message.channel.id, message.author.id), (message, counted))
            finally:
                self._inbox.task_done()

    async def _handle_received(self, item: tuple[discord.Message, bool]) -> None:
        message, counted = item
        try:
            await self._process(message, fetch=counted)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("discord: message %s could not be handled", message.id)
        finally:
            if counted:
                self._person_files.done(message.author.id, len(message.attachments))

    async def _process(self, message: discord.Message, *, fetch: bool = True) -> None:
        me, rest = self._me, self._rest
        if me is None or rest is None:
            return
        place = await self._place(message)
        if place is None:
            return
        parsed = parse_message(message, me, place)
        if parsed is None:
            return
        if place.kind == "dm":
            rest.remember_dm(message.author.id, place.channel_id)
        inbound = parsed.inbound
        if parsed.files and await self._hooks.admits(inbound):
            inbound = await self._with_files(parsed, message.author.id) if fetch else \
                replace(inbound, attachments=tuple(_refused(p, TOO_MANY_FILES) for p in parsed.files))
        for attempt in range(1, HANDLER_ATTEMPTS + 1):
            try:
                taken = await self._hooks.handle(inbound)
                break
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("discord: handling message %s failed (attempt %d)", inbound.event_id, attempt)
                if attempt == HANDLER_ATTEMPTS:
                    log.error("discord: message %s dropped after %d failed attempts", inbound.event_id, attempt)
                    await discard_saved(self._hooks.workspace_for(inbound), inbound)
                    return
                await asyncio.sleep(attempt)
        if taken is False:  # seen before (a replay): its first delivery has the files
            await discard_saved(self._hooks.workspace_for(inbound), inbound)

    async def _place(self, message: discord.Message) -> Place | None:
        """Where the message was written; a channel discord.py does not know (a thread older
        than the connection) is looked up once over REST."""
        if isinstance(message.channel, discord.GroupChannel):
            return None  # bots are never in group DMs
        return await self._place_of(message.channel, message.channel.id,
                                    getattr(message.channel, "guild_id", None) or message.guild)

    async def _place_of(self, channel: Any, channel_id: int, guild: Any, timeout: float = CALL_TIMEOUT_S) -> Place:
        """The place of a channel (`guild`: whether it is in a server, when it must be
        guessed because the lookup failed)."""
        known = place_of_channel(channel)
        if known is not None:
            return known
        cached = self._places.get(channel_id)
        if cached is not None:
            return cached
        try:
            found = place_of_payload(await asyncio.wait_for(self._require_rest().channel(channel_id), timeout))
        except Exception as exc:
            log.warning("discord: channel %s could not be looked up (%s); taken as a channel", channel_id, exc)
            found = None
        if found is None:
            return Place("channel", channel_id) if guild is not None else Place("dm", channel_id)
        self._places[channel_id] = found
        while len(self._places) > PLACES_CACHE:
            self._places.popitem(last=False)
        return found

    # ------------------------------------------------------------ approvals (SPEC §5.7)

    def _pressed(self, interaction: discord.Interaction) -> None:
        # Answered in a task of ours (cancelled by stop), never behind queued messages.
        task = asyncio.create_task(self._answer_press(interaction), name="discord-interaction")
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _answer_press(self, interaction: discord.Interaction) -> None:
        rest, channel_id = self._rest, interaction.channel_id
        if rest is None or channel_id is None:
            return
        place = await self._place_of(interaction.channel, channel_id, interaction.guild_id, timeout=1.0)
        click = parse_click(interaction, place)
        if click is None:
            return  # not ours to answer (another app's component, a command)
        notice = "Your answer could not be recorded; please try again."
        if self._hooks.decide is not None:
            deciding = asyncio.ensure_future(self._hooks.decide(click.approval_id, click.who, click.allow))
            done, _ = await asyncio.wait({deciding}, timeout=DECIDE_BUDGET_S)
            if not done:
                # It goes on (its own task, owned until it ends); the card shows the outcome.
                self._side_tasks.add(deciding)
                deciding.add_done_callback(self._side_tasks.discard)
                notice = "Your answer is being recorded; the card will show the outcome."
            elif deciding.exception() is None:
                notice = deciding.result()
            else:
                log.warning("discord: the answer to approval %s was not recorded: %s", click.approval_id,
                            deciding.exception())
        try:
            await asyncio.wait_for(rest.respond(interaction.id, interaction.token, notice), CALL_TIMEOUT_S)
        except Exception as exc:  # expired (over 3 s) or refused: the card still shows the outcome
            log.info("discord: interaction %s not answered: %s", interaction.id, exc)

    async def ask_approval(self, inbound: Inbound, card: ApprovalCard) -> str | None:
        """The card with Allow and Deny where the turn's message came from (the arguments
        as a file, and the files it names as messages, posted first when they do not fit);
        "channel id:message id"."""
        rest = self._require_rest()
        target = await self._target(inbound)
        for text in file_messages(card):  # the named files that did not fit on the card, read first
            await self._post(rest, target, text, None, None)
        if in_file(card):
            data = card.arguments.encode("utf-8", "backslashreplace")
            await asyncio.wait_for(rest.upload(target, [Upload(file_name(card), data)]), CALL_TIMEOUT_S)
        buttons = self._hooks.decide is not None
        content = card_content(card, buttons=buttons)
        message_id = await self._post(rest, target, content, _reply_to(inbound), components(card) if buttons else None)
        return f"{target}:{message_id}"

    async def settle_approval(self, inbound: Inbound, card: ApprovalCard, ref: str | None, outcome: str) -> None:
        """The card edited: the outcome in place of its last line, no buttons. A card that
        cannot be edited (deleted, never shown) gets the outcome as a message of its own."""
        channel, _, message = (ref or "").partition(":")
        if channel.isdigit() and message.isdigit():
            try:
                await asyncio.wait_for(self._require_rest().edit(int(channel), int(message),
                                                                 card_content(card, outcome), components=[]),
                                       CALL_TIMEOUT_S)
                return
            except (discord.NotFound, discord.Forbidden) as exc:
                log.info("discord: approval card %s not edited (%s); the outcome goes as a message", card.id, exc)
        await self.send(inbound, f"Approval {card.id}: {outcome}")

    # ------------------------------------------------------------ attachments

    async def _with_files(self, parsed: ParsedMessage, person: int) -> Inbound:
        """The message with its files saved under the scope's files/, or with what stopped
        each one (the turn says so); a few of the person's at once, in their order."""
        inbound = parsed.inbound
        workspace = self._hooks.workspace_for(inbound)
        limit = self._hooks.file_limit()

        async def one(pending: PendingFile) -> Attachment:
            try:
                if pending.size > limit:
                    raise too_large(limit)  # never fetched: the size Discord reported is enough
                async with self._person_files.slot(person):
                    relative, size = await save_download(self._fetch(pending.url), workspace, pending.name,
                                                         limit=limit)
            except FileRefused as exc:
                return _refused(pending, str(exc))
            except (_DownloadFailed, aiohttp.ClientError, OSError, TimeoutError, PathNotAllowed) as exc:
                log.warning("discord: file %s of message %s not saved: %s", pending.id, inbound.event_id, exc)
                return _refused(pending, "the download from Discord failed")
            return Attachment(name=safe_file_name(pending.name), path=relative, mime=pending.mime, size=size,
                              kind=pending.kind, duration_s=pending.duration_s)

        saved = await asyncio.gather(*(one(pending) for pending in parsed.files))
        return replace(inbound, attachments=tuple(saved))

    async def _fetch(self, url: str) -> AsyncIterator[bytes]:
        """A file's bytes from the CDN as they arrive (the caller stops reading past its
        limit). Attachment URLs are signed: no token goes along."""
        target = URL(url)
        if target.scheme not in ("http", "https") or not target.host:
            raise _DownloadFailed(f"not a web address: {url[:80]!r}")
        if self._downloads is None:
            timeout = aiohttp.ClientTimeout(total=DOWNLOAD_TIMEOUT_S, sock_read=DOWNLOAD_READ_TIMEOUT_S)
            self._downloads = aiohttp.ClientSession(timeout=timeout, cookie_jar=aiohttp.DummyCookieJar())
        proxy, proxy_auth = await asyncio.to_thread(env_proxy, target)
        async with self._downloads.get(target, proxy=proxy, proxy_auth=proxy_auth) as resp:
            if resp.status != 200:
                raise _DownloadFailed(f"HTTP {resp.status}")
            async for block in resp.content.iter_chunked(65536):
                yield block

    # ------------------------------------------------------------ sending

    async def send_direct(self, user_id: str, text: str) -> None:
        """A DM to a person by user id (DirectChannel)."""
        await self.send(direct_inbound(self.name, user_id), text)

    async def send(self, inbound: Inbound, text: str, *,
                   components: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Send a Markdown reply in messages of at most 2,000 characters; `components`
        (Discord message components: rows of buttons) go on the last one. Raises
        discord.HTTPException when a message cannot be delivered (earlier ones stay)."""
        rest = self._require_rest()
        chunks = render_markdown(text)
        if not chunks:
            log.debug("discord: empty reply to %s not sent", inbound.event_id)
            return
        target = await self._target(inbound)
        reply_to = _reply_to(inbound)
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            await self._post(rest, target, chunk, reply_to if i == 0 else None, components if last else None)

    async def _post(self, rest: DiscordRest, target: int, chunk: str, reply_to: int | None,
                    components: Sequence[Mapping[str, Any]] | None) -> int:
        """Post one message (retried, posted once); its id."""
        nonce = new_nonce()  # the same for every attempt: Discord posts it once
        for attempt in range(1, SEND_ATTEMPTS + 1):
            try:
                return await asyncio.wait_for(rest.post(target, chunk, reply_to=reply_to, components=components,
                                                        nonce=nonce), CALL_TIMEOUT_S)
            except discord.RateLimited as exc:  # longer than discord.py waits on its own
                if attempt == SEND_ATTEMPTS:
                    raise
                await asyncio.sleep(min(float(exc.retry_after), 60.0))
            except (discord.DiscordServerError, aiohttp.ClientError, OSError, TimeoutError) as exc:
                if attempt == SEND_ATTEMPTS:
                    log.warning("discord: sending to %s failed %d times: %s", target, attempt, exc)
                    raise
                await asyncio.sleep(min(2.0 ** (attempt - 1), 30.0))
        raise AssertionError("unreachable")  # the last attempt returns or raises

    async def send_files(self, inbound: Inbound, files: Sequence[ReplyFile]) -> None:
        """Files a reply names, after its text, one message each; a file over Discord's
        upload limit, or refused, is logged and skipped."""
        rest = self._require_rest()
        target = await self._target(inbound)
        for file in files:
            if file.size > UPLOAD_MAX_BYTES:
                log.info("discord: %s is too large to send (%d bytes)", file.name, file.size)
                continue
            data = await asyncio.to_thread(file.read_bytes)
            try:
                await asyncio.wait_for(rest.upload(target, [Upload(file.name, data)]), CALL_TIMEOUT_S)
            except (discord.HTTPException, discord.RateLimited, aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.warning("discord: file %s not sent: %s", file.name, exc)

    async def _target(self, inbound: Inbound) -> int:
        """The channel a reply to `inbound` goes to: where it was written (a thread is a
        channel), or the person's DM (opened over REST when only their id is known, as for
        a notice to an admin)."""
        known = _channel_of(inbound)
        if known is not None:
            return known
        return await asyncio.wait_for(self._require_rest().dm_channel(_snowflake(inbound.user_id)), CALL_TIMEOUT_S)

    def stream(self, inbound: Inbound, *, on_ref: ReplyRefSink | None = None,
               resume_ref: str | None = None) -> ReplyStream | None:
        """A reply shown as it grows by editing messages (SPEC §5.1), or None when
        `streaming` is "off" or the DM channel is not known yet (the reply is then sent
        whole with `send()`)."""
        if self._cfg.streaming == "off":
            return None
        channel_id = _channel_of(inbound)
        if channel_id is None and self._rest is not None:
            channel_id = self._rest.known_dm(_snowflake(inbound.user_id))
        if channel_id is None:
            return None
        return DiscordReplyStream(
            rest=self._require_rest,
            channel_id=channel_id,
            reply_to=_reply_to(inbound),
            pace=self._paces.for_channel(channel_id),
            interval=self._hooks.stream_interval,
            tasks=self._side_tasks,
            on_ref=on_ref,
            resume_ids=parse_reply_ref(resume_ref, channel_id),
            observe=self._hooks.observe,
        )

    @asynccontextmanager
    async def typing(self, inbound: Inbound) -> AsyncIterator[None]:
        done = asyncio.Event()
        task = asyncio.create_task(self._keep_typing(inbound, done), name="discord-typing")
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)
        try:
            yield
        finally:
            done.set()  # told to stop; the reply does not wait for it

    async def _keep_typing(self, inbound: Inbound, done: asyncio.Event) -> None:
        # A reply that comes at once needs no indicator.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(TYPING_DELAY_S):
                await done.wait()
        while self._rest is not None and not self._stopping and not done.is_set():
            try:
                target = await self._target(inbound)
                await asyncio.wait_for(self._rest.typing(target), CALL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a missing indicator is not worth a failure
                log.debug("discord: typing indicator failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TYPING_INTERVAL_S):
                    await done.wait()

    def _require_rest(self) -> DiscordRest:
        if self._rest is None:
            raise RuntimeError("the discord channel is not started")
        return self._rest


def _refused(pending: PendingFile, reason: str) -> Attachment:
    return Attachment(name=safe_file_name(pending.name), path="", mime=pending.mime, size=pending.size,
                      kind=pending.kind, duration_s=pending.duration_s, error=reason)


def _channel_of(inbound: Inbound) -> int | None:
    """The channel the message was written in, when the inbound names it."""
    for value in (inbound.extra.get("channel_id"),
                  *((inbound.thread_id, inbound.chat_id) if inbound.is_group else ())):
        if isinstance(value, str) and value.isdigit() and len(value) <= 20:
            return int(value)
    return None


def _reply_to(inbound: Inbound) -> int | None:
    """In a guild channel the first message of a reply quotes the person's (as Telegram
    groups do); a DM needs no quote."""
    mid = inbound.message_id
    if inbound.is_group and isinstance(mid, str) and mid.isdigit() and len(mid) <= 20:
        return int(mid)
    return None


def _snowflake(value: str) -> int:
    if not value.isdigit() or len(value) > 20:
        raise ValueError(f"discord: {value[:30]!r} is not a Discord id")
    return int(value)
