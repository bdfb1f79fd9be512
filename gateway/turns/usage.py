"""Per-user daily budgets (`limits.turns_per_user_per_day`, `limits.tokens_per_user_per_day`)."""

from __future__ import annotations

from gateway.access import is_admin
from gateway.clock import local_day
from gateway.config.schema import Config
from gateway.store.api import StoreBackend


def today(cfg: Config) -> str:
    return local_day(cfg.timezone)[0]


class Usage:
    """Reads today's counts; a turn is counted by `Store.end_turn` when it is answered."""

    def __init__(self, store: StoreBackend) -> None:
        self.store = store

    async def get(self, cfg: Config, identity: str) -> tuple[int, int]:
        rows = await self.store.run(
            "SELECT turns, tokens FROM usage WHERE identity=? AND day=?", (identity, today(cfg))
        )
        return (int(rows[0][0]), int(rows[0][1])) if rows else (0, 0)

    async def refusal(self, cfg: Config, identity: str) -> str | None:
        """A polite reply when the person used up today's budget; None when within it."""
        limits = cfg.limits
        if limits.turns_per_user_per_day is None and limits.tokens_per_user_per_day is None:
            return None
        if is_admin(cfg, identity):
            return None
        turns, tokens = await self.get(cfg, identity)
        if limits.turns_per_user_per_day is not None and turns >= limits.turns_per_user_per_day:
            return (f"You have reached today's limit of {limits.turns_per_user_per_day} messages. "
                    "It resets at midnight; see you tomorrow!")
        if limits.tokens_per_user_per_day is not None and tokens >= limits.tokens_per_user_per_day:
            return (f"You have used today's budget of {limits.tokens_per_user_per_day:,} tokens. "
                    "It resets at midnight; see you tomorrow!")
        return None

    async def month(self, cfg: Config, identity: str) -> tuple[int, int]:
        """(turns, tokens) of this calendar month so far, in the configured zone."""
        first = today(cfg)[:8] + "01"
        rows = await self.store.run(
            "SELECT coalesce(sum(turns), 0), coalesce(sum(tokens), 0) FROM usage WHERE identity=? AND day >= ?",
            (identity, first))
        return (int(rows[0][0]), int(rows[0][1])) if rows else (0, 0)

    async def report(self, cfg: Config, identity: str) -> str:
        """/usage (SPEC §6): today and this month, and what the daily budgets leave."""
        turns, tokens = await self.get(cfg, identity)
        month_turns, month_tokens = await self.month(cfg, identity)
        lines = [f"Today: {turns} message{'s' if turns != 1 else ''}, {tokens:,} tokens.",
                 f"This month: {month_turns} message{'s' if month_turns != 1 else ''}, {month_tokens:,} tokens."]
        limits = cfg.limits
        if is_admin(cfg, identity):
            lines.append("Daily budgets do not apply to admins.")
        elif limits.turns_per_user_per_day is None and limits.tokens_per_user_per_day is None:
            lines.append("There is no daily budget here.")
        else:
            left = []
            if limits.turns_per_user_per_day is not None:
                left.append(f"{max(0, limits.turns_per_user_per_day - turns)} of {limits.turns_per_user_per_day} "
                            "messages")
            if limits.tokens_per_user_per_day is not None:
                left.append(f"{max(0, limits.tokens_per_user_per_day - tokens):,} of "
                            f"{limits.tokens_per_user_per_day:,} tokens")
            lines.append("Left today: " + " and ".join(left) + ".")
        return "\n".join(lines)

    async def describe(self, cfg: Config, identity: str) -> str:
        turns, tokens = await self.get(cfg, identity)
        limits = cfg.limits
        t_lim = f" of {limits.turns_per_user_per_day}" if limits.turns_per_user_per_day else ""
        k_lim = f" of {limits.tokens_per_user_per_day:,}" if limits.tokens_per_user_per_day else ""
        return f"Your usage today: {turns}{t_lim} messages, {tokens:,}{k_lim} tokens."
