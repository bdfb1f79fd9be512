"""Nightly consolidation and the scheduler's run records (SPEC §4.6, §7), with a fake
OpenAI-compatible model server and a controllable clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from apscheduler.triggers.cron import CronTrigger
from pydantic import SecretStr

from gateway.config.schema import Config, ModelConfig
from gateway.jobs.scheduler import (
    JOB_CONSOLIDATION,
    JOB_PURGE,
    MISFIRE_GRACE_S,
    Scheduler,
    cron_trigger,
    last_fire_time,
)
from gateway.memory.consolidate import NoteDelta, take_within_budget
from gateway.memory.files import Memory, NoteFile
from gateway.model.client import ModelClient
from gateway.store.sqlite import Store
from tests.conftest import Clock
from tests.fakes.openai_server import ErrorReply, FakeModel, last_user_text

ALICE = "telegram:user:1"
BOB = "telegram:user:2"


@pytest.fixture
def clock() -> Clock:
    return Clock(datetime(2026, 11, 27, 12, 0, tzinfo=UTC))


@pytest.fixture
def memory(tmp_path: Path, store: Store, clock: Clock) -> Memory:
    return Memory(tmp_path / "data", tz=UTC, store=store, clock=clock)


@pytest.fixture
async def fake() -> AsyncIterator[FakeModel]:
    async with FakeModel() as server:
        yield server


@pytest.fixture
async def model(fake: FakeModel) -> AsyncIterator[ModelClient]:
    client = ModelClient(ModelConfig(name="fake", base_url=fake.base_url, api_key=SecretStr("k"),
                                     max_retries=0))
    yield client
    await client.close()


def make_scheduler(store: Store, memory: Memory, model: ModelClient, clock: Clock,
                   seen: list[tuple[str, str]] | None = None) -> Scheduler:
    cfg = Config(timezone="UTC", memory_consolidation_cron="0 0 * * *")
    return Scheduler(cfg, store=store, memory=memory, model=model, live_references=set, clock=clock,
                     metrics=(lambda job, outcome: seen.append((job, outcome))) if seen is not None else None)


def memory_md(memory: Memory, scope: str) -> Path:
    return memory.workspace(scope) / "MEMORY.md"


def backups(memory: Memory, scope: str) -> list[Path]:
    return sorted((memory.workspace(scope) / "memory" / "backup").glob("MEMORY-*.md"))


async def test_two_days_of_notes_are_merged_with_a_backup_and_a_second_run_is_a_no_op(
    store: Store, memory: Memory, model: ModelClient, fake: FakeModel, clock: Clock
) -> None:
    await memory.append_memory_md(ALICE, "- Alice lives in Porto")
    await memory.append_daily(ALICE, "Alice adopted a cat named Miso.")
    clock.now = datetime(2026, 11, 28, 15, 0, tzinfo=UTC)
    await memory.append_daily(ALICE, "Alice prefers answers in Portuguese.")
    fake.reply("# Alice\n- lives in Porto\n- cat: Miso\n- prefers Portuguese")
    seen: list[tuple[str, str]] = []
    sched = make_scheduler(store, memory, model, clock, seen)

    clock.now = datetime(2026, 11, 29, 0, 0, 5, tzinfo=UTC)
    assert await sched.run_consolidation("2026-11-29T00:00:00+00:00") == {ALICE: "merged 2 notes"}
    (request,) = await fake.wait_requests(1)
    prompt = last_user_text(request)
    assert "Alice lives in Porto" in prompt
    assert "memory/2026-11-27.md" in prompt and "cat named Miso" in prompt
    assert "memory/2026-11-28.md" in prompt and "Portuguese" in prompt
    merged = "# Alice\n- lives in Porto\n- cat: Miso\n- prefers Portuguese\n"
    assert memory_md(memory, ALICE).read_text() == merged
    (backup,) = backups(memory, ALICE)
    assert backup.read_text() == "- Alice lives in Porto\n"
    assert seen == [(JOB_CONSOLIDATION, "ok")]

    # Nothing new: nothing changes and the model is not called.
    before = memory_md(memory, ALICE).stat().st_mtime_ns
    assert await sched.run_consolidation("2026-11-30T00:00:00+00:00") == {ALICE: "no new notes"}
    assert len(fake.requests) == 1
    assert memory_md(memory, ALICE).stat().st_mtime_ns == before
    assert len(backups(memory, ALICE)) == 1
    # The same slot never runs twice.
    assert await sched.run_consolidation("2026-11-30T00:00:00+00:00") == {}

    # A note that grew is merged from where the last run stopped.
    await memory.append_daily(ALICE, "Alice's cat Miso is allergic to fish.")
    fake.reply("# Alice\n- cat Miso, allergic to fish")
    assert await sched.run_consolidation("2026-12-01T00:00:00+00:00") == {ALICE: "merged 1 note"}
    second = last_user_text(fake.requests[1])
    assert "allergic to fish" in second and "Portuguese" not in second.split("<notes>")[1]


async def test_a_failing_scope_keeps_its_memory_and_is_retried_without_blocking_others(
    store: Store, memory: Memory, model: ModelClient, fake: FakeModel, clock: Clock
) -> None:
    await memory.append_memory_md(ALICE, "- Alice: original memory")
    await memory.append_daily(ALICE, "alice-note: likes jazz")
    await memory.append_daily(BOB, "bob-note: likes chess")
    broken = True

    def answer(body: dict[str, Any]) -> Any:
        if "alice-note" in last_user_text(body) and broken:
            return ErrorReply(500, {"error": {"message": "upstream exploded", "type": "server_error"}})
        return "merged memory"

    fake.respond_with(answer)
    seen: list[tuple[str, str]] = []
    sched = make_scheduler(store, memory, model, clock, seen)
    outcomes = await sched.run_consolidation("2026-11-28T00:00:00+00:00")
    assert outcomes[BOB] == "merged 1 note"
    assert outcomes[ALICE].startswith("failed:")
    assert memory_md(memory, ALICE).read_text() == "- Alice: original memory\n"
    assert backups(memory, ALICE) == []
    assert memory_md(memory, BOB).read_text() == "merged memory\n"
    (run,) = await store.job_runs(JOB_CONSOLIDATION)
    assert run.outcome == "partial" and "upstream exploded" in (run.detail or "")
    assert seen == [(JOB_CONSOLIDATION, "partial")]

    broken = False
    outcomes = await sched.run_consolidation("2026-11-29T00:00:00+00:00")
    assert outcomes == {ALICE: "merged 1 note", BOB: "no new notes"}
    assert memory_md(memory, ALICE).read_text() == "merged memory\n"


async def test_an_empty_model_answer_never_wipes_memory(
    store: Store, memory: Memory, model: ModelClient, fake: FakeModel, clock: Clock
) -> None:
    await memory.append_memory_md(ALICE, "- keep me")
    await memory.append_daily(ALICE, "new fact")
    fake.reply("   ")
    sched = make_scheduler(store, memory, model, clock)
    outcomes = await sched.run_consolidation("2026-11-28T00:00:00+00:00")
    assert outcomes[ALICE].startswith("failed: ConsolidationError")
    assert memory_md(memory, ALICE).read_text() == "- keep me\n"


async def test_memory_written_during_the_model_call_is_carried_over(
    store: Store, memory: Memory, model: ModelClient, fake: FakeModel, clock: Clock
) -> None:
    await memory.append_memory_md(ALICE, "- old")
    await memory.append_daily(ALICE, "note")

    async def answer(body: dict[str, Any]) -> str:
        await memory.append_memory_md(ALICE, "- written by the agent meanwhile")
        return "- merged"

    fake.respond_with(answer)
    sched = make_scheduler(store, memory, model, clock)
    assert await sched.run_consolidation("2026-11-28T00:00:00+00:00") == {ALICE: "merged 1 note"}
    assert memory_md(memory, ALICE).read_text() == "- merged\n\n- written by the agent meanwhile\n"


async def test_a_missed_midnight_is_caught_up_exactly_once_after_a_restart(
    store: Store, memory: Memory, model: ModelClient, fake: FakeModel, clock: Clock
) -> None:
    fake.default = "# consolidated"
    clock.now = datetime(2026, 11, 27, 23, 0, tzinfo=UTC)
    first = make_scheduler(store, memory, model, clock)
    await first.start()
    assert await first.wait_idle(5)
    await memory.append_daily(ALICE, "written before the outage")
    await first.stop()
    assert len(fake.requests) == 0  # the 27th's slot was caught up: no notes then

    clock.now = datetime(2026, 11, 28, 8, 30, tzinfo=UTC)  # down over midnight
    second = make_scheduler(store, memory, model, clock)
    await second.start()
    assert await second.wait_idle(5)
    await second.stop()
    assert len(fake.requests) == 1
    assert memory_md(memory, ALICE).read_text() == "# consolidated\n"
    slots = [r.slot for r in await store.job_runs(JOB_CONSOLIDATION)]
    assert slots.count("2026-11-28T00:00:00+00:00") == 1

    await memory.append_daily(ALICE, "another note, same morning")
    third = make_scheduler(store, memory, model, clock)
    await third.start()
    assert await third.wait_idle(5)
    await third.stop()
    assert len(fake.requests) == 1  # that slot ran already: not repeated
    assert len(await store.job_runs(JOB_PURGE)) == 3  # one purge per start


async def test_a_run_interrupted_by_a_crash_is_run_again_at_start(
    store: Store, memory: Memory, model: ModelClient, fake: FakeModel, clock: Clock
) -> None:
    fake.default = "- merged"
    await memory.append_daily(ALICE, "a note")
    clock.now = datetime(2026, 11, 28, 1, 0, tzinfo=UTC)
    assert await store.start_job_run(JOB_CONSOLIDATION, "2026-11-28T00:00:00+00:00")  # then the crash
    sched = make_scheduler(store, memory, model, clock)
    await sched.start()
    assert await sched.wait_idle(5)
    await sched.stop()
    run = await store.job_run(JOB_CONSOLIDATION, "2026-11-28T00:00:00+00:00")
    assert run is not None and run.outcome == "ok" and run.ended_at is not None
    assert memory_md(memory, ALICE).read_text() == "- merged\n"


async def test_the_scheduled_job_is_registered_and_stop_is_clean(
    store: Store, memory: Memory, model: ModelClient, clock: Clock
) -> None:
    clock.now = datetime(2026, 11, 28, 8, 30, tzinfo=UTC)
    sched = make_scheduler(store, memory, model, clock)
    assert sched.next_consolidation() == datetime(2026, 11, 29, 0, 0, tzinfo=UTC)
    await sched.start()
    aps = sched._aps  # the real APScheduler instance: what it holds is what will fire
    assert aps is not None and aps.running
    jobs = {job.id: job for job in aps.get_jobs()}
    assert set(jobs) == {JOB_CONSOLIDATION, JOB_PURGE}
    now = datetime.now(UTC)  # APScheduler plans with the real clock
    for job_id, (hour, minute) in {JOB_CONSOLIDATION: (0, 0), JOB_PURGE: (3, 30)}.items():
        job = jobs[job_id]
        assert isinstance(job.trigger, CronTrigger) and str(job.trigger.timezone) == "UTC"
        fields = {f.name: str(f) for f in job.trigger.fields}
        assert (fields["hour"], fields["minute"]) == (str(hour), str(minute))
        nxt = job.next_run_time
        assert now < nxt <= now + timedelta(days=1) and (nxt.hour, nxt.minute, nxt.second) == (hour, minute, 0)
        assert job.misfire_grace_time == MISFIRE_GRACE_S and job.coalesce and job.max_instances == 1

    # A reloaded cron reschedules the same job in APScheduler.
    sched.update_config(Config(timezone="UTC", memory_consolidation_cron="15 4 * * 1"))
    job = aps.get_job(JOB_CONSOLIDATION)
    assert job is not None and (job.next_run_time.strftime("%a %H:%M")) == "Mon 04:15"
    assert job.next_run_time <= now + timedelta(days=7)

    await sched.stop()  # cancels the startup work if it is still running
    await asyncio.sleep(0)
    assert not aps.running and sched._aps is None
    await sched.stop()


def test_crontab_weekdays_keep_their_crontab_meaning() -> None:
    sunday = cron_trigger("0 3 * * 0", UTC)
    fire = sunday.get_next_fire_time(None, datetime(2026, 11, 25, tzinfo=UTC))  # a Wednesday
    assert fire == datetime(2026, 11, 29, 3, 0, tzinfo=UTC) and fire.strftime("%a") == "Sun"
    weekdays = cron_trigger("30 8 * * 1-5", UTC)
    fire = weekdays.get_next_fire_time(None, datetime(2026, 11, 28, tzinfo=UTC))  # a Saturday
    assert fire is not None and fire.strftime("%a %H:%M") == "Mon 08:30"
    assert cron_trigger("@daily", UTC).get_next_fire_time(None, datetime(2026, 1, 1, 5, tzinfo=UTC)) == \
        datetime(2026, 1, 2, tzinfo=UTC)
    with pytest.raises(ValueError):
        cron_trigger("0 0 * *", UTC)


def test_last_fire_time_is_the_latest_slot_not_after_now() -> None:
    daily = cron_trigger("0 0 * * *", UTC)
    midnight = datetime(2026, 11, 28, tzinfo=UTC)
    assert last_fire_time(daily, datetime(2026, 11, 28, 8, 30, tzinfo=UTC)) == midnight
    assert last_fire_time(daily, midnight) == midnight
    every_minute = cron_trigger("* * * * *", UTC)
    assert last_fire_time(every_minute, datetime(2026, 11, 28, 8, 30, 59, tzinfo=UTC)) == \
        datetime(2026, 11, 28, 8, 30, tzinfo=UTC)
    yearly = cron_trigger("0 0 1 1 *", UTC)
    assert last_fire_time(yearly, datetime(2026, 11, 28, tzinfo=UTC)) == datetime(2026, 1, 1, tzinfo=UTC)


def test_a_large_backlog_is_taken_oldest_first_and_cut_on_a_line() -> None:
    def delta(name: str, text: str, start: int = 0) -> NoteDelta:
        return NoteDelta(NoteFile(f"memory/{name}.md", len(text), 1), text, start, len(text))

    first = delta("2026-11-01", "aaaa\nbbbb\n")
    second = delta("2026-11-02", "cccc\ndddd\neeee\n")
    taken = take_within_budget([first, second], 17)
    assert [d.new_text for d in taken] == ["aaaa\nbbbb\n", "cccc\n"]
    assert taken[1].watermark().size == -1  # read again next time
    assert taken[0].watermark().size == len(first.text)
