"""CLI: `python -m gateway run | chat | check-config | pairing list|approve|revoke |
sessions | usage | memory | web-link | config-reset`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from gateway.config.checks import config_warnings, startup_problems
from gateway.config.load import ConfigError, load_config, parse_config
from gateway.config.schema import Config
from gateway.ops.logs import setup_logging, start_banner

if TYPE_CHECKING:
    from gateway.app import Gateway

GC_YOUNG_THRESHOLD = 20_000  # allocations between collections of the youngest generation

DEFAULT_CONFIG = Path("config.json")


def _config_file(path: Path | None) -> Path | None:
    """The file a command reads: the one given, else ./config.json when it exists, else
    None (the embedded defaults)."""
    if path is not None:
        return path
    return DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None


def _load(path: Path | None) -> tuple[Config, Path | None]:
    """The config file, or the embedded defaults when none exists at the default path."""
    path = _config_file(path)
    if path is None:
        return parse_config({}), None  # the defaults, their `${ENV}` secrets expanded
    return load_config(path), path.resolve()


def _print_problems(path: Path | None, err: ConfigError) -> None:
    shown = path.resolve() if path is not None else "(the defaults: no config.json here)"
    print(f"config {shown} has {len(err.problems)} problem(s):", file=sys.stderr)
    for problem in err.problems:
        print(f"  - {problem}", file=sys.stderr)


def _check(path: Path) -> int:
    """Everything `run` would refuse, with key paths; warnings alone still pass."""
    cfg = load_config(path)  # a ConfigError is printed by main()
    problems = startup_problems(cfg)
    if problems:
        raise ConfigError(problems)
    for warning in config_warnings(cfg):
        print(f"warning: {warning}", file=sys.stderr)
    print(f"{path}: OK")
    return 0


def _dump_tasks() -> None:
    """Print every task's stack to stderr: the first thing to look at when a gateway seems stuck."""
    tasks = asyncio.all_tasks()
    print(f"--- {len(tasks)} tasks ---", file=sys.stderr)
    for task in sorted(tasks, key=lambda t: t.get_name()):
        print(f"{task.get_name()}:", file=sys.stderr)
        awaited: object = task.get_coro()
        for _ in range(40):  # follow the await chain down to what it is waiting on
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is None:
                print(f"    waiting on {awaited!r}"[:300], file=sys.stderr)
                break
            print(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}", file=sys.stderr)
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    print("--- end of tasks ---", file=sys.stderr, flush=True)


def say(text: str, stream: TextIO | None = None) -> None:
    """A status line for the operator. A stream that went away (`gateway run | tee log`,
    and Ctrl+C ended tee too) must never cut the shutdown short."""
    out = stream or sys.stderr
    try:
        out.write(text + "\n")  # one write: a log line from elsewhere cannot land in between
        out.flush()
    except (OSError, ValueError):  # BrokenPipeError, EIO; ValueError: the stream is closed
        pass


class Shutdown:
    """SIGINT/SIGTERM: the first stops gracefully, the second stops now, a third exits
    at once (the database is crash-safe and cut turns resume at the next start)."""

    def __init__(self, in_flight: Callable[[], int], timeout: float) -> None:
        self.requested = asyncio.Event()
        self.now = asyncio.Event()
        self.in_flight = in_flight
        self.timeout = timeout
        self.signals = 0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self.signal)

    def signal(self) -> None:
        self.signals += 1
        if self.signals == 1:
            n = self.in_flight()
            if n:
                replies = "1 reply" if n == 1 else f"{n} replies"
                say(f"stopping: waiting up to {self.timeout:g} s for {replies} in flight; "
                    "Ctrl+C again to stop now")
            else:
                say("stopping…")
            self.requested.set()
        elif self.signals == 2:
            say("stopping now: replies in flight are saved as far as they got and resumed at the next start")
            self.now.set()
        else:
            say("exiting at once")
            os._exit(130)


async def _run(path: Path | None) -> int:
    from gateway.app import SHUTDOWN_TIMEOUT_S, Gateway, StartupError
    from gateway.http.server import raise_open_files_limit

    cfg, cfg_path = _load(path)
    setup_logging(cfg.log_level)
    raise_open_files_limit()  # the server's connection cap is derived from it (gateway/http/server.py)
    gateway = Gateway(cfg, config_path=cfg_path, watch_config=True)
    loop = asyncio.get_running_loop()
    shutdown = Shutdown(gateway.replies_in_flight, SHUTDOWN_TIMEOUT_S)
    shutdown.install(loop)
    with contextlib.suppress(NotImplementedError, AttributeError):
        loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)  # `kill -USR1 <pid>`: what is everything waiting on?
    try:
        await gateway.start()
    except StartupError as err:
        say(f"cannot start: {err}")
        await gateway.stop()
        return 2
    except BaseException:
        # Whatever started (HTTP server, channels) must stop, or the process hangs on them.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(gateway.stop(timeout=5), timeout=30)
        raise
    # What exists now (imported modules, the config, the app) lives as long as the process.
    # Frozen, it is left out of the collector's full scans, which otherwise stop the event
    # loop for 40-100 ms now and then under load (measured with gc.callbacks).
    gc.collect()
    gc.freeze()
    # A turn allocates thousands of short-lived containers (requests, futures, rows) that
    # reference counting frees: with the default threshold (700) the young generation was
    # scanned many times a turn and its survivors again in the next (~5 % of the CPU under
    # load, perf); cycles are rare here, so they may wait for a larger batch.
    gc.set_threshold(GC_YOUNG_THRESHOLD, 50, 50)
    say(f"gateway running: {_web_chat_line(gateway)}  (Ctrl+C to stop)", sys.stdout)
    # Which file and folder: a refused start names them in its one line already.
    say(start_banner(cfg_path, gateway.holder.data_dir.resolve()), sys.stdout)
    await shutdown.requested.wait()
    await gateway.stop(SHUTDOWN_TIMEOUT_S, now=shutdown.now)
    say("stopped")
    return 130 if shutdown.now.is_set() else 0


def _web_chat_line(gateway: Gateway) -> str:
    """Where the web chat is: the link that signs a browser in (SPEC §9: the page needs the
    token, on loopback too), or with a configured token, what to add to the address."""
    if gateway.http is None or "web" not in gateway.channels:
        return "web chat off"
    link = gateway.web_link()
    if link is not None:
        return f"web chat on {link}"
    return (f"web chat on http://{gateway.cfg.http.host}:{gateway.http.port}/ "
            "(open it once with ?token=<channels.web.token>)")


def _web_link(path: Path | None) -> int:
    """`gateway web-link`: the link that signs a browser in to the web chat, again."""
    from gateway.config.schema import secret_text
    from gateway.http import web_token

    cfg, cfg_path = _load(path)
    if not cfg.channels.web.enabled:
        print("the web chat is disabled (channels.web.enabled is false)", file=sys.stderr)
        return 1
    token = secret_text(cfg.channels.web.token)
    if token is None:
        data_dir = cfg.data_path(_base(cfg_path))
        try:
            token = web_token.load_or_create(data_dir)  # the one `run` made, or the one it will use
        except OSError as err:
            print(f"cannot read the web token: {err}", file=sys.stderr)
            return 1
    say(web_token.link(cfg.http.host, cfg.http.port, token), sys.stdout)
    return 0


async def _chat(path: Path | None) -> int:
    from gateway.chat import run_terminal

    cfg, cfg_path = _load(path)
    if not cfg.channels.terminal.enabled:
        print("the terminal chat is disabled (channels.terminal.enabled is false)", file=sys.stderr)
        return 2
    print(start_banner(cfg_path, cfg.data_path(_base(cfg_path)).resolve()))
    return await run_terminal(cfg, cfg_path)  # it logs to a file in the data dir (chat.log)


def _base(cfg_path: Path | None) -> Path:
    return cfg_path.parent if cfg_path else Path.cwd()


async def _operator(args: argparse.Namespace) -> int:
    """The commands that read the database and data dir (gateway/ops/cli.py)."""
    from gateway.ops import cli as cli_ops

    cfg, cfg_path = _load(args.config)
    setup_logging("WARNING")
    base = _base(cfg_path)
    try:
        if args.command == "pairing" and args.action in ("approve", "revoke"):
            result = await (cli_ops.pairing_approve(cfg, base, args.code) if args.action == "approve"
                            else cli_ops.pairing_revoke(cfg, base, args.who))
            say(result.text, sys.stdout if result.ok else sys.stderr)
            return 0 if result.ok else 1
        if args.command == "pairing":
            text = await cli_ops.pairing_list(cfg, base)
        elif args.command == "sessions":
            text = await cli_ops.sessions(cfg, base, args.limit)
        elif args.command == "usage":
            text = await cli_ops.usage(cfg, base, args.days)
        elif args.command == "config-reset":
            text = await cli_ops.config_reset(cfg, base, args.key)
        else:
            text = await cli_ops.memory(cfg, base, args.scope)
    except cli_ops.CliError as err:
        say(str(err))
        return 1
    say(text, sys.stdout)
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("chat-gateway")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown (not installed)"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def _quiet_broken_streams() -> None:
    """At exit Python flushes stdout and stderr; one whose reader went away would print
    "Exception ignored … BrokenPipeError" and turn the exit code into 120."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            with contextlib.suppress(OSError, ValueError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, stream.fileno())
                os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        _quiet_broken_streams()


CONFIG_HELP = "the config file (default: ./config.json, else the built-in defaults)"


def build_parser() -> argparse.ArgumentParser:
    """Every command and option, each with the words `--help` shows."""
    parser = argparse.ArgumentParser(prog="gateway", description="A chatbot gateway with a real context engine.")
    parser.add_argument("--version", action="version", version=f"gateway {_version()}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    def command(name: str, help_text: str, where: argparse._SubParsersAction = sub) -> argparse.ArgumentParser:
        found: argparse.ArgumentParser = where.add_parser(name, help=help_text, description=help_text)
        found.add_argument("--config", type=Path, default=None, metavar="PATH", help=CONFIG_HELP)
        return found

    command("run", "run every enabled channel, the web chat, the admin page and the scheduled jobs")
    command("chat", "chat in this terminal on the same engine (session terminal:local, an admin); "
                    "runs the terminal only")
    check = command("check-config", "validate a config file as `run` would and list every problem with its key")
    check.add_argument("path", type=Path, nargs="?", default=None, metavar="PATH",
                       help="the config file (the same as --config; default: ./config.json)")
    pairing = sub.add_parser("pairing", help="pairing: codes waiting for approval, approve one, revoke a person",
                             description="People who wrote to the bot and got a pairing code (access.dm_policy "
                                         "pairing), and the people approved so far.")
    actions = pairing.add_subparsers(dest="action", required=True, title="actions", metavar="ACTION")
    command("list", "codes waiting for approval (who, code, age) and the people approved", actions)
    approve = command("approve", "approve a code: the person can chat from their next message", actions)
    approve.add_argument("code", help="the 8-character code the person was given, e.g. ABCD2345")
    revoke = command("revoke", "take a person's approval back: their next message gets a new pairing code",
                     actions)
    revoke.add_argument("who", metavar="ID", help="the person as pairing list names them, e.g. telegram:7")
    sessions = command("sessions", "recent sessions: key, whose, last activity, turns, tokens today")
    sessions.add_argument("--limit", type=_positive, default=20, help="how many (default 20)")
    usage = command("usage", "tokens the model counted, per day and person")
    usage.add_argument("--days", type=_positive, default=7, help="how many days back (default 7)")
    memory = command("memory", "where a scope's memory files are (MEMORY.md, memory/, dialog/), with sizes")
    memory.add_argument("scope", nargs="?", default=None,
                        help="a person (telegram:7), a scope (telegram:user:7) or a session key; "
                             "none: list the scopes")
    command("web-link", "print the link that signs a browser in to the web chat (it holds the web token)")
    reset = command("config-reset", "give a setting changed with /config back to the gateways' config files "
                                    "(several gateways on PostgreSQL); without KEY, list the chat changes in effect")
    reset.add_argument("key", nargs="?", default=None, help="the setting, e.g. agent_max_context_tokens")
    return parser


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    command_name = args.command or "run"
    try:
        if command_name == "check-config":
            if args.path is not None and args.config is not None and args.path != args.config:
                parser.error("check-config: give the file once (PATH or --config PATH)")
            args.config = args.path or args.config or DEFAULT_CONFIG
            return _check(args.config)
        if command_name == "run":
            return asyncio.run(_run(getattr(args, "config", None)))
        if command_name == "chat":
            return asyncio.run(_chat(args.config))
        if command_name == "web-link":
            return _web_link(args.config)
        if command_name in ("pairing", "sessions", "usage", "memory", "config-reset"):
            return asyncio.run(_operator(args))
    except ConfigError as err:
        _print_problems(_config_file(getattr(args, "config", None)), err)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
