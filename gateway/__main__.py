"""CLI: `python -m gateway run | chat | check-config | pairing approve CODE`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import signal
import sys
from pathlib import Path

from gateway.config import Config, ConfigError, config_warnings, load_config, parse_config, startup_problems
from gateway.logs import setup_logging

DEFAULT_CONFIG = Path("config.json")


def _load(path: Path | None) -> tuple[Config, Path | None]:
    """The config file, or the embedded defaults when none exists at the default path."""
    if path is None:
        if not DEFAULT_CONFIG.exists():
            return parse_config({}), None  # the defaults, their `${ENV}` secrets expanded
        path = DEFAULT_CONFIG
    return load_config(path), path.resolve()


def _print_problems(path: Path | None, err: ConfigError) -> None:
    print(f"config {path or '(defaults)'} has {len(err.problems)} problem(s):", file=sys.stderr)
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


async def _run(path: Path | None) -> int:
    from gateway.app import Gateway, StartupError
    from gateway.reload import ConfigWatcher

    cfg, cfg_path = _load(path)
    setup_logging(cfg.log_level)
    gateway = Gateway(cfg, config_path=cfg_path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(NotImplementedError, AttributeError):
        loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)  # `kill -USR1 <pid>`: what is everything waiting on?
    try:
        await gateway.start()
    except StartupError as err:
        print(f"cannot start: {err}", file=sys.stderr)
        await gateway.stop()
        return 2
    except BaseException:
        # Whatever started (HTTP server, channels) must stop, or the process hangs on them.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(gateway.stop(timeout=5), timeout=30)
        raise
    if cfg_path is not None:
        gateway.watcher = ConfigWatcher(gateway)
        await gateway.watcher.start()
    # What exists now (imported modules, the config, the app) lives as long as the process.
    # Frozen, it is left out of the collector's full scans, which otherwise stop the event
    # loop for 40-100 ms now and then under load (measured with gc.callbacks).
    gc.collect()
    gc.freeze()
    host, port = cfg.http.host, gateway.http.port if gateway.http else cfg.http.port
    print(f"gateway running: web chat on http://{host}:{port}/  (Ctrl+C to stop)", flush=True)
    await stop.wait()
    print("stopping…", file=sys.stderr, flush=True)
    await gateway.stop()
    return 0


async def _chat(path: Path | None) -> int:
    from channels.terminal import run_terminal

    cfg, cfg_path = _load(path)
    if not cfg.channels.terminal.enabled:
        print("the terminal chat is disabled (channels.terminal.enabled is false)", file=sys.stderr)
        return 2
    setup_logging("WARNING")
    return await run_terminal(cfg, cfg_path)


async def _approve(path: Path | None, code: str) -> int:
    from gateway.access import Pairing
    from gateway.store import Store

    cfg, cfg_path = _load(path)
    base = cfg_path.parent if cfg_path else Path.cwd()
    store = await Store.open(cfg.data_path(base) / "gateway.sqlite3")
    try:
        identity = await Pairing(store).approve(code, approved_by="cli")
    finally:
        await store.close()
    if identity is None:
        print("That code is unknown or expired.", file=sys.stderr)
        return 1
    print(f"Approved {identity}.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway", description="A chatbot gateway with a real context engine.")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run every enabled channel and the web chat")
    run.add_argument("--config", type=Path, default=None, help="config file (default: ./config.json)")
    chat = sub.add_parser("chat", help="chat in this terminal on the same engine")
    chat.add_argument("--config", type=Path, default=None)
    check = sub.add_parser("check-config", help="validate a config file and list every problem")
    check.add_argument("path", type=Path, nargs="?", default=DEFAULT_CONFIG)
    pairing = sub.add_parser("pairing", help="approve a pairing code")
    pairing_sub = pairing.add_subparsers(dest="action", required=True)
    approve = pairing_sub.add_parser("approve")
    approve.add_argument("code")
    approve.add_argument("--config", type=Path, default=None)
    args = parser.parse_args(argv)

    command = args.command or "run"
    try:
        if command == "check-config":
            return _check(args.path)
        if command == "run":
            return asyncio.run(_run(getattr(args, "config", None)))
        if command == "chat":
            return asyncio.run(_chat(args.config))
        if command == "pairing":
            return asyncio.run(_approve(args.config, args.code))
    except ConfigError as err:
        _print_problems(getattr(args, "config", None) or getattr(args, "path", None), err)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
