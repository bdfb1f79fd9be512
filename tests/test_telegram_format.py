"""Markdown → Telegram: what the person finally sees keeps every character of the reply
that is not Markdown markup (`<`, `>`, `&` included), in messages Telegram accepts.

The visible text is computed by the fake Bot API's own reader (tests/fakes/telegram_text.py),
not by the formatter under test.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from telegram import Bot, MessageEntity
from telegram.error import BadRequest
from telegramify_markdown import converter

from channels.telegram import format as telegram_format
from channels.telegram.format import TELEGRAM_TEXT_LIMIT, render_markdown, render_text
from tests.conftest import GatewayFactory
from tests.fakes import telegram_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.telegram_server import FakeTelegram
from tests.fakes.telegram_text import EntityError, parse_html, parse_markdown_v2, parse_message, utf16_len

fake_telegram = telegram_server.fake_telegram  # the fixture


def shown(markdown: str, limit: int = TELEGRAM_TEXT_LIMIT) -> list[str]:
    """The visible text of each message the gateway would send for `markdown`; every
    message must be one Telegram accepts."""
    texts = []
    for chunk in render_markdown(markdown, limit=limit):
        parsed = parse_message(chunk.text, None, list(chunk.entities))
        assert 0 < utf16_len(parsed.text) <= limit
        texts.append(parsed.text)
    return texts


# ---------------------------------------------------------------------------- examples


@pytest.mark.parametrize(
    ("reply", "visible"),
    [
        ("List<String> names", "List<String> names"),
        ("a & <b>c</b>", "a & <b>c</b>"),
        ("& <tags>", "& <tags>"),
        ("x <br> y <!-- note --> z", "x <br> y <!-- note --> z"),
        # A line holding only a tag is an HTML block: it used to take the paragraph with it.
        ("<String>\nnext line\n\nlast", "<String>\nnext line\n\nlast"),
        ("<div>\nhi\n</div>", "<div>\nhi\n</div>"),
        ("> quoted <i>tag</i>", "quoted <i>tag</i>"),
        ("[see <T>](https://example.org)", "see <T>"),
        ("||a <secret>||", "a <secret>"),
        ("costs $5<b>x$6", "costs $5<b>x$6"),
    ],
)
def test_raw_html_in_a_reply_is_shown_as_written(reply: str, visible: str) -> None:
    assert shown(reply) == [visible]


def test_a_misplaced_spoiler_never_shows_its_tag() -> None:
    # The converter's ||spoiler|| rewrite ignores block boundaries; here its tags landed
    # inside a code span and were shown as "<tg-spoiler>" in place of the bars.
    [text] = shown("`||\n# `||")
    assert "tg-spoiler" not in text and text.count("`||") == 2
    [chunk] = render_markdown("a ||secret|| b")
    assert chunk.text == "a secret b" and chunk.entities[0]["type"] == "spoiler"


def test_the_html_pass_reads_markdown_like_the_converter() -> None:
    # Otherwise the pass could miss HTML the converter sees (and drops).
    assert telegram_format._MD_OPTIONS == converter.STANDARD_OPTIONS


def test_code_autolinks_and_formatting_are_untouched() -> None:
    reply = "Use `Map<K, V>` or\n\n```java\nList<String> xs;\n```\n\n**bold** <https://example.org>"
    [chunk] = render_markdown(reply)
    assert chunk.text == "Use Map<K, V> or\n\nList<String> xs;\n\nbold https://example.org"
    kinds = {e["type"]: e for e in chunk.entities}
    assert kinds["code"]["length"] == len("Map<K, V>")
    assert kinds["pre"]["language"] == "java"
    assert kinds["text_link"]["url"] == "https://example.org"
    assert "bold" in kinds


def test_long_replies_full_of_escapable_characters_fit_after_parsing() -> None:
    line = "if a<b && c>d { return List<Map<K,V>>; } // 漢字 👨‍👩‍👧 &amp"
    reply = "\n".join(f"{i}: {line}" for i in range(300))
    reply += "\n\n```cpp\n" + "\n".join(f"x<{i}> && y;" for i in range(400)) + "\n```\n"
    texts = shown(reply)
    assert len(texts) >= 4
    assert all(utf16_len(t) <= TELEGRAM_TEXT_LIMIT for t in texts)
    joined = re.sub(r"\s+", "", "".join(texts))
    for i in range(300):
        assert f"{i}:{line.replace(' ', '')}" in joined
    assert joined.count("&&y;") == 400


# ---------------------------------------------------------------------------- property

# Markdown constructs that legitimately hide letters are kept out of the random text:
# link destinations (no "](" in plain text), reference definitions, autolinks and entity
# references (no ":", "@" or ";"), task-list "[x]" (no x), fence info strings (no runs of
# three backticks or tildes) and table delimiter rows (GFM drops cells past the header's).
LETTERS = "abcdefghijklmnopqrstuvwyzABCDEFGHIJKLMNOPQRSTUVWYZéßж"
CJK = ["漢字", "日本語", "한국어", "中"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧", "❤️", "🇺🇦"]
MARKDOWN = [*"*_`[]()~|#+-={}.!", "**", "__", "~~", "||", "# ", "- ", "+ ", "1. ", "> ", "---"]
HTMLISH = ["<", ">", "&", "<b>", "</b>", "<String>", "<div>", "</div>", "<br/>", "<!--", "-->",
           "<a href=x>", "<i", "&amp", "List<T>", "a<b", "b>c"]
SPACE = [" ", " ", "\n", "\n\n", "    "]
DIGITS = list("0179")
EMOJI_CHARS = frozenset("".join(EMOJI))


def checked(c: str) -> bool:
    """Characters that are never Markdown markup here and must reach the person."""
    return c.isalpha() or c in "<>&" or c in EMOJI_CHARS


units = st.sampled_from(list(LETTERS)) | st.sampled_from(CJK + EMOJI + MARKDOWN + HTMLISH + SPACE + DIGITS)
words = st.lists(units, min_size=1, max_size=25).map("".join)

PLAIN, CODE, MARKUP = "plain", "code", "markup"


@dataclass
class Reply:
    text: str
    kinds: list[str]  # per character: PLAIN, CODE (literal) or MARKUP (may vanish)


def _no_fences(text: str) -> str:
    return re.sub(r"([`~])(?=\1\1)", r"\1 ", text)


def _plain(text: str) -> str:
    return _no_fences(text).replace("](", "] (")


@st.composite
def replies(draw: st.DrawFn) -> Reply:
    pieces: list[tuple[str, str]] = []
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["plain", "plain", "plain", "code", "fence", "link"]))
        if kind == "plain":
            pieces.append((_plain(draw(words)), PLAIN))
        elif kind == "code":
            body = draw(words.filter(lambda w: "`" not in w and "\n" not in w))
            pieces += [("`", MARKUP), (body, CODE), ("`", MARKUP)]
        elif kind == "fence":
            lang = draw(st.sampled_from(["", "py", "java", "cpp"]))
            body = _no_fences(draw(words)).strip("\n") or "z"
            pieces += [(f"\n```{lang}\n", MARKUP), (body, CODE), ("\n```\n", MARKUP)]
        else:
            label = draw(st.lists(st.sampled_from(list(LETTERS) + CJK + EMOJI + [" ", "<", ">", "&", "<T>"]),
                                  min_size=1, max_size=6).map("".join))
            path = draw(st.text(alphabet="abcdef", max_size=5))
            pieces += [("[", MARKUP), (label, PLAIN), (f"](https://example.org/{path})", MARKUP)]
        pieces.append((draw(st.sampled_from([" ", "\n", "\n\n"])), MARKUP))
    text = "".join(t for t, _ in pieces)
    kinds = [k for t, k in pieces for _ in t]
    return _without_table_rows(Reply(text, kinds))


def _without_table_rows(reply: Reply) -> Reply:
    """A letter at the end of every line that could be a GFM table delimiter row."""
    out: list[str] = []
    kinds: list[str] = []
    start = 0
    for line in reply.text.split("\n"):
        end = start + len(line)
        out.append(line)
        kinds += reply.kinds[start:end]
        in_code = any(k == CODE for k in reply.kinds[start:end])
        if not in_code and "|" in line and "-" in line and re.fullmatch(r"[\s|:\->*+.)0-9]*", line):
            out.append("k")
            kinds.append(PLAIN)
        out.append("\n")
        kinds.append(MARKUP)
        start = end + 1
    return Reply("".join(out)[:-1], kinds[:-1])


_QUOTE_PREFIX = re.compile(r"[ >*+\-0-9.)]*")


def expected_sequence(reply: Reply) -> list[tuple[str, bool]]:
    """(character, required) for every checked character of the reply, in order. Markup
    may or may not show (a stray backtick pair can turn a link's source into code), and a
    `>` with nothing but container markers before it on its line may be a blockquote
    marker: those are optional."""
    seq: list[tuple[str, bool]] = []
    line_start = 0
    for i, (c, kind) in enumerate(zip(reply.text, reply.kinds, strict=True)):
        if c == "\n":
            line_start = i + 1
        if not checked(c):
            continue
        optional = kind == MARKUP or (
            c == ">" and kind == PLAIN and _QUOTE_PREFIX.fullmatch(reply.text[line_start:i]) is not None)
        seq.append((c, not optional))
    return seq


def matches(expected: list[tuple[str, bool]], visible: str) -> bool:
    """`visible` is `expected` with every required character and some optional ones."""
    m = len(visible)
    # can[j]: expected[i:] can produce visible[j:], computed from the end backwards.
    can = [False] * m + [True]
    for c, required in reversed(expected):
        nxt = can
        can = [(not required and nxt[j]) or (j < m and visible[j] == c and nxt[j + 1])
               for j in range(m + 1)]
    return can[0]


@settings(max_examples=300, deadline=None)
@given(reply=replies(), limit=st.sampled_from([TELEGRAM_TEXT_LIMIT, TELEGRAM_TEXT_LIMIT, 200, 40]))
def test_every_character_that_is_not_markup_reaches_the_person(reply: Reply, limit: int) -> None:
    visible = "".join(c for text in shown(reply.text, limit) for c in text if checked(c))
    expected = expected_sequence(reply)
    want = "".join(c if required else f"({c})" for c, required in expected)
    assert matches(expected, visible), f"\nreply:    {reply.text!r}\nexpected: {want!r}\nvisible:  {visible!r}"



@settings(max_examples=200, deadline=None)
@given(reply=replies())
def test_a_streamed_messages_plain_text_is_the_rendered_text(reply: Reply) -> None:
    """render_text (a streamed message's interim text) reads exactly like the rendered
    reply without its formatting, only cheaper."""
    chunks = render_markdown(reply.text, limit=sys.maxsize)
    assert render_text(reply.text).strip() == "\n".join(c.text for c in chunks).strip() or len(chunks) > 1


# ---------------------------------------------------------------------------- the fake reads like Telegram


def test_fake_reads_html_like_telegram() -> None:
    assert parse_html("a &lt;b&gt; &amp; &quot;q&quot; &#60;&#x3e; &copy; AT&T").text == 'a <b> & "q" <> &copy; AT&T'
    parsed = parse_html('<b>x</b> <a href="https://e.org/?a=1&amp;b=2">l</a> '
                        '<pre><code class="language-py">p</code></pre>')
    assert parsed.text == "x l p"
    assert parsed.entities == [
        {"type": "bold", "offset": 0, "length": 1},
        {"type": "text_link", "offset": 2, "length": 1, "url": "https://e.org/?a=1&b=2"},
        {"type": "pre", "offset": 4, "length": 1, "language": "py"},
    ]
    for bad, reason in [
        ("List<String> names", 'Unsupported start tag "string" at byte offset 4'),
        ("a < b", 'Unsupported start tag "" at byte offset 2'),
        ("<b>x", 'Can\'t find end tag corresponding to start tag "b"'),
        ("<b>x</i>", 'Unmatched end tag at byte offset 4, expected "</b>", found "</i>"'),
        ("x</b>", "Unexpected end tag at byte offset 1"),
        ("漢<br>", 'Unsupported start tag "br" at byte offset 3'),
    ]:
        with pytest.raises(EntityError) as err:
            parse_html(bad)
        assert str(err.value) == reason


def test_fake_reads_markdown_v2_like_telegram() -> None:
    parsed = parse_markdown_v2("*b* _i_ __u__ ~s~ ||sp|| [l](https://e.org/\\)) `c\\`` a\\.b\n>quote")
    assert parsed.text == "b i u s sp l c` a.b\nquote"
    assert [e["type"] for e in parsed.entities] == [
        "bold", "italic", "underline", "strikethrough", "spoiler", "text_link", "code", "blockquote"]
    assert parsed.entities[5]["url"] == "https://e.org/)"
    for bad, reason in [
        ("1. item", "Character '.' is reserved and must be escaped with the preceding '\\'"),
        ("a|b", "Character '|' is reserved and must be escaped with the preceding '\\'"),
        ("*open", "Can't find end of Bold entity at byte offset 0"),
        ("`code", "Can't find end of Code entity at byte offset 0"),
    ]:
        with pytest.raises(EntityError) as err:
            parse_markdown_v2(bad)
        assert str(err.value) == reason


async def test_fake_refuses_bad_markup_and_counts_length_after_parsing(fake_telegram: FakeTelegram) -> None:
    bot = Bot(fake_telegram.token, base_url=fake_telegram.base_url)
    async with bot:
        with pytest.raises(BadRequest, match=r"(?i)can't parse entities: unsupported start tag"):
            await bot.send_message(chat_id=5, text="List<String> names", parse_mode="HTML")
        with pytest.raises(BadRequest, match=r"(?i)can't parse entities: character '!' is reserved"):
            await bot.send_message(chat_id=5, text="hi!", parse_mode="MarkdownV2")
        with pytest.raises(BadRequest, match=r"(?i)can't parse entities"):
            await bot.send_message(chat_id=5, text="😀x", entities=[MessageEntity("bold", 1, 2)])
        # 4096 escaped characters are 4096 units once parsed, though 16384 as sent.
        await bot.send_message(chat_id=5, text="&lt;" * TELEGRAM_TEXT_LIMIT, parse_mode="HTML")
        with pytest.raises(BadRequest, match=r"(?i)too long"):
            await bot.send_message(chat_id=5, text="&lt;" * (TELEGRAM_TEXT_LIMIT + 1), parse_mode="HTML")
        first = await bot.send_message(chat_id=5, text="*draft*", parse_mode="MarkdownV2")
        await bot.edit_message_text("<i>final</i> &amp; done", chat_id=5, message_id=first.message_id,
                                    parse_mode="HTML")
        with pytest.raises(BadRequest, match=r"(?i)can't parse entities"):
            await bot.edit_message_text("<i>x", chat_id=5, message_id=first.message_id, parse_mode="HTML")
    assert fake_telegram.shown(5) == ["<" * TELEGRAM_TEXT_LIMIT, "final & done"]


# ---------------------------------------------------------------------------- end to end


async def test_reply_with_angle_brackets_reaches_telegram_intact(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    """The whole gateway, the real python-telegram-bot and the fake Bot API."""
    await make_gateway(admins=["telegram:1"], channels={"telegram": {
        "enabled": True, "token": fake_telegram.token, "base_url": fake_telegram.base_url,
        "base_file_url": fake_telegram.base_file_url, "poll_timeout_s": 1}})
    fake_model.reply("Declare `List<String> names` as List<String> names = new ArrayList<>();\n\n"
                     "And a & <b>c</b> stays as typed, 漢字 👍🏽 too.")
    fake_telegram.push_message(chat_id=1, user_id=1, text="how do I declare it?")
    # A streamed reply is plain while it grows; the last edit renders the formatting.
    await fake_telegram.wait_shown(1, lambda _t: any(e["type"] == "code" for m in fake_telegram.shown_parsed(1)
                                                     for e in m.entities), timeout=10)
    assert "\n".join(fake_telegram.shown(1)) == (
        "Declare List<String> names as List<String> names = new ArrayList<>();\n\n"
        "And a & <b>c</b> stays as typed, 漢字 👍🏽 too.")
