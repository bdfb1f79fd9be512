"""The Discord channel's pure parts: a discord.py `Message` (built by discord.py itself from
the payload the fake Discord would dispatch) as an `Inbound`, and Markdown in Discord-sized
messages."""

from __future__ import annotations

import itertools
import re
from typing import Any

import discord
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from channels.discord.format import DISCORD_TEXT_LIMIT, render_markdown, split_message, to_discord
from channels.discord.messages import BotIdentity, Place, parse_message, place_of_channel, place_of_payload
from tests.fakes.discord_server import FakeDiscord

FAKE = FakeDiscord()  # only its payloads: never started
ME = BotIdentity(FAKE.bot_id, FAKE.bot_name)
PERSON = 4242


@pytest.fixture(scope="module")
def state() -> Any:
    client = discord.Client(intents=discord.Intents(guilds=True, guild_messages=True, dm_messages=True,
                                                    message_content=True))
    state = client._connection
    state._add_guild(discord.Guild(data=FAKE._guild_create(), state=state))  # type: ignore[arg-type]
    return state


def message(state: Any, **push: Any) -> discord.Message:
    """The message the fake would dispatch for `push_message(**push)`, as discord.py builds it."""
    mid = FAKE.push_message(**{"user_id": PERSON, **push})
    data = FAKE.messages[mid]
    channel = discord.PartialMessageable(state=state, id=int(data["channel_id"]),
                                         guild_id=int(data["guild_id"]) if "guild_id" in data else None)
    return discord.Message(state=state, channel=channel, data=data)  # type: ignore[arg-type]


def in_channel() -> Place:
    return Place("channel", FAKE.channel_id)


# ---------------------------------------------------------------------------- messages


def test_a_dm(state: Any) -> None:
    msg = message(state, content="hello there", dm=True)
    parsed = parse_message(msg, ME, Place("dm", msg.channel.id))
    assert parsed is not None
    inbound = parsed.inbound
    assert (inbound.channel, inbound.chat_id, inbound.user_id, inbound.is_group) == ("discord", str(PERSON),
                                                                                    str(PERSON), False)
    assert inbound.event_id == inbound.message_id == str(msg.id)
    assert inbound.extra == {"channel_id": str(msg.channel.id)}
    assert inbound.text == "hello there" and inbound.user_name == f"User {PERSON}"


@pytest.mark.parametrize("form", ["<@{id}>", "<@!{id}>"])
def test_a_mention_addresses_the_bot_and_a_command_follows_it(state: Any, form: str) -> None:
    tag = form.format(id=ME.id)
    parsed = parse_message(message(state, content=f"{tag} /context", mentions=(ME.id,)), ME, in_channel())
    assert parsed is not None
    assert parsed.inbound.mentioned and parsed.inbound.text == "/context" and parsed.inbound.is_group
    assert parsed.inbound.chat_id == str(FAKE.channel_id) and parsed.inbound.thread_id is None
    assert parsed.inbound.extra["guild_id"] == str(FAKE.guild_id)
    middle = parse_message(message(state, content=f"hey {tag} there", mentions=(ME.id,)), ME, in_channel())
    assert middle is not None and middle.inbound.text == "hey there"


def test_the_bots_own_role_is_a_mention_other_mentions_read_as_names(state: Any) -> None:
    text = f"<@&{FAKE.role_id}> ask <@{PERSON + 1}> about <:party:123456> in <#{FAKE.channel_id}>"
    parsed = parse_message(message(state, content=text, mentions=(PERSON + 1,), role_mentions=(FAKE.role_id,)),
                           ME, in_channel())
    assert parsed is not None and parsed.inbound.mentioned
    assert parsed.inbound.text == f"ask @User {PERSON + 1} about :party: in #general"
    plain = parse_message(message(state, content="no one is called"), ME, in_channel())
    assert plain is not None and not plain.inbound.mentioned and not plain.inbound.reply_to_bot


def test_a_reply_to_the_bot(state: Any) -> None:
    ours = FAKE.push_message(user_id=ME.id, content="an answer", bot=True)
    FAKE.messages[ours]["author"] = FAKE.me
    theirs = FAKE.push_message(user_id=PERSON + 2, content="someone else")
    to_bot = parse_message(message(state, content="more please", reply_to=ours), ME, in_channel())
    to_other = parse_message(message(state, content="agreed", reply_to=theirs), ME, in_channel())
    assert to_bot is not None and to_bot.inbound.reply_to_bot and not to_bot.inbound.mentioned
    assert to_other is not None and not to_other.inbound.reply_to_bot


def test_bots_webhooks_system_messages_and_empty_ones_are_no_turns(state: Any) -> None:
    assert parse_message(message(state, content="beep", bot=True), ME, in_channel()) is None
    own = message(state, user_id=ME.id, content="my own words")
    assert parse_message(own, ME, in_channel()) is None
    hooked = FAKE.push_message(user_id=PERSON, content="from a webhook")
    FAKE.messages[hooked]["webhook_id"] = "55"
    channel = discord.PartialMessageable(state=state, id=FAKE.channel_id, guild_id=FAKE.guild_id)
    assert parse_message(discord.Message(state=state, channel=channel, data=FAKE.messages[hooked]),
                         ME, in_channel()) is None
    joined = FAKE.push_message(user_id=PERSON, content="")
    FAKE.messages[joined]["type"] = 7  # "joined the server"
    assert parse_message(discord.Message(state=state, channel=channel, data=FAKE.messages[joined]),
                         ME, in_channel()) is None
    assert parse_message(message(state, content="   "), ME, in_channel()) is None


def test_a_thread_message_belongs_to_its_parent_channel(state: Any) -> None:
    thread = FAKE.add_thread(FAKE.channel_id)
    parsed = parse_message(message(state, channel_id=thread, content="in the thread"), ME,
                           Place("thread", thread, FAKE.channel_id))
    assert parsed is not None
    assert (parsed.inbound.chat_id, parsed.inbound.thread_id) == (str(FAKE.channel_id), str(thread))
    assert parsed.inbound.extra["channel_id"] == str(thread)


def test_attachments(state: Any) -> None:
    image = FAKE.add_file("cat.PNG", b"png", "image/png", width=10, height=10)
    voice = FAKE.add_file("voice-message.ogg", b"ogg", "audio/ogg", duration_secs=3.5, waveform="AAAA")
    other = FAKE.add_file("report.pdf", b"pdf", "application/pdf")
    parsed = parse_message(message(state, content="", dm=True, attachments=[image, voice, other], flags=0),
                           ME, Place("dm", 1))
    assert parsed is not None and parsed.inbound.text == ""
    kinds = [(f.name, f.kind, f.mime, f.size, f.duration_s) for f in parsed.files]
    assert kinds == [("cat.PNG", "image", "image/png", 3, None), ("voice-message.ogg", "voice", "audio/ogg", 3, 3.5),
                     ("report.pdf", "file", "application/pdf", 3, None)]
    many = parse_message(message(state, content="lots", dm=True, attachments=[other] * 14), ME, Place("dm", 1))
    assert many is not None and len(many.files) == 10


def test_hostile_text_is_cleaned_never_raised(state: Any) -> None:
    parsed = parse_message(message(state, content="bad \ud800 bytes\x00 here", dm=True), ME, Place("dm", 1))
    assert parsed is not None and parsed.inbound.text == "bad ? bytes here"
    assert parse_message(object(), ME, Place("dm", 1)) is None  # type: ignore[arg-type]


def test_places() -> None:
    assert place_of_payload({"id": "5", "type": 11, "parent_id": "7"}) == Place("thread", 5, 7)
    assert place_of_payload({"id": "5", "type": 1}) == Place("dm", 5)
    assert place_of_payload({"id": "5", "type": 0}) == Place("channel", 5)
    assert place_of_payload({"id": "5", "type": 11}) is None  # a thread without its parent
    assert place_of_payload({"id": "x", "type": 0}) is None
    assert place_of_payload(["not", "a", "channel"]) is None
    assert place_of_channel(object()) is None


# ---------------------------------------------------------------------------- format


def test_short_replies_go_as_they_are() -> None:
    text = "**Bold**, _it_, `code`, ~~gone~~, > quote\n- a\n- b\n### Heading"
    assert render_markdown(text) == [text]
    assert render_markdown("  \n ") == []


def test_what_discord_does_not_render_is_rewritten() -> None:
    table = "| name | 数量 |\n|:-----|-----:|\n| **tea** | 2 |\n| [coffee](http://x.example) | 10 |"
    assert to_discord(table) == ("```\nname                      | 数量\n"
                                 "--------------------------+-----\n"
                                 "tea                       | 2\n"
                                 "coffee (http://x.example) | 10\n```")
    assert to_discord("#### Details ####") == "**Details**"
    assert to_discord("see ![a chart](http://x.example/c.png) and ![](http://x.example/d.png)") == \
        "see [a chart](http://x.example/c.png) and http://x.example/d.png"
    fenced = "```\n| a | b |\n|---|---|\n#### not a heading\n```"
    assert to_discord(fenced) == fenced  # code is never touched


def test_long_text_is_cut_at_paragraphs_and_code_blocks_reopen() -> None:
    prose = "\n\n".join(" ".join(f"w{p}.{i}" for i in range(150)) for p in range(6))
    code = "\n".join(f"value_{i} = compute({i})" for i in range(200))
    text = f"{prose}\n\n```python\n{code}\n```\n\nDone."
    chunks = split_message(text)
    assert all(len(chunk) <= DISCORD_TEXT_LIMIT for chunk in chunks)
    assert all(chunk.count("```") % 2 == 0 for chunk in chunks)
    inside = [c for c in chunks if "value_" in c]
    assert len(inside) >= 2 and all(c.startswith("```python\n") or "\n```python\n" in c for c in inside)
    assert all(c.endswith("\n```") for c in inside[:-1])
    assert chunks[-1].endswith("Done.")
    rebuilt = re.sub(r"```(python)?", "", "".join(chunks))
    assert re.sub(r"\s", "", rebuilt) == re.sub(r"\s", "", re.sub(r"```(python)?", "", text))


@pytest.mark.parametrize("unit", ["🇩🇪", "👩\u200d💻", "e\u0301", "👍🏽", "❤\ufe0f"])
def test_a_word_longer_than_a_message_is_never_cut_inside_a_character(unit: str) -> None:
    text = unit * (5000 // len(unit))
    chunks = split_message(text)
    assert len(chunks) >= 2 and all(len(c) <= DISCORD_TEXT_LIMIT for c in chunks)
    assert all(len(c) % len(unit) == 0 and c == unit * (len(c) // len(unit)) for c in chunks)


_words = st.lists(st.sampled_from([*"ab数🙂 \n", "e\u0301", "👩\u200d💻"]), max_size=60).map("".join)


@settings(max_examples=60, deadline=None)
@given(words=st.lists(_words, max_size=200), limit=st.integers(min_value=40, max_value=300))
def test_splitting_keeps_every_character_within_the_limit(words: list[str], limit: int) -> None:
    text = " ".join(words)
    chunks = split_message(text, limit)
    assert all(0 < len(chunk) <= limit for chunk in chunks)
    for before, after in itertools.pairwise(chunks):  # never inside an accent or a ZWJ sequence
        assert not after.startswith(("\u0301", "\u200d")) and not before.endswith("\u200d")
    assert re.sub(r"\s", "", "".join(chunks)) == re.sub(r"\s", "", text)


@settings(max_examples=60, deadline=None)
@given(blocks=st.lists(st.tuples(st.booleans(), st.text(alphabet="xy \n", max_size=400)), max_size=12),
       limit=st.integers(min_value=60, max_value=400))
def test_every_message_closes_the_code_blocks_it_opens(blocks: list[tuple[bool, str]], limit: int) -> None:
    text = "\n".join(f"```sh\n{body}\n```" if code else body for code, body in blocks)
    for chunk in split_message(text, limit):
        assert len(chunk) <= limit
        fences = [line for line in chunk.split("\n") if line.lstrip().startswith("```")]
        assert len(fences) % 2 == 0, chunk
