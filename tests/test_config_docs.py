"""docs/configuration.md is generated from the config schema and must stay in sync with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.config import docs as config_docs
from gateway.config.changes import change_effect

ROOT = Path(__file__).resolve().parents[1]


def test_committed_page_matches_the_schema() -> None:
    page = ROOT / "docs" / "configuration.md"
    committed = page.read_text(encoding="utf-8") if page.exists() else ""
    assert committed == config_docs.render(), (
        f"docs/configuration.md is out of date with gateway/config/schema.py: run `{config_docs.REGENERATE}` "
        "and commit the result"
    )


def test_every_key_has_a_meaning_and_every_meaning_a_key() -> None:
    keys = {doc.key for doc in config_docs.config_keys()}
    missing = sorted(keys - config_docs.MEANINGS.keys())
    assert not missing, f"add a one-line meaning to MEANINGS in gateway/config/docs.py for: {missing}"
    unknown = sorted((config_docs.MEANINGS.keys() | config_docs.ALLOWED.keys()) - keys)
    assert not unknown, f"MEANINGS/ALLOWED in gateway/config/docs.py name keys the config does not have: {unknown}"
    blank = sorted(k for k, v in config_docs.MEANINGS.items() if not v.strip())
    assert not blank, f"empty meanings: {blank}"


def _leaves(data: Any, prefix: str = "") -> set[str]:
    if isinstance(data, dict) and data:
        return set().union(*(_leaves(v, f"{prefix}{k}.") for k, v in data.items()))
    return {prefix[:-1]}


def test_every_key_of_the_shipped_config_is_documented() -> None:
    # config.json lists every key with its default: a second source the walk must agree with.
    shipped = _leaves(json.loads((ROOT / "config.json").read_text(encoding="utf-8")))
    documented = {doc.key for doc in config_docs.config_keys()}
    assert shipped - documented == set()


def test_rows_carry_defaults_ranges_enums_and_change_effects() -> None:
    rows = {doc.key: doc for doc in config_docs.config_keys()}
    assert rows["http.port"].allowed == "integer 0–65535"
    assert rows["http.port"].default == 8080
    assert rows["agent_max_context_tokens"].allowed == "integer ≥ 256"
    assert rows["model.timeout_s"].allowed == "number > 0"
    assert rows["access.dm_policy"].allowed == '`"open"` / `"allowlist"` / `"pairing"`'
    assert rows["model.api_key"].default == "${OPENAI_API_KEY}"  # a secret's default is shown, not masked
    assert rows["limits.tokens_per_user_per_day"].allowed == "integer ≥ 1, or `null`"
    # A nullable section is a key of its own, and its keys are listed as they are when it is set.
    assert rows["summary_model"].default is None
    assert rows["summary_model.max_output_tokens"].default == 4096
    for key, doc in rows.items():
        assert doc.effect == change_effect(key)
    assert not rows["channels.telegram.token"].chat and not rows["model.base_url"].chat
    assert rows["agent_max_context_tokens"].chat


def test_page_says_how_a_change_applies() -> None:
    page = config_docs.render()
    assert "| `http.port` | `8080` | integer 0–65535 | after a restart |" in page
    assert "| `channels.telegram.mode` | `\"polling\"` | `\"polling\"` / `\"webhook\"` | restarts the channel |" in page
    assert "| `agent_max_context_turns` | `20` | integer ≥ 1 | live |" in page
    # The shipped file's env references are named next to the schema default.
    assert '`null` (config.json: `"${TELEGRAM_BOT_TOKEN}"`)' in page


def test_check_flag_reports_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "configuration.md"
    monkeypatch.setattr(config_docs, "DOC_PATH", page)
    monkeypatch.setattr(config_docs, "ROOT", tmp_path)
    page.write_text("# stale\n", encoding="utf-8")
    assert config_docs.main(["--check"]) == 1
    assert config_docs.REGENERATE in capsys.readouterr().err
    assert config_docs.main(["--write"]) == 0
    assert page.read_text(encoding="utf-8") == config_docs.render()
    assert config_docs.main(["--check"]) == 0


def test_module_prints_the_page() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway.config.docs"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out == config_docs.render()
