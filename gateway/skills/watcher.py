"""Skills follow their folders (SPEC §5.6): adding, editing or removing a skill applies
from the next request, without a restart. The folders are watched with watchfiles (as
config.json is, gateway/config/reload.py), a change is scanned again until two scans
agree (an editor's save in progress is not judged), and the result replaces the skills
the agent sees. Each problem is logged once, when it appears."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import watchfiles

from gateway.skills.catalog import MAX_SKILLS, Problem, Scan, Skills, scan

log = logging.getLogger("gateway.skills")

SETTLE_S = 0.3  # scans this far apart must agree before a change is taken
SETTLE_ROUNDS = 5
LOOK_AGAIN_S = 2.0  # how often a folder that is missing (or gone) is looked for
DEBOUNCE_MS = 200


class SkillWatcher:
    """The skills of `dirs` as they are now (`skills()`), kept up to date while started."""

    def __init__(self, dirs: Sequence[Path], *, max_skills: int = MAX_SKILLS) -> None:
        self.dirs = tuple(dirs)
        self.max_skills = max_skills
        self.version = 0  # bumps each time the skills change (tests wait on it)
        self._scan = Scan()
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def skills(self) -> Skills:
        return self._scan.skills

    @property
    def problems(self) -> tuple[Problem, ...]:
        return self._scan.problems

    async def load(self) -> None:
        """The first scan (before the first turn). It never stops the start: a scan that
        fails leaves no skills until the watcher's next one (a bad SKILL.md alone is a
        Problem of its own, skipped)."""
        try:
            await self.rescan(settle=False)
        except Exception:
            log.exception("scanning the skills folders failed; starting without skills")

    async def start(self) -> None:
        self._stop.clear()
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="skills-watcher")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def set_dirs(self, dirs: Sequence[Path]) -> None:
        """`skills.dirs` changed: scan the new folders and watch them instead."""
        running = self._task is not None
        if running:
            await self.stop()
        self.dirs = tuple(dirs)
        await self.rescan(settle=False)
        if running:
            await self.start()

    async def rescan(self, *, settle: bool = True) -> bool:
        """Scan the folders; True when the skills changed."""
        async with self._lock:
            found = await asyncio.to_thread(scan, self.dirs, max_skills=self.max_skills)
            for _ in range(SETTLE_ROUNDS if settle else 0):
                await asyncio.sleep(SETTLE_S)
                again = await asyncio.to_thread(scan, self.dirs, max_skills=self.max_skills)
                if again == found:
                    break
                found = again
            return self._publish(found)

    def _publish(self, found: Scan) -> bool:
        old, self._scan = self._scan, found
        for problem in found.problems:
            if problem not in old.problems:
                log.warning("skill skipped: %s: %s", problem.file, problem.reason,
                            extra={"file": str(problem.file), "reason": problem.reason})
        if found.skills == old.skills:
            return False
        self.version += 1
        before = {skill.name: skill for skill in old.skills}
        after = {skill.name: skill for skill in found.skills}
        added = sorted(after.keys() - before.keys())
        removed = sorted(before.keys() - after.keys())
        changed = sorted(name for name in after.keys() & before.keys() if after[name] != before[name])
        log.info("skills: %d (%s)", len(found.skills), ", ".join(found.skills.names) or "none",
                 extra={"added": added, "removed": removed, "changed": changed})
        return True

    async def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                await self._watch_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                # A folder that vanished under the watcher, a lost inotify watch: look again.
                log.exception("watching the skills folders failed; looking again shortly")
                await self._pause(LOOK_AGAIN_S)

    async def _watch_once(self) -> None:
        """Watch the folders that exist until one appears or goes; rescan on each change."""
        present = await asyncio.to_thread(_existing, self.dirs)
        if not present:
            await self._pause(LOOK_AGAIN_S)
            return
        first = True
        async for changes in watchfiles.awatch(*present, debounce=DEBOUNCE_MS, stop_event=self._stop,
                                                rust_timeout=int(LOOK_AGAIN_S * 1000), yield_on_timeout=True):
            now = await asyncio.to_thread(_existing, self.dirs)
            # The first yield (a change, or the timeout) means the watch is up: a scan now
            # catches what changed before it was (since the last scan, or the folder's making).
            if changes or now != present or first:
                await self.rescan()
            first = False
            if now != present:
                return  # watch the folders as they are now

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        except TimeoutError:
            pass


def _existing(dirs: Sequence[Path]) -> tuple[Path, ...]:
    return tuple(path for path in dirs if os.path.isdir(path))

