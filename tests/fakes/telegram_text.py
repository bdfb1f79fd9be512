"""What Telegram makes of a message's text: the fake Bot API's own reading of `parse_mode`
HTML and MarkdownV2 and of `entities`, written from the Bot API's documented rules and
independent of the gateway's formatter (tests compare the two).

`parse_message(text, parse_mode, entities)` returns the visible text and its entities, or
raises `EntityError` with the reason Telegram gives after "Bad Request: can't parse
entities: ". Offsets in error messages are UTF-8 byte offsets, as Telegram reports them;
entity offsets are UTF-16 code units.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


class EntityError(ValueError):
    """Telegram refuses the formatting ("can't parse entities: <reason>")."""


@dataclass(slots=True)
class Parsed:
    text: str  # what the person sees
    entities: list[dict[str, Any]] = field(default_factory=list)


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


ENTITY_TYPES = frozenset({
    "mention", "hashtag", "cashtag", "bot_command", "url", "email", "phone_number", "bold",
    "italic", "underline", "strikethrough", "spoiler", "blockquote", "expandable_blockquote",
    "code", "pre", "text_link", "text_mention", "custom_emoji", "date_time",
})


def parse_message(text: str, parse_mode: Any = None, entities: Any = None) -> Parsed:
    """The message as Telegram reads it. Explicit `entities` win over `parse_mode`."""
    if entities:
        return Parsed(text, _checked_entities(text, entities))
    mode = str(parse_mode or "").lower()
    if not mode:
        return Parsed(text)
    if mode == "html":
        return parse_html(text)
    if mode == "markdownv2":
        return parse_markdown_v2(text)
    raise EntityError(f"unsupported parse_mode {parse_mode!r}")


def _checked_entities(text: str, entities: Any) -> list[dict[str, Any]]:
    if not isinstance(entities, list):
        raise EntityError("entities must be a list")
    total = utf16_len(text)
    # UTF-16 offsets that fall between the halves of a surrogate pair.
    inside_pair: set[int] = set()
    pos = 0
    for ch in text:
        pos += 1
        if ord(ch) > 0xFFFF:
            inside_pair.add(pos)
            pos += 1
    for ent in entities:
        if not isinstance(ent, dict) or not isinstance(ent.get("type"), str):
            raise EntityError("an entity has no type")
        kind = ent["type"]
        if kind not in ENTITY_TYPES:
            raise EntityError(f"unsupported entity type {kind!r}")
        off, length = ent.get("offset"), ent.get("length")
        if not isinstance(off, int) or not isinstance(length, int) or off < 0 or length <= 0:
            raise EntityError(f"bad entity range {off!r}+{length!r}")
        if off + length > total:
            raise EntityError(f"entity {kind} ends after the text ({off}+{length} > {total})")
        if off in inside_pair or off + length in inside_pair:
            raise EntityError(f"entity {kind} cuts a character in half at {off}+{length}")
        if kind == "text_link" and not ent.get("url"):
            raise EntityError("a text_link entity needs a url")
    return list(entities)


# ---------------------------------------------------------------------------- HTML

_HTML_TAGS = {
    "b": "bold", "strong": "bold", "i": "italic", "em": "italic", "u": "underline",
    "ins": "underline", "s": "strikethrough", "strike": "strikethrough",
    "del": "strikethrough", "span": "spoiler", "tg-spoiler": "spoiler", "a": "text_link",
    "code": "code", "pre": "pre", "blockquote": "blockquote", "tg-emoji": "custom_emoji",
    "tg-time": "date_time",
}
_NAMED_CHARS = {"lt": "<", "gt": ">", "amp": "&", "quot": '"'}
_CHAR_REF = re.compile(r"&(?:#([0-9]{1,7})|#[xX]([0-9a-fA-F]{1,6})|([a-zA-Z]+));")


@dataclass(slots=True)
class _Open:
    tag: str
    start: int  # UTF-16 offset in the visible text
    byte: int  # where the tag began in the source, for messages
    argument: str = ""


def _char_ref(source: str, i: int) -> tuple[str, int] | None:
    """The character an HTML character reference at `i` stands for, and its length.
    Only the numeric forms and &lt; &gt; &amp; &quot; are references to Telegram."""
    m = _CHAR_REF.match(source, i)
    if m is None:
        return None
    dec, hexa, name = m.groups()
    if name is not None:
        ch = _NAMED_CHARS.get(name)
        return (ch, m.end() - i) if ch is not None else None
    code = int(dec) if dec is not None else int(hexa, 16)
    if code == 0 or code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
        return None
    return chr(code), m.end() - i


def parse_html(source: str) -> Parsed:
    out: list[str] = []
    pos16 = 0
    stack: list[_Open] = []
    entities: list[dict[str, Any]] = []
    n = len(source)

    def byte_at(i: int) -> int:
        return len(source[:i].encode("utf-8"))

    def emit(s: str) -> None:
        nonlocal pos16
        out.append(s)
        pos16 += utf16_len(s)

    i = 0
    while i < n:
        c = source[i]
        if c == "&":
            ref = _char_ref(source, i)
            if ref is not None:
                emit(ref[0])
                i += ref[1]
                continue
        if c != "<":
            emit(c)
            i += 1
            continue
        begin = i
        i += 1
        if i < n and source[i] == "/":
            if not stack:
                raise EntityError(f"Unexpected end tag at byte offset {byte_at(begin)}")
            j = i + 1
            while j < n and not source[j].isspace() and source[j] != ">":
                j += 1
            name = source[i + 1:j].lower()
            while j < n and source[j].isspace():
                j += 1
            if j >= n or source[j] != ">":
                raise EntityError(f"Unclosed end tag at byte offset {byte_at(begin)}")
            top = stack.pop()
            if name and name != top.tag:
                raise EntityError(
                    f'Unmatched end tag at byte offset {byte_at(begin)}, expected "</{top.tag}>", '
                    f'found "</{name}>"'
                )
            if pos16 > top.start:
                ent = _html_entity(top, pos16)
                last = entities[-1] if entities else None
                if (ent["type"] == "pre" and last is not None and last["type"] == "code"
                        and (last["offset"], last["length"]) == (ent["offset"], ent["length"])):
                    # <pre><code class="language-x"> is one pre block in language x
                    entities.pop()
                    if last.get("language"):
                        ent["language"] = last["language"]
                entities.append(ent)
            i = j + 1
            continue
        j = i
        while j < n and not source[j].isspace() and source[j] != ">":
            j += 1
        if j >= n:
            raise EntityError(f"Unclosed start tag at byte offset {byte_at(begin)}")
        tag = source[i:j].lower()
        if tag not in _HTML_TAGS:
            raise EntityError(f'Unsupported start tag "{tag}" at byte offset {byte_at(begin)}')
        opened = _Open(tag, pos16, byte_at(begin))
        i = _html_attributes(source, j, opened)
        if tag == "span" and opened.argument != "spoiler":
            raise EntityError(f'Tag "span" must have class "tg-spoiler" at byte offset {opened.byte}')
        stack.append(opened)
    if stack:
        raise EntityError(f'Can\'t find end tag corresponding to start tag "{stack[-1].tag}"')
    return Parsed("".join(out), sorted(entities, key=lambda e: (e["offset"], -e["length"])))


def _html_attributes(source: str, i: int, opened: _Open) -> int:
    """Reads attributes up to the tag's `>`; returns the index after it."""
    n = len(source)

    def fail(what: str) -> EntityError:
        return EntityError(f"{what} at byte offset {opened.byte}")

    while True:
        while i < n and source[i].isspace():
            i += 1
        if i >= n:
            raise fail("Unclosed start tag")
        if source[i] == ">":
            return i + 1
        a = i
        while i < n and not source[i].isspace() and source[i] not in "=>":
            i += 1
        name = source[a:i].lower()
        if not name:
            raise fail(f'Empty attribute name in the tag "{opened.tag}"')
        while i < n and source[i].isspace():
            i += 1
        if i >= n:
            raise fail("Unclosed start tag")
        if source[i] != "=":
            if opened.tag == "blockquote" and name == "expandable":
                opened.argument = "expandable"
                continue
            raise fail(f'Expected equal sign in declaration of an attribute of the tag "{opened.tag}"')
        i += 1
        while i < n and source[i].isspace():
            i += 1
        if i >= n:
            raise fail("Unclosed start tag")
        if source[i] in "\"'":
            quote = source[i]
            i += 1
            value: list[str] = []
            while i < n and source[i] != quote:
                ref = _char_ref(source, i) if source[i] == "&" else None
                if ref is not None:
                    value.append(ref[0])
                    i += ref[1]
                else:
                    value.append(source[i])
                    i += 1
            if i >= n:
                raise fail("Unclosed start tag")
            i += 1
            text_value = "".join(value)
        else:
            a = i
            while i < n and (source[i].isalnum() or source[i] in ".-"):
                i += 1
            if i >= n or not (source[i].isspace() or source[i] == ">"):
                raise EntityError(f"Unexpected end of name token at byte offset {len(source[:a].encode())}")
            text_value = source[a:i].lower()
        if opened.tag == "a" and name == "href":
            opened.argument = text_value
        elif opened.tag == "code" and name == "class" and text_value.startswith("language-"):
            opened.argument = text_value.removeprefix("language-")
        elif opened.tag == "span" and name == "class" and text_value.startswith("tg-"):
            opened.argument = text_value.removeprefix("tg-")
        elif opened.tag == "tg-emoji" and name == "emoji-id":
            opened.argument = text_value


def _html_entity(opened: _Open, end: int) -> dict[str, Any]:
    kind = _HTML_TAGS[opened.tag]
    if kind == "blockquote" and opened.argument == "expandable":
        kind = "expandable_blockquote"
    ent: dict[str, Any] = {"type": kind, "offset": opened.start, "length": end - opened.start}
    if kind == "text_link":
        ent["url"] = opened.argument
    elif kind == "code" and opened.argument:
        ent["language"] = opened.argument
    elif kind == "custom_emoji":
        ent["custom_emoji_id"] = opened.argument
    return ent


# ---------------------------------------------------------------------------- MarkdownV2

_RESERVED = frozenset("_*[]()~`>#+-=|{}.!")
_MDV2_NAMES = {
    "bold": "Bold", "italic": "Italic", "underline": "Underline", "strikethrough": "Strikethrough",
    "spoiler": "Spoiler", "text_link": "TextUrl", "custom_emoji": "CustomEmoji", "code": "Code",
    "pre": "Pre", "blockquote": "BlockQuote",
}


@dataclass(slots=True)
class _MdOpen:
    kind: str
    start: int  # UTF-16 offset in the visible text
    byte: int
    piece: int = 0  # index into the output pieces where it began
    language: str = ""


def parse_markdown_v2(source: str) -> Parsed:
    out: list[str] = []
    pos16 = 0
    stack: list[_MdOpen] = []
    entities: list[dict[str, Any]] = []
    quote: _MdOpen | None = None  # blockquotes are line-based, outside the inline stack
    n = len(source)

    def byte_at(i: int) -> int:
        return len(source[:i].encode("utf-8"))

    def emit(s: str) -> None:
        nonlocal pos16
        out.append(s)
        pos16 += utf16_len(s)

    def close(opened: _MdOpen, **extra: Any) -> None:
        if pos16 > opened.start:
            ent: dict[str, Any] = {"type": opened.kind, "offset": opened.start,
                                   "length": pos16 - opened.start, **extra}
            if opened.kind == "pre" and opened.language:
                ent["language"] = opened.language
            entities.append(ent)

    def reserved(i: int) -> EntityError:
        return EntityError(
            f"Character '{source[i]}' is reserved and must be escaped with the preceding '\\'"
        )

    i = 0
    while i < n:
        c = source[i]
        at_line_start = i == 0 or source[i - 1] == "\n"
        if at_line_start and not (stack and stack[-1].kind in ("code", "pre")):
            if c == ">":
                if quote is None:
                    quote = _MdOpen("blockquote", pos16, byte_at(i))
                i += 1
                continue
            if quote is not None:
                # The quote ended with the previous line (its line break stays outside).
                end = pos16 - 1 if out and out[-1].endswith("\n") else pos16
                if end > quote.start:
                    entities.append({"type": "blockquote", "offset": quote.start,
                                     "length": end - quote.start})
                quote = None
        if c == "\\" and i + 1 < n and 0 < ord(source[i + 1]) < 127:
            emit(source[i + 1])
            i += 2
            continue
        top = stack[-1] if stack else None
        if top is not None and top.kind in ("code", "pre"):
            if c != "`":
                emit(c)
                i += 1
                continue
            if top.kind == "pre":
                if not source.startswith("```", i):
                    raise reserved(i)
                stack.pop()
                close(top)
                i += 3
                continue
            stack.pop()
            close(top)
            i += 1
            continue
        if c not in _RESERVED:
            emit(c)
            i += 1
            continue
        if c == "*":
            if top is not None and top.kind == "bold":
                stack.pop()
                close(top)
            else:
                stack.append(_MdOpen("bold", pos16, byte_at(i)))
            i += 1
        elif c == "_":
            double = source.startswith("__", i)
            if top is not None and top.kind == "underline" and double:
                stack.pop()
                close(top)
                i += 2
            elif top is not None and top.kind == "italic":
                stack.pop()
                close(top)
                i += 1
            elif double:
                stack.append(_MdOpen("underline", pos16, byte_at(i)))
                i += 2
            else:
                stack.append(_MdOpen("italic", pos16, byte_at(i)))
                i += 1
        elif c == "~":
            if top is not None and top.kind == "strikethrough":
                stack.pop()
                close(top)
            else:
                stack.append(_MdOpen("strikethrough", pos16, byte_at(i)))
            i += 1
        elif c == "|":
            if not source.startswith("||", i):
                raise reserved(i)
            if top is not None and top.kind == "spoiler":
                stack.pop()
                close(top)
            else:
                stack.append(_MdOpen("spoiler", pos16, byte_at(i)))
            i += 2
        elif c == "[" or (c == "!" and source.startswith("![", i)):
            kind = "custom_emoji" if c == "!" else "text_link"
            stack.append(_MdOpen(kind, pos16, byte_at(i), piece=len(out)))
            i += 2 if c == "!" else 1
        elif c == "]" and top is not None and top.kind in ("text_link", "custom_emoji"):
            stack.pop()
            i += 1
            if i < n and source[i] == "(":
                url: list[str] = []
                i += 1
                while i < n and source[i] != ")":
                    if source[i] == "\\" and i + 1 < n and 0 < ord(source[i + 1]) < 127:
                        i += 1
                    url.append(source[i])
                    i += 1
                if i >= n:
                    raise EntityError(f"Can't find end of a URL at byte offset {top.byte}")
                i += 1
                target = "".join(url)
            else:  # "[https://example.org]" links to its own text
                target = "".join(out[top.piece:])
            if top.kind == "custom_emoji":
                close(top, custom_emoji_id=target.removeprefix("tg://emoji?id="))
            elif target:
                close(top, url=target)
        elif c == "`":
            if source.startswith("```", i):
                j = source.find("\n", i + 3)
                first_line = source[i + 3:j] if j >= 0 else ""
                opened = _MdOpen("pre", pos16, byte_at(i))
                if j >= 0 and first_line and not first_line.isspace() and "`" not in first_line:
                    opened.language = first_line.strip()
                    i = j + 1
                else:
                    i += 3
                stack.append(opened)
            else:
                stack.append(_MdOpen("code", pos16, byte_at(i)))
                i += 1
        else:
            raise reserved(i)
    if stack:
        top = stack[-1]
        raise EntityError(f"Can't find end of {_MDV2_NAMES[top.kind]} entity at byte offset {top.byte}")
    if quote is not None and pos16 > quote.start:
        entities.append({"type": "blockquote", "offset": quote.start, "length": pos16 - quote.start})
    return Parsed("".join(out), sorted(entities, key=lambda e: (e["offset"], -e["length"])))
