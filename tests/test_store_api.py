"""Both store backends provide every method of gateway/store/api.py's StoreBackend with
the same parameters (names, kinds, defaults), sync or async alike; and every public
method of the SQLite store is in the protocol, so one added there must be added to
PostgreSQL's too."""

from __future__ import annotations

import inspect

import pytest

from gateway.store.api import StoreBackend
from gateway.store.postgres import PgStore
from gateway.store.sqlite import Store

CONSTRUCTORS = {"open"}  # each backend opens from its own kind of address


def protocol_methods() -> list[str]:
    return sorted(name for name, value in vars(StoreBackend).items()
                  if not name.startswith("_") and inspect.isfunction(value))


def public_methods(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_") and name not in CONSTRUCTORS
            and inspect.isfunction(getattr(cls, name))}


def shape(fn: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", [Store, PgStore])
@pytest.mark.parametrize("name", protocol_methods())
def test_each_backend_has_the_protocol_method_with_its_parameters(backend: type, name: str) -> None:
    wanted = getattr(StoreBackend, name)
    got = getattr(backend, name, None)
    assert got is not None, f"{backend.__name__} lacks {name}"
    assert shape(got) == shape(wanted), f"{backend.__name__}.{name}{inspect.signature(got)}"
    assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(wanted)


def test_every_public_method_of_the_sqlite_store_is_in_the_protocol() -> None:
    assert public_methods(Store) - set(protocol_methods()) == set()
    assert len(protocol_methods()) >= 40
