"""Approvals (SPEC §5.7): a tool listed as `ask` in `approvals.tools` waits, before each
call, for a yes from an approver.

The card shows the tool and its whole arguments where the turn's message came from (Allow
and Deny buttons on channels that have them, the card as text with `/allow ID` and `/deny
ID` elsewhere). Approvers are the admins or, with `participants`, anyone whose messages
go into the session. Anyone else's answer is refused and changes nothing. Each approval is
decided once, in the database (a second click finds it decided); the buttons are disabled
then. No answer within `approvals.timeout_s` is a deny; a stopped turn ends its wait; a
restart while waiting turns the wait into a deny, and the card says so, never a silent yes.
On a database several gateways share, a click that reaches another gateway is recorded
there and the waiting gateway reads it within POLL_S.
"""

from __future__ import annotations

import asyncio
import errno
import fnmatch
import functools
import json
import logging
import os
import posixpath
import secrets
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from channels.base import ApprovalCard, CardFile, visible
from gateway import beneath
from gateway.access import is_admin
from gateway.beneath import PathNotAllowed
from gateway.config.schema import Config
from gateway.hub import ApprovalCards
from gateway.keys import delegating_session, session_key
from gateway.store.api import StoreBackend
from gateway.types import Inbound, inbound_from_dict, inbound_to_dict

log = logging.getLogger("gateway.approvals")

ID_ALPHABET = "23456789abcdefghjkmnpqrstuvwxyz"  # no look-alikes: people type it after /allow
ID_LENGTH = 6
POLL_S = 1.0  # a shared database: how often a waiting turn looks for a decision made elsewhere
SHOW_TIMEOUT_S = 30.0  # showing or settling a card; the wait itself is approvals.timeout_s
# The workspace files a card shows (SPEC §5.7): how many, and what is short enough to show.
CARD_FILES = 8
FILE_SHOWN_CHARS = 1500  # as shown (escaped); fits one Discord message with its heading
FILE_SHOWN_LINES = 40
GLOB_MATCHES = 16  # a glob in a command's word: the matches looked at
INLINE_CARD_CHARS = 10_000  # longer arguments are made visible in a worker thread
NAME_CHARS = 512  # a longer name is no file a card names (the command itself shows it whole)

# How a wait ended, as stored: a person's allow or deny, or the gateway's deny.
ALLOW, DENY, TIMEOUT, RESTART, STOPPED = "allow", "deny", "timeout", "restart", "stopped"

@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    note: str  # for the tool's result when denied ("denied by telegram:1"), and the card


@dataclass(slots=True)
class _Waiting:
    card: ApprovalCard
    session: str
    inbound: Inbound
    decided: asyncio.Future[tuple[str, str | None]]
    ref: str | None = None


def pretty_arguments(arguments: str) -> str:
    """The arguments as a person reads them: a lone command as it will run, else
    indented JSON; never shortened (the card then shows every character: `visible`)."""
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return arguments
    if isinstance(parsed, dict) and set(parsed) == {"command"} and isinstance(parsed["command"], str):
        return parsed["command"]
    return json.dumps(parsed, indent=2, ensure_ascii=False)


def card_files(root: Path, names: Sequence[str]) -> tuple[CardFile, ...]:
    """The workspace files among `names` (candidates a tool found in its arguments), read
    beneath `root` without following a symlink, each shown when short text (blocking: run
    it in a thread). Names that are no file (a program, an option) are left out."""
    files: list[CardFile] = []
    seen: set[str] = set()
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return ()  # no workspace yet: nothing in it to name
    try:
        for name in _expanded(root_fd, names):
            if len(files) >= CARD_FILES:
                break
            if name not in seen and len(name) <= NAME_CHARS:
                seen.add(name)
                found = _card_file(root_fd, name)
                if found is not None:
                    files.append(found)
    finally:
        os.close(root_fd)
    return tuple(files)


def _expanded(root_fd: int, names: Sequence[str]) -> list[str]:
    """The names, a glob in a name's last part (`memory/*.md`) replaced by its matches."""
    out: list[str] = []
    for name in names:
        folder, last = posixpath.split(name)
        if not any(ch in last for ch in "*?["):
            out.append(name)
            continue
        try:
            fd = _open_beneath(root_fd, folder, directory=True) if folder else os.dup(root_fd)
        except OSError:
            continue
        try:
            matches = sorted(entry for entry in os.listdir(fd) if fnmatch.fnmatchcase(entry, last)
                             and not (entry.startswith(".") and not last.startswith(".")))
        except OSError:
            matches = []
        finally:
            os.close(fd)
        out.extend(posixpath.join(folder, entry) for entry in matches[:GLOB_MATCHES])
    return out


def _open_beneath(root_fd: int, relative: str, *, directory: bool = False) -> int:
    """`relative` opened beneath `root_fd` through gateway/beneath.py (never through a link,
    never above the root). A link on the way is ELOOP here: the card names it."""
    try:
        parts = beneath.split(relative)
    except PathNotAllowed:
        raise OSError(errno.EACCES, "not beneath the workspace") from None
    if not parts:
        raise OSError(errno.EACCES, "not beneath the workspace")
    # O_NONBLOCK: opening a FIFO planted under the name never waits for a writer.
    flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_DIRECTORY if directory else 0)
    try:
        return beneath.Dir(root_fd).open_fd(relative, flags)  # borrows root_fd: not closed here
    except PathNotAllowed:
        raise OSError(errno.ELOOP, "a symbolic link on the way") from None


def _card_file(root_fd: int, name: str) -> CardFile | None:
    try:
        fd = _open_beneath(root_fd, name)
    except OSError as err:
        if err.errno == errno.ELOOP:  # a symlink: the shell would follow it, the card says where
            return _link(root_fd, name)
        return None  # no such file (a program's name, an option): not a file the command names
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            return None
        if not stat.S_ISREG(info.st_mode):
            return CardFile(name, 0, note="not a regular file")
        if info.st_size > FILE_SHOWN_CHARS * 4:
            return CardFile(name, info.st_size, note="too long to show")
        data = os.read(fd, FILE_SHOWN_CHARS * 4 + 1)
    except OSError:
        return CardFile(name, 0, note="could not be read")
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return CardFile(name, len(data), note="not text")
    if "\x00" in text:
        return CardFile(name, len(data), note="not text")
    shown = visible(text)
    lines = shown.count("\n") + (not shown.endswith("\n"))
    if len(shown) > FILE_SHOWN_CHARS or lines > FILE_SHOWN_LINES:
        return CardFile(name, len(data), note="too long to show")
    return CardFile(name, len(data), text=shown)


def _link(root_fd: int, name: str) -> CardFile | None:
    folder, last = posixpath.split(name)
    try:
        fd = _open_beneath(root_fd, folder, directory=True) if folder else os.dup(root_fd)
    except OSError:
        return None  # a symlink on the way: the name leads out of what the card follows
    try:
        target = os.readlink(last, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    return CardFile(name, 0, note=f"a symbolic link to {target[:200]}, not followed here")


def outcome_text(decision: str, by: str | None, timeout_s: float) -> str:
    match decision:
        case "allow":
            return f"Allowed by {by}."
        case "deny":
            return f"Denied by {by}."
        case "timeout":
            return f"Denied: nobody answered within {timeout_s:g} s."
        case "restart":
            return "Denied: the gateway restarted while this waited for an answer (nothing was run)."
        case _:
            return "Denied: the turn was stopped."


class Approvals:
    def __init__(self, store: StoreBackend, *, config: Callable[[], Config], cards: ApprovalCards) -> None:
        self.store = store
        self.config = config
        self.cards = cards  # where cards are shown and settled: the channel hub
        self.shared = bool(getattr(store, "shared", False))
        self._waiting: dict[str, _Waiting] = {}
        self.closing = False  # set by a shutdown: a wait it cuts is a restart's deny, not a stop

    def needed(self, cfg: Config, tool: str) -> bool:
        return cfg.approvals.tools.get(tool) == "ask"

    async def start(self) -> None:
        """Waits cut by a restart are denies, and their cards say so (channels are up)."""
        if self.shared:
            return  # another gateway may be waiting on them; their own timeout ends them
        rows = await self.store.run(
            "UPDATE approvals SET decision=?, decided_by='gateway', decided_at=? WHERE decision IS NULL "
            "RETURNING id, tool, arguments, inbound, ref", (RESTART, time.time()))
        cfg = self.config()
        for row in rows:
            card = ApprovalCard(id=row["id"], tool=row["tool"], arguments=row["arguments"], who="",
                                timeout_s=cfg.approvals.timeout_s)
            try:
                inbound = inbound_from_dict(json.loads(row["inbound"] or "{}"))
                async with asyncio.timeout(SHOW_TIMEOUT_S):
                    await self.cards.settle_approval(inbound, card, row["ref"], outcome_text(RESTART, None, 0))
            except Exception as err:  # a card that cannot be updated stays as it was
                log.warning("could not update the card of an approval cut by a restart",
                            extra={"approval": row["id"], "error": str(err)[:200]})
            log.warning("approval denied: the gateway restarted while it waited", extra={"approval": row["id"]})

    async def ask(self, *, session: str, turn: int, inbound: Inbound, tool: str, arguments: str,
                  workspace: Path | None = None, names: Sequence[str] = ()) -> Verdict:
        """Show the card and wait for the answer (at most `approvals.timeout_s`). `names`:
        paths the arguments name (the tool's `files_named`), shown when they are files in
        `workspace`."""
        cfg = self.config()
        timeout_s = cfg.approvals.timeout_s
        who = "an admin" if cfg.approvals.approvers == "admins" else "anyone in this conversation"
        files: tuple[CardFile, ...] = ()
        if workspace is not None and names:
            try:
                files = await asyncio.to_thread(card_files, workspace, names)
            except Exception as err:  # the card still shows the command whole; it says nothing of files then
                log.warning("could not look at the files a call names", extra={"error": str(err)[:200]})
        make = functools.partial(ApprovalCard, id=await self._new_id(), tool=tool,
                                 arguments=pretty_arguments(arguments), who=who, timeout_s=timeout_s, files=files)
        # Making every character visible takes a while for long arguments: off the loop then.
        card = await asyncio.to_thread(make) if len(arguments) > INLINE_CARD_CHARS else make()
        now = time.time()
        await self.store.run(
            "INSERT INTO approvals(id, session_key, turn, tool, arguments, asked_by, asked_at, expires_at, inbound) "
            "VALUES (?,?,?,?,?,?,?,?,?)",
            (card.id, session, turn, tool, card.arguments, inbound.identity, now, now + timeout_s,
             json.dumps(inbound_to_dict(inbound), ensure_ascii=False)))
        waiting = _Waiting(card, session, inbound, asyncio.get_running_loop().create_future())
        self._waiting[card.id] = waiting
        log.info("approval asked", extra={"approval": card.id, "session": session, "tool": tool})
        decision: str = TIMEOUT
        by: str | None = None
        try:
            try:
                async with asyncio.timeout(SHOW_TIMEOUT_S):
                    waiting.ref = await self.cards.show_approval(inbound, card)
            except Exception as err:  # /allow and /deny still answer it; the timeout still ends it
                log.warning("could not show an approval card", extra={"approval": card.id, "error": str(err)[:200]})
            if waiting.ref is not None:
                await self.store.run("UPDATE approvals SET ref=? WHERE id=?", (waiting.ref, card.id))
            decision, by = await self._wait(waiting, now + timeout_s)
        except asyncio.CancelledError:
            decision = RESTART if self.closing else STOPPED
            raise
        finally:
            self._waiting.pop(card.id, None)
            if decision in (TIMEOUT, STOPPED, RESTART):
                # Recorded unless a person's answer got there first (then that answer stands).
                rows = await asyncio.shield(self._record(card.id, decision, None))
                if not rows:
                    decision, by = await self._stored(card.id)
            text = outcome_text(decision, by, timeout_s)
            await asyncio.shield(self._settle(waiting, text))
            log.info("approval decided", extra={"approval": card.id, "session": session, "tool": tool,
                                                "decision": decision, "by": by})
        return Verdict(decision == ALLOW, text)

    async def _wait(self, waiting: _Waiting, deadline: float) -> tuple[str, str | None]:
        while True:
            left = deadline - time.time()
            if left <= 0:
                return TIMEOUT, None
            try:
                return await asyncio.wait_for(asyncio.shield(waiting.decided), min(left, POLL_S) if self.shared
                                              else left)
            except TimeoutError:
                if self.shared:  # decided through another gateway?
                    decision, by = await self._stored(waiting.card.id)
                    if decision is not None:
                        return decision, by

    async def _stored(self, approval_id: str) -> tuple[Any, Any]:
        rows = await self.store.run("SELECT decision, decided_by FROM approvals WHERE id=?", (approval_id,))
        return (rows[0]["decision"], rows[0]["decided_by"]) if rows else (None, None)

    async def _record(self, approval_id: str, decision: str, by: str | None) -> list[Any]:
        return await self.store.run(
            "UPDATE approvals SET decision=?, decided_by=?, decided_at=? WHERE id=? AND decision IS NULL "
            "RETURNING id", (decision, by, time.time(), approval_id))

    async def _settle(self, waiting: _Waiting, text: str) -> None:
        try:
            async with asyncio.timeout(SHOW_TIMEOUT_S):
                await self.cards.settle_approval(waiting.inbound, waiting.card, waiting.ref, visible(text))
        except Exception as err:
            log.warning("could not update an approval card", extra={"approval": waiting.card.id,
                                                                   "error": str(err)[:200]})

    async def _new_id(self) -> str:
        for _ in range(10):
            candidate = "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH))
            if not await self.store.run("SELECT 1 FROM approvals WHERE id=?", (candidate,)):
                return candidate
        raise RuntimeError("no free approval id")

    def may_answer(self, cfg: Config, session: str, who: Inbound) -> bool:
        """Admins always; with `participants`, anyone whose messages go into the session
        (for a sub-turn's call: the session that delegated it, SPEC §5.7)."""
        if is_admin(cfg, who.identity):
            return True
        return cfg.approvals.approvers == "participants" and \
            session_key(who, cfg.group_session_scope) == delegating_session(session)

    async def decide(self, approval_id: str, who: Inbound, allow: bool) -> str:
        """A person's answer (a button, /allow, /deny): a short notice for them."""
        cfg = self.config()
        wanted = approval_id.strip().strip("`'\"").lower()
        rows = await self.store.run("SELECT session_key, decision, decided_by FROM approvals WHERE id=?", (wanted,))
        if not rows:
            return f"There is no approval {wanted!r}."
        session, decided, decided_by = rows[0]["session_key"], rows[0]["decision"], rows[0]["decided_by"]
        if not self.may_answer(cfg, session, who):
            log.warning("approval answer refused: not an approver",
                        extra={"approval": wanted, "who": who.identity})
            return ("Only an admin can answer this." if cfg.approvals.approvers == "admins"
                    else "Only someone in that conversation or an admin can answer this.")
        timeout_s = cfg.approvals.timeout_s
        if decided is not None:
            return f"Approval {wanted} was decided already: {outcome_text(decided, decided_by, timeout_s)}"
        decision = ALLOW if allow else DENY
        if not await self._record(wanted, decision, who.identity):
            decided, decided_by = await self._stored(wanted)
            return f"Approval {wanted} was decided already: {outcome_text(decided, decided_by, timeout_s)}"
        waiting = self._waiting.get(wanted)
        if waiting is not None and not waiting.decided.done():
            waiting.decided.set_result((decision, who.identity))
        return "Allowed." if allow else "Denied."
