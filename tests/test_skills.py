"""Skills (SPEC §5.6): SKILL.md folders found and checked, listed in the system prompt,
read with read_file under skills/ (read-only, never out of a skill's folder), shown by
/skills, and followed live as their folders change."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import gateway.skills.watcher
from gateway.app import Gateway
from gateway.config.schema import Config
from gateway.skills.catalog import (
    MAX_FRONT_MATTER_BYTES,
    MAX_SKILL_BYTES,
    SkillError,
    Skills,
    allowed_skills,
    parse_skill_md,
    prompt_section,
    scan,
)
from gateway.tools.base import ToolContext, ToolError
from gateway.tools.read_file import ReadFile
from tests.conftest import GatewayFactory, chat
from tests.fakes.openai_server import FakeModel

ALPHA_BODY = "# Alpha\nALPHA-BODY-MARKER: step one, then step two.\n"
BETA_BODY = "# Beta\nBETA-BODY-MARKER\n"


def skill_md(name: str, description: str | None, body: str = "# Instructions\n", extra: str = "") -> str:
    lines = ["---", f"name: {name}"]
    if description is not None:
        lines.append(f"description: {json.dumps(description)}")  # JSON strings are YAML strings
    return "\n".join(lines) + ("\n" + extra if extra else "") + "\n---\n" + body


def make_skill(root: Path, folder: str, text: str | bytes) -> Path:
    path = root / folder / "SKILL.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def why(data: str | bytes, folder: str = "demo") -> str:
    """The reason a SKILL.md is refused."""
    with pytest.raises(SkillError) as err:
        parse_skill_md(data.encode() if isinstance(data, str) else data, folder)
    return str(err.value)


async def until(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


# -- one SKILL.md ---------------------------------------------------------------------------


def test_a_skill_is_its_name_and_a_one_line_description() -> None:
    text = ("\ufeff---\r\nname: demo\r\ndescription: >\r\n  Does the demo\r\n  thing.\r\nlicense: MIT\r\n"
            "metadata:\r\n  version: '1.0'\r\nallowed-tools: read_file\r\n---\r\n# Body\r\n---\r\nmore\r\n")
    assert parse_skill_md(text.encode(), "demo") == ("demo", "Does the demo thing.")


@pytest.mark.parametrize(("text", "reason"), [
    ("# no front matter\nname: demo\n", "no front matter"),
    ("---\nname: demo\ndescription: x\n", "not closed"),
    ("---\n" + "x: y\n" * (MAX_FRONT_MATTER_BYTES // 5 + 1) + "---\n", "within 16 KB"),
    ("---\nname: demo\ndescription: [unclosed\n---\n", "not valid YAML"),
    ("---\nname: demo\n  description: bad indent\n---\n", "not valid YAML"),
    ("---\n- name\n- description\n---\n", "not a mapping"),
    ("---\n---\n", "not a mapping"),
    ("---\ndescription: x\n---\n", "no name"),
    ("---\nname: yes\ndescription: x\n---\n", "name must be text, not true/false"),
    ("---\nname: Demo\ndescription: x\n---\n", "lowercase letters"),
    ("---\nname: -demo\ndescription: x\n---\n", "lowercase letters"),
    ("---\nname: de--mo\ndescription: x\n---\n", "lowercase letters"),
    ("---\nname: demo_x\ndescription: x\n---\n", "lowercase letters"),
    ("---\nname: " + "a" * 65 + "\ndescription: x\n---\n", "1-64"),
    ("---\nname: other\ndescription: x\n---\n", "does not match its folder"),
    ("---\nname: demo\n---\n", "no description"),
    ("---\nname: demo\ndescription: '  '\n---\n", "description is empty"),
    ("---\nname: demo\ndescription: [a, b]\n---\n", "description must be text, not a list"),
    ("---\nname: demo\ndescription: 2024-01-01\n---\n", "description must be text"),
    ("---\nname: demo\ndescription: " + "d" * 1025 + "\n---\n", "1,025 characters long"),
])
def test_a_malformed_skill_md_says_why(text: str, reason: str) -> None:
    assert reason in why(text)


def test_bad_yaml_names_its_line() -> None:
    assert why("---\nname: demo\ndescription: a: b\n---\n").endswith("mapping values are not allowed here (line 3)")


def test_front_matter_that_is_not_utf8_is_refused() -> None:
    assert "not UTF-8" in why(b"---\nname: demo\ndescription: caf\xe9\n---\n")


def test_yaml_bombs_are_refused_quickly() -> None:
    # Aliases: a billion laughs as the description (shared references, never expanded).
    lines = ["---", "name: demo", 'l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    lines += ["description: *l9", "---", ""]
    assert "description must be text, not a list" in why("\n".join(lines))
    # Nesting past the parser's recursion: refused, not raised.
    deep = "---\nname: demo\ndescription: " + "[" * 4000 + "]" * 4000 + "\n---\n"
    assert "not valid YAML" in why(deep) or "nested too deeply" in why(deep)


# -- the folders ----------------------------------------------------------------------------


def test_scan_takes_valid_skills_sorted_and_skips_the_rest_with_a_reason(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    make_skill(first, "zeta", skill_md("zeta", "Last by name."))
    make_skill(first, "alpha", skill_md("alpha", "First by name."))
    make_skill(second, "alpha", skill_md("alpha", "Shadowed by the first folder."))
    make_skill(second, "mid", skill_md("mid", "From the second folder."))
    broken = make_skill(second, "broken", "---\nname: broken\ndescription: [\n---\n")
    (first / "README.md").write_text("not a skill: a file")
    (first / "no-skill-md").mkdir()
    make_skill(first, ".hidden", skill_md(".hidden", "never looked at"))
    big = make_skill(first, "big", skill_md("big", "Too large.", body="x" * MAX_SKILL_BYTES))
    result = scan([first, second, tmp_path / "missing"])
    assert [(s.name, s.description) for s in result.skills] == [
        ("alpha", "First by name."), ("mid", "From the second folder."), ("zeta", "Last by name.")]
    assert result.skills.get("alpha").folder == (first / "alpha").resolve()  # type: ignore[union-attr]
    reasons = {str(p.file): p.reason for p in result.problems}
    assert set(reasons) == {str(big), str(second / "alpha" / "SKILL.md"), str(broken)}
    assert "at most 128 KB" in reasons[str(big)]
    assert "comes first from" in reasons[str(second / "alpha" / "SKILL.md")]
    assert "not valid YAML" in reasons[str(broken)]
    assert result.missing == (tmp_path / "missing",)


def test_scan_is_bounded_in_skills(tmp_path: Path) -> None:
    for name in ("a", "b", "c", "d"):
        make_skill(tmp_path, name, skill_md(name, f"skill {name}"))
    result = scan([tmp_path], max_skills=2)
    assert result.skills.names == ["a", "b"]
    (problem,) = result.problems
    assert "more than 2 skills" in problem.reason and "c/SKILL.md" in problem.reason and "d/SKILL.md" in problem.reason


def test_links_out_of_the_skills_folder_are_not_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "skills", tmp_path / "outside"
    make_skill(outside, "escape", skill_md("escape", "Lives outside."))
    make_skill(outside, "loose", skill_md("inner", "A SKILL.md outside its folder."))
    root.mkdir()
    (root / "escape").symlink_to(outside / "escape", target_is_directory=True)
    (root / "inner").mkdir()
    (root / "inner" / "SKILL.md").symlink_to(outside / "loose" / "SKILL.md")
    (root / "self").symlink_to(root, target_is_directory=True)
    make_skill(root, "real", skill_md("real", "Inside."))
    (root / "real" / "docs").mkdir()
    result = scan([root])
    assert result.skills.names == ["real"]
    reasons = {p.file.parent.name: p.reason for p in result.problems}
    assert "outside the skills folder" in reasons["escape"]
    assert "outside its skill's folder" in reasons["inner"]
    assert "outside the skills folder" in reasons["self"]


def test_a_fifo_named_skill_md_does_not_block_the_scan(tmp_path: Path) -> None:
    (tmp_path / "pipe").mkdir()
    os.mkfifo(tmp_path / "pipe" / "SKILL.md")
    (problem,) = scan([tmp_path]).problems
    assert "not a regular file" in problem.reason


def test_a_skills_folder_that_is_a_file_is_reported(tmp_path: Path) -> None:
    (tmp_path / "skills").write_text("oops")
    (problem,) = scan([tmp_path / "skills"]).problems
    assert problem.reason == "not a folder"


def test_the_listing_is_names_and_descriptions_by_name(tmp_path: Path) -> None:
    make_skill(tmp_path, "b-skill", skill_md("b-skill", "Second.", body="SECRET-BODY"))
    make_skill(tmp_path, "a-skill", skill_md("a-skill", "First."))
    section = prompt_section(scan([tmp_path]).skills)
    assert section.endswith("- a-skill: First.\n- b-skill: Second.")
    assert 'read_file("skills/<name>/SKILL.md")' in section and "SECRET-BODY" not in section
    assert section == prompt_section(scan([tmp_path]).skills)  # the same skills, the same bytes
    assert prompt_section(Skills()) == ""


def test_an_agent_may_use_all_skills_or_the_named_ones(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        make_skill(tmp_path, name, skill_md(name, name))
    skills = scan([tmp_path]).skills
    assert allowed_skills(skills).names == ["a", "b", "c"]
    assert allowed_skills(skills, "*").names == ["a", "b", "c"]
    assert allowed_skills(skills, ["c", "a", "unknown"]).names == ["a", "c"]
    assert allowed_skills(skills, "b").names == ["b"]
    assert allowed_skills(skills, []).names == []


def test_skills_dirs_are_relative_to_the_config_file(tmp_path: Path) -> None:
    cfg = Config.model_validate({"skills": {"dirs": ["mine", "/opt/shared-skills"]}})
    assert cfg.skills.paths(tmp_path) == [tmp_path / "mine", Path("/opt/shared-skills")]
    assert Config().skills.dirs == ("skills",)
    with pytest.raises(ValueError, match="not a folder path"):
        Config.model_validate({"skills": {"dirs": [" "]}})


def test_the_shipped_skills_are_valid() -> None:
    shipped = Path(__file__).resolve().parents[1] / "skills"
    result = scan([shipped])
    assert result.problems == ()
    assert result.skills.names == ["meeting-notes", "summarize-document"]


# -- read_file under skills/ ----------------------------------------------------------------


@pytest.fixture
def skill_root(tmp_path: Path) -> Path:
    root = tmp_path / "skills"
    make_skill(root, "alpha", skill_md("alpha", "Alpha things.", body=ALPHA_BODY))
    (root / "alpha" / "reference.md").write_text("ALPHA-REFERENCE\n")
    make_skill(root, "beta", skill_md("beta", "Beta things.", body=BETA_BODY))
    (tmp_path / "secret.txt").write_text("HOST-SECRET\n")
    (root / "alpha" / "leak.md").symlink_to(tmp_path / "secret.txt")
    return root


def tool_ctx(tmp_path: Path, skills: Skills | None) -> ToolContext:
    workspace = tmp_path / "workspace"
    workspace.mkdir(exist_ok=True)
    return ToolContext(session_key="web:dm:t", scope="web:t", workspace=workspace, config=Config(), skills=skills)


async def read(ctx: ToolContext, path: str) -> Any:
    return await ReadFile().run({"path": path}, ctx)


async def test_read_file_reads_a_skill_as_protected_markdown(tmp_path: Path, skill_root: Path) -> None:
    ctx = tool_ctx(tmp_path, scan([skill_root]).skills)
    out = await read(ctx, "skills/alpha/SKILL.md")
    assert ALPHA_BODY in out.text and out.text.startswith("---\nname: alpha")
    assert out.file_ref is not None and out.file_ref.path == "skills/alpha/SKILL.md" and out.file_ref.protected
    other = await read(ctx, "./skills/alpha/reference.md")
    assert other.text == "ALPHA-REFERENCE\n" and other.file_ref.path == "skills/alpha/reference.md"


@pytest.mark.parametrize(("path", "reason"), [
    ("skills/alpha/../../secret.txt", "outside the skill's folder"),
    ("skills/alpha/../beta/SKILL.md", "outside the skill's folder"),
    ("skills/../secret.txt", "no skill '..'"),
    ("skills/alpha/leak.md", "outside the skill's folder"),
    ("skills//etc/passwd", "no skill 'etc'"),
    ("skills/gamma/SKILL.md", "no skill 'gamma'"),
    ("skills", "one folder per skill"),
    ("skills/alpha", "the skill's folder"),
])
async def test_read_file_never_leaves_a_skills_folder(tmp_path: Path, skill_root: Path, path: str,
                                                      reason: str) -> None:
    ctx = tool_ctx(tmp_path, allowed_skills(scan([skill_root]).skills, ["alpha"]))
    with pytest.raises(ToolError) as err:
        await read(ctx, path)
    assert reason in str(err.value) and "HOST-SECRET" not in str(err.value)


async def test_read_file_reads_only_the_skills_the_agent_may_use(tmp_path: Path, skill_root: Path) -> None:
    skills = scan([skill_root]).skills
    assert BETA_BODY in (await read(tool_ctx(tmp_path, skills), "skills/beta/SKILL.md")).text
    with pytest.raises(ToolError, match="no skill 'beta' you may use"):
        await read(tool_ctx(tmp_path, allowed_skills(skills, ["alpha"])), "skills/beta/SKILL.md")
    with pytest.raises(ToolError, match="no skill 'alpha'"):
        await read(tool_ctx(tmp_path, None), "skills/alpha/SKILL.md")


async def test_a_skill_folder_swapped_for_a_link_is_not_followed(tmp_path: Path, skill_root: Path) -> None:
    ctx = tool_ctx(tmp_path, scan([skill_root]).skills)
    (skill_root / "alpha").rename(tmp_path / "alpha-moved")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "SKILL.md").write_text("HOST-SECRET\n")
    (skill_root / "alpha").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(ToolError, match="changed on disk"):
        await read(ctx, "skills/alpha/SKILL.md")


# -- a running gateway ------------------------------------------------------------------------


def system_of(request: dict[str, Any]) -> str:
    first = request["messages"][0]
    assert first["role"] == "system"
    return str(first["content"])


def skill_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gateway.skills" and r.levelno == logging.WARNING]


@pytest.fixture
def quick_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway.skills.watcher, "SETTLE_S", 0.05)
    monkeypatch.setattr(gateway.skills.watcher, "LOOK_AGAIN_S", 0.2)


async def test_skills_in_a_running_gateway(make_gateway: GatewayFactory, fake_model: FakeModel, tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture, quick_watch: None) -> None:
    caplog.set_level(logging.INFO, logger="gateway.skills")
    root = tmp_path / "skills"  # skills.dirs' default, beside config.json
    make_skill(root, "alpha", skill_md("alpha", "Alpha: summarize things.", body=ALPHA_BODY))
    beta = make_skill(root, "beta", skill_md("beta", "Beta: write notes.", body=BETA_BODY))
    broken = make_skill(root, "broken", "---\nname: broken\ndescription: [oops\n---\nBROKEN-BODY\n")
    nodesc = make_skill(root, "nodesc", skill_md("nodesc", None, body="NODESC-BODY\n"))
    gw = await make_gateway(admins=["web:boss"])
    assert gw.skill_watcher is not None

    # The two valid skills are listed with their descriptions; nothing of their bodies.
    await chat(gw, "s", "hello")
    system = system_of(fake_model.requests[-1])
    assert "- alpha: Alpha: summarize things.\n- beta: Beta: write notes." in system
    for absent in ("ALPHA-BODY-MARKER", "BETA-BODY-MARKER", "broken", "nodesc", "BROKEN-BODY"):
        assert absent not in system
    warnings = skill_warnings(caplog)
    assert len(warnings) == 2, warnings
    assert any(str(broken) in w and "not valid YAML" in w for w in warnings)
    assert any(str(nodesc) in w and "no description" in w for w in warnings)

    # Nothing changed: the next request's system prompt is the same, byte for byte.
    await chat(gw, "s", "again")
    assert system_of(fake_model.requests[-1]) == system

    # The model reads a skill's instructions; a way out of skills/ is refused.
    fake_model.tool_call("read_file", {"path": "skills/alpha/SKILL.md"})
    fake_model.tool_call("read_file", {"path": "skills/alpha/../../config.json"})
    fake_model.reply("done")
    assert await chat(gw, "s", "summarize this") == "done"
    tools = [m["content"] for m in fake_model.requests[-1]["messages"] if m["role"] == "tool"]
    assert ALPHA_BODY in tools[-2]
    assert "outside the skill's folder" in tools[-1] and "model" not in tools[-1]
    assert system_of(fake_model.requests[-1]) == system

    # /skills lists them.
    listing = await chat(gw, "s", "/skills")
    assert "- alpha: Alpha: summarize things." in listing and "- beta: Beta: write notes." in listing
    assert "broken" not in listing

    # Editing a description changes the next request's prompt, without a restart.
    version = gw.skill_watcher.version
    beta.write_text(skill_md("beta", "Beta: write better notes.", body=BETA_BODY))
    await until(lambda: gw.skill_watcher.version > version)
    await chat(gw, "s", "and now?")
    edited = system_of(fake_model.requests[-1])
    assert "- beta: Beta: write better notes." in edited and "Beta: write notes." not in edited

    # A new body alone leaves the listing as it was (no new prompt); read_file reads it fresh.
    version = gw.skill_watcher.version
    beta.write_text(skill_md("beta", "Beta: write better notes.", body="NEW-BETA-BODY\n"))
    assert await gw.skill_watcher.rescan() is False and gw.skill_watcher.version == version
    fake_model.tool_call("read_file", {"path": "skills/beta/SKILL.md"})
    fake_model.reply("ok")
    await chat(gw, "s", "read beta")
    assert system_of(fake_model.requests[-1]) == edited
    assert "NEW-BETA-BODY" in [m for m in fake_model.requests[-1]["messages"] if m["role"] == "tool"][-1]["content"]

    # Adding one and removing one apply the same way.
    version = gw.skill_watcher.version
    make_skill(root, "gamma", skill_md("gamma", "Gamma: new."))
    await until(lambda: gw.skill_watcher.version > version)
    version = gw.skill_watcher.version
    (root / "alpha" / "SKILL.md").unlink()
    await until(lambda: gw.skill_watcher.version > version)
    await chat(gw, "s", "what now?")
    system = system_of(fake_model.requests[-1])
    assert "- gamma: Gamma: new." in system and "- alpha:" not in system
    fake_model.tool_call("read_file", {"path": "skills/alpha/reference.md"})
    fake_model.reply("ok")
    await chat(gw, "s", "read alpha")
    assert "no skill 'alpha'" in [m for m in fake_model.requests[-1]["messages"] if m["role"] == "tool"][-1]["content"]
    # The broken files were warned about once, not at every rescan.
    assert len(skill_warnings(caplog)) == 2

    # The folders are the operator's: not changed from chat, even by an admin.
    refused = await chat(gw, "boss", '/config skills.dirs ["/etc"]')
    assert "config.json" in refused and gw.cfg.skills.dirs == ("skills",)

    # The watcher is owned: stopping the gateway stops it.
    task = gw.skill_watcher._task
    assert task is not None and not task.done()
    await gw.stop(timeout=5)
    assert task.done() and gw.skill_watcher._task is None


async def test_no_skills_means_no_listing(make_gateway: GatewayFactory, fake_model: FakeModel) -> None:
    gw = await make_gateway(admins=["web:boss"])
    await chat(gw, "s", "hello")
    assert "## Skills" not in system_of(fake_model.requests[-1])
    answer = await chat(gw, "s", "/skills")
    assert answer.startswith("No skills here.") and "SKILL.md" in answer and "skills.dirs in config.json" in answer
    assert "skills.dirs: skills, relative to the config file" in await chat(gw, "boss", "/skills")
    assert "/skills" in await chat(gw, "s", "/help")


async def test_a_skills_folder_made_after_the_start_is_picked_up(make_gateway: GatewayFactory, tmp_path: Path,
                                                                 quick_watch: None) -> None:
    gw = await make_gateway()
    assert gw.skill_watcher is not None and not gw.skill_watcher.skills()
    make_skill(tmp_path / "skills", "late", skill_md("late", "Came later."))
    await until(lambda: gw.skill_watcher is not None and gw.skill_watcher.skills().names == ["late"])
    assert "- late: Came later." in await chat(gw, "s", "/skills")


async def test_skills_dirs_follow_a_config_reload(fake_model: FakeModel, tmp_path: Path, quick_watch: None) -> None:
    from gateway.config.load import load_config
    from tests.conftest import write_config

    make_skill(tmp_path / "one", "first", skill_md("first", "From one."))
    make_skill(tmp_path / "two", "second", skill_md("second", "From two."))
    path = write_config(tmp_path, fake_model, skills={"dirs": ["one"]})
    gw = Gateway(load_config(path), config_path=path)
    await gw.start()
    try:
        assert gw.skill_watcher is not None and gw.skill_watcher.skills().names == ["first"]
        raw = json.loads(path.read_text())
        raw["skills"]["dirs"] = ["two", str(tmp_path / "one")]
        path.write_text(json.dumps(raw))
        assert await gw.config_watcher().reload() is True
        assert gw.skill_watcher.skills().names == ["first", "second"]
        # The new folders are watched.
        version = gw.skill_watcher.version
        make_skill(tmp_path / "two", "third", skill_md("third", "Also from two."))
        await until(lambda: gw.skill_watcher is not None and gw.skill_watcher.version > version)
        assert gw.skill_watcher.skills().names == ["first", "second", "third"]
    finally:
        await gw.stop(timeout=5)


# -- SKILL.md files that attack the parser (issue 31: a 5,000-digit integer stopped the
# watcher, and a restart hung serving nothing)

HUGE_INT = "---\nname: {name}\ndescription: Fine otherwise.\nversion: " + "9" * 5000 + "\n---\n"
NO_DATE = "---\nname: {name}\ndescription: Fine otherwise.\ndate: 2001-02-30\n---\n"
DEEP = "---\nname: {name}\ndescription: " + "[" * 3000 + "]" * 3000 + "\n---\n"
LAUGHS = "\n".join(["---", "name: {name}", 'l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]',
                    *(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 10)),
                    "description: *l9", "---", ""])
HOSTILE = {"huge-int": HUGE_INT, "no-date": NO_DATE, "deep": DEEP, "laughs": LAUGHS}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_front_matter_is_a_reason_not_an_exception(name: str) -> None:
    reason = why(HOSTILE[name].format(name=name), folder=name)
    assert reason and len(reason) < 300


def test_scan_skips_a_hostile_skill_md_and_names_it(tmp_path: Path) -> None:
    for name, text in HOSTILE.items():
        make_skill(tmp_path, name, text.format(name=name))
    make_skill(tmp_path, "good", skill_md("good", "Still here."))
    found = scan([tmp_path])
    assert found.skills.names == ["good"]
    assert sorted(p.file.parent.name for p in found.problems) == sorted(HOSTILE)
    assert any("Exceeds the limit" in p.reason for p in found.problems if p.file.parent.name == "huge-int")


async def test_the_watcher_outlives_a_hostile_edit_and_takes_the_next_good_one(
        make_gateway: GatewayFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture, quick_watch: None) -> None:
    root = tmp_path / "skills"
    big = make_skill(root, "big", HUGE_INT.format(name="big"))  # there at the start
    make_skill(root, "good", skill_md("good", "Still here."))
    gw = await make_gateway()
    watcher = gw.skill_watcher
    assert watcher is not None and watcher.skills().names == ["good"]
    assert any(str(big) in line and "Exceeds the limit" in line for line in skill_warnings(caplog))
    # Fixed while running: taken.
    big.write_text(skill_md("big", "Now a skill."))
    await until(lambda: watcher.skills().names == ["big", "good"])
    # Broken again, with each of the others in turn, and fixed: the watcher follows every time.
    for name, text in HOSTILE.items():
        big.write_text(text.format(name="big"))
        await until(lambda: watcher.skills().names == ["good"])
        big.write_text(skill_md("big", f"Back after {name}."))
        await until(lambda: watcher.skills().names == ["big", "good"])
    assert watcher._task is not None and not watcher._task.done()


async def test_a_start_that_fails_after_the_store_opened_closes_it(
        fake_model: FakeModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hang on restart: a start that raised after the database opened left its worker
    thread running, and the process never exited."""
    import threading

    from gateway.config.load import load_config
    from tests.conftest import write_config

    async def broken(self: object) -> None:
        raise RuntimeError("an unexpected failure while loading skills")

    def holding() -> set[threading.Thread]:
        """Threads that keep a process alive, but the loop's own executor (asyncio.run ends it)."""
        return {t for t in threading.enumerate() if not t.daemon and t.is_alive() and
                not t.name.startswith("asyncio_") and t is not threading.main_thread()}

    monkeypatch.setattr(gateway.skills.watcher.SkillWatcher, "load", broken)
    before = holding()
    path = write_config(tmp_path, fake_model)
    gw = Gateway(load_config(path), config_path=path)
    with pytest.raises(RuntimeError, match="unexpected failure"):
        await gw.start()
    await gw.stop(timeout=5)
    await until(lambda: holding() <= before)


async def test_gateway_run_starts_and_serves_with_hostile_skills(fake_model: FakeModel, tmp_path: Path) -> None:
    from tests.conftest import write_config

    for name, text in HOSTILE.items():
        make_skill(tmp_path / "skills", name, text.format(name=name))
    make_skill(tmp_path / "skills", "good", skill_md("good", "Still here."))
    path = write_config(tmp_path, fake_model)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "run", "--config", str(path), cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
        assert line.startswith(b"gateway running"), line
        port = int(line.split(b"127.0.0.1:")[1].split(b"/")[0])
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/healthz", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                assert resp.status == 200
        proc.send_signal(signal.SIGINT)
        _out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
    said = err.decode()
    for name in HOSTILE:
        assert str(tmp_path / "skills" / name / "SKILL.md") in said, said
    assert "Traceback" not in said
