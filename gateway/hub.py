"""The channel hub: the running channels by name, and every call the gateway makes into them.

A channel is checked once, when it is added, for what it can do beyond the `Channel`
contract (channels/base.py): show a reply as it grows (`StreamingChannel`), put Allow and
Deny on an approval card (`ApprovalChannel`), send the files a reply names
(`FileChannel`), write to a person's DM by user id (`DirectChannel`), receive on one
gateway of a cluster at a time (`ExclusiveReceiver`), take the platform's webhooks
(`WebhookChannel`). The hub keeps a typed view per capability, so a reply, a stream, a
typing indicator, files, a card and its settling find their channel with one look-up by
name and no probing of attributes at run time.

The message path, approvals, pairing, tasks and the config watcher take the hub (or one of
the small protocols below, which it satisfies); the wiring only builds it, adds the
channels it builds and starts and stops them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from types import MappingProxyType
from typing import Protocol

from channels.base import (
    ApprovalCard,
    ApprovalChannel,
    Channel,
    DirectChannel,
    ExclusiveReceiver,
    FileChannel,
    OutboundFile,
    ReplyRefSink,
    ReplyStream,
    StreamingChannel,
    WebhookChannel,
)
from gateway.cluster.leadership import Leadership
from gateway.cluster.leases import Leases
from gateway.config.holder import ConfigHolder
from gateway.ops.metrics import Metrics
from gateway.types import Inbound

log = logging.getLogger("gateway.hub")

START_TIMEOUT_S = 60.0  # connecting one channel (or its sending side, or its receiving side)
STOP_TIMEOUT_S = 10.0  # stopping one channel at shutdown
TELL_TIMEOUT_S = 15.0  # a DM to a person


# -- what the users of the hub ask of it (each satisfied by ChannelHub) ---------------------


class Replies(Protocol):
    """A reply (Markdown) to where a message came from: the router's and commands' answers."""

    async def deliver(self, inbound: Inbound, text: str) -> None: ...


class ApprovalCards(Protocol):
    """Where an approval's card is shown and, once decided, settled (gateway/approvals.py)."""

    async def show_approval(self, inbound: Inbound, card: ApprovalCard) -> str | None: ...

    async def settle_approval(self, inbound: Inbound, card: ApprovalCard, ref: str | None,
                              outcome: str) -> None: ...


class Reach(Protocol):
    """Whether a channel runs here, so a reply into it can go out from this gateway."""

    def can_deliver(self, channel: str) -> bool: ...


class ChannelHub:
    """The running channels and every outbound call into them (see the module's docstring)."""

    def __init__(self, *, leases: Leases, metrics: Metrics, config: ConfigHolder) -> None:
        self._leases = leases
        self._metrics = metrics
        self._config = config
        self._channels: dict[str, Channel] = {}
        self.channels: Mapping[str, Channel] = MappingProxyType(self._channels)  # read-only view
        # The typed views, filled once per channel by `add`.
        self._streams: dict[str, StreamingChannel] = {}
        self._cards: dict[str, ApprovalChannel] = {}
        self._files: dict[str, FileChannel] = {}
        self._direct: dict[str, DirectChannel] = {}
        self._receivers: dict[str, ExclusiveReceiver] = {}
        self._webhooks: dict[str, WebhookChannel] = {}
        # Channels whose receiving side runs on one gateway of a cluster at a time.
        self.leaderships: dict[str, Leadership] = {}

    # -- the running channels ----------------------------------------------------------

    def add(self, name: str, channel: Channel) -> None:
        """Hold `channel` under `name` (not started yet); what it can do is looked at now."""
        if name in self._channels:
            raise ValueError(f"a channel {name!r} is running already")
        if not isinstance(channel, Channel):
            raise TypeError(f"{type(channel).__name__} is not a Channel (channels/base.py)")
        self._channels[name] = channel
        if isinstance(channel, StreamingChannel):
            self._streams[name] = channel
        if isinstance(channel, ApprovalChannel):
            self._cards[name] = channel
        if isinstance(channel, FileChannel):
            self._files[name] = channel
        if isinstance(channel, DirectChannel):
            self._direct[name] = channel
        if isinstance(channel, ExclusiveReceiver):
            self._receivers[name] = channel
        if isinstance(channel, WebhookChannel):
            self._webhooks[name] = channel

    def _drop(self, name: str) -> None:
        self._streams.pop(name, None)
        self._cards.pop(name, None)
        self._files.pop(name, None)
        self._direct.pop(name, None)
        self._receivers.pop(name, None)
        self._webhooks.pop(name, None)
        self._channels.pop(name, None)

    async def start(self, name: str) -> None:
        """Start one channel: its sending side, and its receiving side where this gateway
        leads; a channel that fails is logged and stays down (/readyz shows it), the others
        are not held up."""
        channel = self._channels[name]
        receiver = self._receivers.get(name)
        try:
            if receiver is not None and receiver.exclusive_receiver:
                # Replies may go out from any gateway; receiving runs where the lead is.
                await asyncio.wait_for(receiver.start_sending(), timeout=START_TIMEOUT_S)
                await self._lead(name, receiver, channel)
            else:
                await asyncio.wait_for(channel.start(), timeout=START_TIMEOUT_S)
        except Exception as err:
            log.error("channel failed to start", extra={"channel": name, "error": str(err)[:300]})

    async def start_all(self) -> None:
        for name in list(self._channels):
            await self.start(name)

    async def _lead(self, name: str, receiver: ExclusiveReceiver, channel: Channel) -> None:
        """Receive for `name` on one gateway of the cluster at a time (SPEC §10); a gateway
        alone leads at once."""
        leases, gauge = self._leases, self._metrics.leader.labels(name)

        async def start() -> None:
            await asyncio.wait_for(receiver.start_receiving(), timeout=START_TIMEOUT_S)
            gauge.set(1)

        async def stop() -> None:
            gauge.set(0)
            # Still held: a shutdown or restart hands over cleanly. Lost: another gateway
            # may receive already.
            await receiver.stop_receiving(lost=not leases.holds(leadership.name))

        leadership = Leadership(leases, name, start=start, stop=stop, healthy=channel.is_ready)
        gauge.set(0)
        self.leaderships[name] = leadership
        await leadership.begin()

    async def stop(self, name: str) -> None:
        """Let go of the lead first (another gateway takes over at once), then stop; the
        channel stays named here (the shutdown's order) until `remove`."""
        leadership = self.leaderships.pop(name, None)
        if leadership is not None:
            await leadership.end()
        await self._channels[name].stop()

    async def stop_all(self) -> None:
        """Stop every channel, each within STOP_TIMEOUT_S; one that does not is logged."""
        for name in list(self._channels):
            try:
                await asyncio.wait_for(self.stop(name), timeout=STOP_TIMEOUT_S)
            except Exception as err:
                log.warning("channel did not stop cleanly", extra={"channel": name, "error": str(err)[:200]})

    async def remove(self, name: str) -> None:
        """Stop the channel `name` (if it runs) and forget it."""
        if name in self._channels:
            await self.stop(name)
            self._drop(name)

    async def replace(self, name: str, channel: Channel | None) -> None:
        """The channel `name` is rebuilt (its settings changed): the old one stops and is
        forgotten, then `channel` (None: none any more) is added and started."""
        await self.remove(name)
        if channel is not None:
            self.add(name, channel)
            await self.start(name)

    def can_deliver(self, channel: str) -> bool:
        return channel in self._channels

    def webhook(self, name: str) -> WebhookChannel | None:
        """The running channel that takes `name`'s webhooks (looked up per request, so a
        channel restarted on reload takes over its route)."""
        return self._webhooks.get(name)

    def readiness(self) -> dict[str, str | None]:
        """Each channel's problem for /readyz (None when it is connected and receiving)."""
        checks: dict[str, str | None] = {}
        for name, channel in list(self._channels.items()):
            key = f"channel:{name}"
            try:
                ok = bool(channel.is_ready())
            except Exception as err:  # a broken check says "not ready", it does not fail the probe
                log.warning("readiness check failed", extra={"channel": name, "error": repr(err)[:300]})
                checks[key] = f"channel {name}: readiness check failed ({type(err).__name__}: {err})"
                continue
            lead = self.leaderships.get(name)
            if ok and lead is not None and lead.failure is not None:
                # Granted the lead and could not receive: when every gateway says so, nobody does.
                checks[key] = f"channel {name}: cannot receive here ({lead.failure})"
                continue
            checks[key] = None if ok else f"channel {name}: not connected or not receiving yet"
        return checks

    def leader_roles(self) -> dict[str, str]:
        """For each channel received on one gateway at a time: whether this one does."""
        return {name: lead.describe() for name, lead in self.leaderships.items()}

    def leader_leases(self) -> dict[str, str]:
        """For each channel received on one gateway at a time: the lease its receiver holds."""
        return {name: lead.name for name, lead in self.leaderships.items()}

    # -- what channels read per use (a reload applies without restarting them) -----------

    def file_limit(self) -> int:
        """`limits.max_inbound_file_mb` now, in bytes (read per file)."""
        return self._config.current.limits.max_inbound_file_bytes

    def stream_interval(self) -> float:
        """`stream_interval_s` now (read per stream update)."""
        return self._config.current.stream_interval_s

    # -- outbound ------------------------------------------------------------------------

    async def deliver(self, inbound: Inbound, text: str) -> None:
        """A whole reply to where `inbound` came from. A person's message whose channel is
        not running here gets nothing (logged); a turn no person waits for (a task's, a
        webhook's) raises, so it is recorded as undelivered rather than answered."""
        channel = self._channels.get(inbound.channel)
        if channel is None:
            log.warning("reply for a channel that is not running", extra={"channel": inbound.channel})
            if inbound.origin is not None:
                raise ConnectionError(f"channel {inbound.channel} is not running")
            return
        await channel.send(inbound, text)

    def stream(self, inbound: Inbound, *, on_ref: ReplyRefSink | None = None,
               resume_ref: str | None = None) -> ReplyStream | None:
        """The channel's stream for the reply to `inbound` (SPEC §5.1), or None: the channel
        cannot stream, streaming is off, or opening one failed; the reply then goes out
        whole through `deliver`."""
        channel = self._streams.get(inbound.channel)
        if channel is None:
            return None
        try:
            return channel.stream(inbound, on_ref=on_ref, resume_ref=resume_ref)
        except Exception:
            log.exception("could not open a reply stream; sending the reply whole",
                          extra={"channel": inbound.channel})
            return None

    def typing(self, inbound: Inbound) -> AbstractAsyncContextManager[None]:
        channel = self._channels.get(inbound.channel)
        if channel is None:
            return nullcontext()
        return channel.typing(inbound)

    def sends_files(self, channel: str) -> bool:
        return channel in self._files

    async def send_files(self, inbound: Inbound, files: Sequence[OutboundFile]) -> None:
        """Files a reply names, through the channel when it can send files (else nothing)."""
        channel = self._files.get(inbound.channel)
        if channel is not None:
            await channel.send_files(inbound, files)

    async def show_approval(self, inbound: Inbound, card: ApprovalCard) -> str | None:
        """The approval card where the turn's message came from: buttons where the channel
        has them, else the card as text answered with /allow or /deny; the card's reference."""
        buttons = self._cards.get(inbound.channel)
        if buttons is not None:
            return await buttons.ask_approval(inbound, card)
        channel = self._channels.get(inbound.channel)
        if channel is not None:
            await channel.send(inbound, card.text())
        return None

    async def settle_approval(self, inbound: Inbound, card: ApprovalCard, ref: str | None, outcome: str) -> None:
        buttons = self._cards.get(inbound.channel)
        if buttons is not None:
            await buttons.settle_approval(inbound, card, ref, outcome)
            return
        channel = self._channels.get(inbound.channel)
        if channel is not None:
            await channel.send(inbound, f"Approval {card.id}: {outcome}")

    async def tell_person(self, identity: str, text: str) -> bool:
        """A DM to one person (`<channel>:<user id>`) through their channel when it runs here and can
        write to a person by id; False when it could not be sent."""
        channel_name, _, user_id = identity.partition(":")
        channel = self._direct.get(channel_name)
        if channel is None or not user_id:
            return False
        try:
            await asyncio.wait_for(channel.send_direct(user_id, text), timeout=TELL_TIMEOUT_S)
        except Exception as err:
            log.warning("could not tell a person", extra={"identity": identity, "error": str(err)[:200]})
            return False
        return True

    async def tell_admins(self, text: str) -> None:
        """Best effort: a DM to each admin whose channel is up here."""
        for admin in self._config.current.admins:
            await self.tell_person(admin, text)
