"""The skills a gateway offers (SPEC §5.6), in the SKILL.md format peers share
(agentskills.io): a folder under one of `skills.dirs` whose SKILL.md opens with YAML front
matter naming the skill (`name`, the folder's own name) and saying what it is for and when
(`description`). The body is the instructions, read by the agent only when a task calls
for them.

`scan` finds them (blocking file I/O: run it in a worker thread); `prompt_section` is what
the system prompt lists; `allowed_skills` is the part an agent may use; `skill_file` maps
read_file's `skills/<name>/...` paths onto the skills' folders, read-only."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import yaml

from gateway.workspace import PathNotAllowed, resolve_in_workspace

SKILL_FILE = "SKILL.md"
PREFIX = "skills"  # where read_file finds them: skills/<name>/SKILL.md
ALL: Literal["*"] = "*"
Allowed = Literal["*"] | Sequence[str]  # `agents.<name>.skills`: names, or "*" for every skill

# agentskills.io: 1-64 lowercase letters and digits, hyphens only between them.
NAME = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
NAME_MAX = 64
DESCRIPTION_MAX = 1024
# Every skill's name and description are in every request: a bound on the prompt.
MAX_SKILLS = 100
MAX_SKILL_BYTES = 128 * 1024  # a SKILL.md is instructions to read at once, not a data file
MAX_FRONT_MATTER_BYTES = 16 * 1024
MAX_ENTRIES = 1000  # entries of one skills folder looked at
_SHOWN = 60  # how much of a bad value a warning repeats


class SkillError(ValueError):
    """Why a folder's SKILL.md is not a skill: said in the one warning that skips it."""


@dataclass(frozen=True, slots=True)
class Skill:
    name: str
    description: str  # on one line: whitespace runs are one space
    folder: Path  # its folder's real path

    @property
    def instructions(self) -> str:
        """The read_file path of its SKILL.md."""
        return f"{PREFIX}/{self.name}/{SKILL_FILE}"


@dataclass(frozen=True, slots=True)
class Skills:
    """Skills with unique names, sorted by name (the order of the prompt's listing)."""

    items: tuple[Skill, ...] = ()

    def __iter__(self) -> Iterator[Skill]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def names(self) -> list[str]:
        return [skill.name for skill in self.items]

    def get(self, name: str) -> Skill | None:
        for skill in self.items:
            if skill.name == name:
                return skill
        return None


NO_SKILLS = Skills()


@dataclass(frozen=True, slots=True)
class Problem:
    file: Path  # as configured (not resolved), so the operator recognizes it
    reason: str


@dataclass(frozen=True, slots=True)
class Scan:
    skills: Skills = NO_SKILLS
    problems: tuple[Problem, ...] = ()
    missing: tuple[Path, ...] = field(default=())  # configured folders that do not exist (yet)


# -- one SKILL.md ---------------------------------------------------------------------------


def _shown(value: str) -> str:
    return repr(value) if len(value) <= _SHOWN else f"{value[:_SHOWN]!r}… ({len(value):,} characters)"


def _kind(value: Any) -> str:
    """A YAML value's kind in words (never its text: an alias bomb is shared references,
    and printing one would expand it)."""
    kinds = {bool: "true/false", int: "a number", float: "a number", list: "a list", dict: "a mapping"}
    return next((word for kind, word in kinds.items() if isinstance(value, kind)), type(value).__name__)


def front_matter(data: bytes) -> dict[str, Any]:
    """The fields of the YAML front matter at the start of a SKILL.md: the lines between a
    first line `---` and the next line `---`, parsed with yaml.safe_load."""
    if data.startswith(b"\xef\xbb\xbf"):  # a BOM some editors write
        data = data[3:]
    first, newline, rest = data.partition(b"\n")
    if not newline or first.rstrip(b" \t\r") != b"---":
        raise SkillError("no front matter: the file must start with a line '---'")
    size = 0
    for line in rest.splitlines(keepends=True):
        if line.rstrip(b" \t\r\n") == b"---":
            break
        size += len(line)
        if size > MAX_FRONT_MATTER_BYTES:
            raise SkillError(f"the front matter is not closed by a line '---' within "
                             f"{MAX_FRONT_MATTER_BYTES // 1024} KB")
    else:
        raise SkillError("the front matter is not closed by a line '---'")
    try:
        text = rest[:size].decode("utf-8")
    except UnicodeDecodeError:
        raise SkillError("the front matter is not UTF-8 text") from None
    try:
        fields = yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        where = f" (line {err.problem_mark.line + 2})" if err.problem_mark is not None else ""
        raise SkillError(f"the front matter is not valid YAML: {err.problem or err.context}{where}") from None
    except yaml.YAMLError as err:
        raise SkillError(f"the front matter is not valid YAML ({type(err).__name__})") from None
    except RecursionError:
        raise SkillError("the front matter is not valid YAML: nested too deeply") from None
    except (ValueError, TypeError, ArithmeticError, MemoryError) as err:
        # What PyYAML's constructors let through: an integer past Python's 4,300 digits
        # (ValueError "Exceeds the limit"), a date that is none (2001-02-30), ...
        raise SkillError(f"the front matter holds a value that cannot be read: {_shown(str(err))}") from None
    if not isinstance(fields, dict):
        raise SkillError("the front matter is not a mapping of fields (name: …, description: …)")
    return fields


def check_fields(fields: dict[str, Any], folder: str) -> tuple[str, str]:
    """The skill's name and one-line description, checked by agentskills.io's rules."""
    name = fields.get("name")
    if name is None:
        raise SkillError("no name in the front matter")
    if not isinstance(name, str):
        raise SkillError(f"name must be text, not {_kind(name)}")
    if len(name) > NAME_MAX or not NAME.fullmatch(name):
        raise SkillError(f"name {_shown(name)} must be 1-{NAME_MAX} lowercase letters, digits and hyphens "
                         "(not first, last or two in a row)")
    if name != folder:
        raise SkillError(f"name {name!r} does not match its folder's name {_shown(folder)}")
    description = fields.get("description")
    if description is None:
        raise SkillError("no description in the front matter")
    if not isinstance(description, str):
        raise SkillError(f"description must be text, not {_kind(description)}")
    line = " ".join(description.split())
    if not line:
        raise SkillError("the description is empty")
    if len(line) > DESCRIPTION_MAX:
        raise SkillError(f"the description is {len(line):,} characters long; at most {DESCRIPTION_MAX:,}")
    return name, line


def parse_skill_md(data: bytes, folder: str) -> tuple[str, str]:
    """A SKILL.md's name and description (SkillError says why it is not a skill)."""
    return check_fields(front_matter(data), folder)


# -- the folders ----------------------------------------------------------------------------


def _inside(path: Path, root: Path) -> bool:
    return root in path.parents


def _read_head(path: Path) -> bytes:
    """The start of a regular file (never a FIFO or a device: opening one could block)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SkillError(f"{SKILL_FILE} is not a regular file")
        if st.st_size > MAX_SKILL_BYTES:
            raise SkillError(f"{SKILL_FILE} is {st.st_size:,} bytes; at most {MAX_SKILL_BYTES // 1024} KB")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(MAX_FRONT_MATTER_BYTES + 1024)
    finally:
        os.close(fd)


def load_skill(root: Path, entry: str) -> Skill | None:
    """The skill in `root/entry` (root resolved), None when it is no skill folder at all
    (a file, a folder without SKILL.md); SkillError when its SKILL.md is not a skill."""
    folder = Path(os.path.realpath(root / entry))
    if not _inside(folder, root):
        raise SkillError("a link to a folder outside the skills folder: not followed")
    if not folder.is_dir():
        return None
    md = folder / SKILL_FILE
    if not os.path.lexists(md):
        return None
    md_real = Path(os.path.realpath(md))
    if not _inside(md_real, folder):
        raise SkillError(f"{SKILL_FILE} is a link to a file outside its skill's folder: not followed")
    try:
        data = _read_head(md_real)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise SkillError(f"cannot read {SKILL_FILE}: {err.strerror or type(err).__name__}") from None
    name, description = parse_skill_md(data, entry)
    return Skill(name=name, description=description, folder=folder)


def scan(dirs: Sequence[Path], *, max_skills: int = MAX_SKILLS) -> Scan:
    """Every skill under `dirs`, in their order: a name found twice is the first folder's;
    past `max_skills` the rest are left out. Blocking: run it in a worker thread."""
    found: dict[str, tuple[Skill, Path]] = {}
    problems: list[Problem] = []
    missing: list[Path] = []
    left_out: list[str] = []
    for root in dirs:
        try:
            root_real = Path(os.path.realpath(root))
            if not root_real.exists():
                missing.append(root)
                continue
            if not root_real.is_dir():
                problems.append(Problem(root, "not a folder"))
                continue
            entries = sorted(os.listdir(root_real))
        except OSError as err:
            problems.append(Problem(root, f"cannot be read: {err.strerror or type(err).__name__}"))
            continue
        if len(entries) > MAX_ENTRIES:
            problems.append(Problem(root, f"holds {len(entries):,} entries; only the first {MAX_ENTRIES:,} by "
                                          "name are looked at"))
            entries = entries[:MAX_ENTRIES]
        for entry in entries:
            if entry.startswith("."):  # .git and the like
                continue
            where = root / entry / SKILL_FILE
            try:
                skill = load_skill(root_real, entry)
            except SkillError as err:
                problems.append(Problem(where, str(err)))
                continue
            except OSError as err:
                problems.append(Problem(where, f"cannot be read: {err.strerror or type(err).__name__}"))
                continue
            except Exception as err:  # whatever else one file does, the other skills and the watcher go on
                problems.append(Problem(where, f"cannot be read as a skill ({type(err).__name__})"))
                continue
            if skill is None:
                continue
            if skill.name in found:
                first = found[skill.name][1]
                problems.append(Problem(where, f"a skill named {skill.name!r} comes first from {first}; "
                                               "this one is ignored"))
                continue
            if len(found) >= max_skills:
                left_out.append(str(where))
                continue
            found[skill.name] = (skill, root)
    if left_out:
        shown = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5:,} more" if len(left_out) > 5 else "")
        problems.append(Problem(Path(left_out[0]), f"more than {max_skills} skills in all; left out: {shown}"))
    skills = tuple(sorted((skill for skill, _ in found.values()), key=lambda s: s.name))
    return Scan(Skills(skills), tuple(problems), tuple(missing))


# -- what the agent sees and may read ----------------------------------------------------------


def allowed_skills(skills: Skills, allowed: Allowed = ALL) -> Skills:
    """The skills an agent may use: all of them ("*"), or those of `allowed` that exist."""
    if allowed == ALL:
        return skills
    wanted = {allowed} if isinstance(allowed, str) else set(allowed)
    return Skills(tuple(skill for skill in skills if skill.name in wanted))


def prompt_section(skills: Skills) -> str:
    """The system prompt's listing: names and descriptions only, by name; empty without
    skills. The same skills give the same text, byte for byte (prompt caches)."""
    if not skills:
        return ""
    lines = [
        "## Skills",
        "Each skill below holds instructions for one kind of task. When a task calls for one, first read its "
        f'instructions with read_file("{PREFIX}/<name>/{SKILL_FILE}") and follow them; files they mention are '
        f"read the same way, under {PREFIX}/<name>/.",
    ]
    lines += [f"- {skill.name}: {skill.description}" for skill in skills]
    return "\n".join(lines)


def is_skill_path(rel: str) -> bool:
    """Whether read_file's `rel` names something under skills/ (the skills, not the workspace)."""
    parts = PurePosixPath(rel).parts
    return bool(parts) and parts[0] == PREFIX


def skill_file(skills: Skills, rel: str) -> tuple[Path, str]:
    """The file `skills/<name>/<path>` names inside that skill's folder, and the path as
    read_file shows it. Only skills of `skills`, never out of the skill's folder (`..`,
    links). Blocking (it resolves links): run it in a worker thread."""
    parts = PurePosixPath(rel).parts
    usable = ", ".join(skills.names) or "none"
    if len(parts) < 2:
        raise PathNotAllowed(f"{PREFIX}/ holds one folder per skill; read {PREFIX}/<name>/{SKILL_FILE} "
                             f"(skills: {usable})")
    name, inner = parts[1], parts[2:]
    skill = skills.get(name)
    if skill is None:
        raise PathNotAllowed(f"there is no skill {_shown(name)} you may use (skills: {usable})")
    if Path(os.path.realpath(skill.folder)) != skill.folder:
        # Its folder was swapped (for a link, say) since it was found: not followed.
        raise PathNotAllowed(f"the skill {name!r} changed on disk; try again in a moment")
    if not inner:
        raise PathNotAllowed(f"{PREFIX}/{name} is the skill's folder; read {skill.instructions}")
    inner_path = "/".join(inner)
    try:
        target = resolve_in_workspace(skill.folder, inner_path)
    except PathNotAllowed:
        raise PathNotAllowed(f"{_shown(rel)} is outside the skill's folder") from None
    shown = PurePosixPath(PREFIX, name, target.relative_to(skill.folder).as_posix()).as_posix()
    return target, shown
