"""The model clients of the running config, and the tokenizers their budgets count with.

One `Models` object is built at the start and kept by the services; a reload that changes
a model's settings builds new clients (and tokenizers) and swaps them in with `replace`,
whole: a turn reads the clients of one decision step at a time, so it meets either the old
set or the new one, never a mix, and turns already talking to an old client finish on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from context.tokens import TokenCounter
from gateway.config.schema import Config, ModelConfig
from gateway.model.client import CallRecord, ModelClient
from gateway.model.replies import ModelReply
from gateway.model.slots import ModelSlots

OnCall = Callable[[CallRecord], None]
# What the clients are built from: a change of it rebuilds them.
ClientSettings = tuple[ModelConfig, ModelConfig | None, tuple[tuple[str, ModelConfig], ...]]


def client_settings(cfg: Config) -> ClientSettings:
    return cfg.model, cfg.summary_model, tuple(sorted((a, cfg.model_for(a)) for a in cfg.models))


def build_clients(cfg: Config, on_call: OnCall) -> dict[str, ModelClient]:
    """"main" (`model`), "summary" (`summary_model`), "alias:<name>" (each `models.<name>`)."""
    clients = {"main": ModelClient(cfg.model, on_call=on_call)}
    if cfg.summary_model is not None:
        clients["summary"] = ModelClient(cfg.summary_model, on_call=on_call)
    for alias in cfg.models:
        clients[f"alias:{alias}"] = ModelClient(cfg.model_for(alias), on_call=on_call)
    return clients


def alias_counters(cfg: Config) -> dict[str, TokenCounter]:
    """A tokenizer per model name the aliases use besides `model`'s (loading one takes a
    while: call it off the loop)."""
    names = {cfg.model_for(alias).name for alias in cfg.models} - {cfg.model.name}
    return {name: TokenCounter(name) for name in names}


class Models:
    """The running model clients by role, `model`'s tokenizer and the aliases' ones."""

    __slots__ = ("_clients", "_counter", "_counters", "settings")

    def __init__(self, clients: dict[str, ModelClient], counter: TokenCounter,
                 counters: dict[str, TokenCounter], settings: ClientSettings) -> None:
        self._clients = clients
        self._counter = counter
        self._counters = counters
        self.settings = settings  # what `clients` were built from

    @property
    def main(self) -> ModelClient:
        return self._clients["main"]

    @property
    def summary(self) -> ModelClient:
        return self._clients.get("summary") or self._clients["main"]

    @property
    def counter(self) -> TokenCounter:
        """`model`'s tokenizer."""
        return self._counter

    def clients(self) -> list[ModelClient]:
        return list(self._clients.values())

    def client_for(self, alias: str | None) -> ModelClient:
        """The client of model `alias` (`model`'s for None); `model`'s when a reload took it away."""
        if alias is None:
            return self._clients["main"]
        return self._clients.get(f"alias:{alias}") or self._clients["main"]

    def counter_for(self, model_name: str, main_name: str) -> TokenCounter:
        """The tokenizer of `model_name` (`main_name` is `model`'s name now)."""
        if model_name == main_name:
            return self._counter
        return self._counters.get(model_name, self._counter)

    def replace_counter(self, counter: TokenCounter) -> None:
        """`model`'s name changed: its tokenizer follows."""
        self._counter = counter

    def replace(self, clients: dict[str, ModelClient], counters: dict[str, TokenCounter],
                settings: ClientSettings) -> list[ModelClient]:
        """Swap in clients built from `settings` (and the aliases' tokenizers); the clients
        they replace, for the caller to close once the turns on them are done."""
        old = list(self._clients.values())
        self._clients, self._counters, self.settings = clients, counters, settings
        return old


class CurrentSummaryModel:
    """The summary model of the running config (also after a reload swapped the clients),
    within the cap on concurrent model calls: what the nightly consolidation calls."""

    def __init__(self, models: Models, slots: ModelSlots) -> None:
        self._models = models
        self._slots = slots

    async def complete(self, messages: list[dict[str, Any]]) -> ModelReply:
        async with self._slots:
            return await self._models.summary.complete(messages)
