"""Images in the context (SPEC §5.4): their token cost, where image parts go, the
placeholder that stands in for them in older turns, and the budget with images."""

from __future__ import annotations

import pytest

from context import Budget, SessionContext, TokenCounter, compact, injection_text, prepare
from context.images import IMAGE_REF_PREFIX, placeholder
from context.tokens import IMAGE_TOKENS, MESSAGE_OVERHEAD, image_tokens
from gateway.types import Attachment, Message, ToolCall

SYSTEM = "You are a helpful assistant."


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter("gpt-4o-mini")


def budget(tokens: int = 1_000_000, turns: int = 20, *, vision: bool = True) -> Budget:
    return Budget(tokens, turns, None, 1000, 50_000, 20_000, vision=vision)


def photo(n: int, width: int = 1280, height: int = 960) -> Attachment:
    return Attachment(name=f"photo_{n}.jpg", path=f"files/photo_{n}.jpg", mime="image/jpeg", size=1000,
                      kind="image", width=width, height=height, preview=f"files/photo_{n}.jpg")


def with_photo(turn: int, *images: Attachment) -> Message:
    notes = "\n".join(f"[image: {a.path}, {a.width}×{a.height}]" for a in images)
    return Message("user", f"what is in picture {turn}?\n{notes}", turn=turn, attachments=images)


def answer(turn: int) -> Message:
    return Message("assistant", f"a cat, {turn}", turn=turn)


def user_dicts(messages: list[dict]) -> list[dict]:
    return [m for m in messages if m["role"] == "user"]


# -- the token rule ----------------------------------------------------------------------------


@pytest.mark.parametrize(("width", "height", "tokens"), [
    (1024, 1024, 765),  # OpenAI's examples: 768x768 after scaling, 4 tiles
    (2048, 4096, 1105),  # 1024x2048, then 768x1536: 6 tiles
    (4096, 8192, 1105),
    (512, 512, 255),  # one tile
    (513, 100, 425),  # two tiles: no scaling below 768 on the short side
    (100, 100, 255),  # small images are not scaled up
    (768, 768, 765),
    (1568, 1176, 765),  # the largest copy the gateway sends, landscape: 1024x768
    (1568, 392, 765),  # a long strip: 4 x 1 tiles
    (2000, 800, 1445),  # 1920x768: 4 x 2 tiles, the most there can be
])
def test_image_tokens_follow_the_tile_rule(width: int, height: int, tokens: int) -> None:
    assert image_tokens(width, height) == tokens
    assert image_tokens(height, width) == tokens  # the rule does not care which side is which


def test_image_tokens_never_undercount_a_rounded_size() -> None:
    # 3000 x 2001 scales to 2048 x 1366.0…, then to 1151.4… x 768: 3 x 2 tiles. A provider that
    # rounds to whole pixels gets the same or fewer tiles, never more.
    assert image_tokens(3000, 2001) == 85 + 170 * 6
    assert image_tokens(0, 10) == 85 + 170 * 8  # nonsense costs the most an image can


def test_a_sized_image_part_counts_by_its_size(counter: TokenCounter) -> None:
    part = {"type": "image_url", "image_url": {"url": IMAGE_REF_PREFIX + "files/a.jpg"}, "width": 512,
            "height": 512}
    msg = {"role": "user", "content": [{"type": "text", "text": "look"}, part]}
    assert counter.count_dict(msg) == MESSAGE_OVERHEAD + counter.count_text("look") + 255
    unsized = {"role": "user", "content": [{"type": "text", "text": "look"},
                                           {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}
    assert counter.count_dict(unsized) == MESSAGE_OVERHEAD + counter.count_text("look") + IMAGE_TOKENS


# -- placement ---------------------------------------------------------------------------------


def test_the_current_turns_image_is_sent_as_a_part_that_names_its_file(counter: TokenCounter) -> None:
    ctx = SessionContext("t:1", [with_photo(1, photo(1))])
    p = prepare(ctx, system_prompt=SYSTEM, tools=[], budget=budget(), counter=counter)
    (sent,) = user_dicts(p.messages)
    text, image = sent["content"]
    assert text == {"type": "text", "text": ctx.messages[0].content}  # the stored text, verbatim
    assert image == {"type": "image_url", "image_url": {"url": "workspace:files/photo_1.jpg", "detail": "high"},
                     "width": 1280, "height": 960}
    without = prepare(SessionContext("t:2", [with_photo(1, photo(1))]), system_prompt=SYSTEM, tools=[],
                      budget=budget(vision=False), counter=counter)
    assert p.tokens - without.tokens == image_tokens(1280, 960) == 765


def test_without_vision_the_stored_text_says_where_the_image_is(counter: TokenCounter) -> None:
    ctx = SessionContext("t:1", [with_photo(1, photo(1)), answer(1), with_photo(2, photo(2))])
    p = prepare(ctx, system_prompt=SYSTEM, tools=[], budget=budget(vision=False), counter=counter)
    contents = [m["content"] for m in user_dicts(p.messages)]
    assert contents == [ctx.messages[0].content, ctx.messages[2].content]  # plain strings, as stored
    assert "[image: files/photo_2.jpg, 1280×960]" in contents[1]


def test_images_older_than_the_last_two_turns_become_placeholders(counter: TokenCounter) -> None:
    msgs: list[Message] = []
    for turn in range(1, 5):
        msgs += [with_photo(turn, photo(turn)), answer(turn)]
    msgs.pop()  # turn 4 is the current one
    ctx = SessionContext("t:1", msgs)
    p = prepare(ctx, system_prompt=SYSTEM, tools=[], budget=budget(), counter=counter)
    first, *recent = user_dicts(p.messages)
    stored = ctx.messages[0].content
    assert first["content"] == f"{stored}\n{placeholder(photo(1))}"  # a string: no image part
    assert placeholder(photo(1)) == "[earlier image, no longer shown: files/photo_1.jpg]"
    assert [m["content"][1]["image_url"]["url"] for m in recent] == [
        f"workspace:files/photo_{n}.jpg" for n in (2, 3, 4)]

    ctx.append(answer(4))
    ctx.append(Message("user", "and now?", turn=5))
    p2 = prepare(ctx, system_prompt=SYSTEM, tools=[], budget=budget(), counter=counter)
    shown = [m for m in user_dicts(p2.messages) if isinstance(m["content"], list)]
    assert [m["content"][1]["image_url"]["url"] for m in shown] == ["workspace:files/photo_3.jpg",
                                                                    "workspace:files/photo_4.jpg"]
    assert user_dicts(p2.messages)[1]["content"].endswith(placeholder(photo(2)))  # turn 2 aged out


def test_a_compacted_session_keeps_images_of_its_last_turns(counter: TokenCounter) -> None:
    msgs: list[Message] = []
    for turn in range(1, 4):
        msgs += [with_photo(turn, photo(turn)), answer(turn)]
    ctx = SessionContext("t:1", msgs)
    assert compact(ctx, keep_turns=2) is not None
    ctx.append(Message("user", "compare them", turn=4))
    p = prepare(ctx, system_prompt=SYSTEM, tools=[], budget=budget(), counter=counter)
    urls = [part["image_url"]["url"] for m in user_dicts(p.messages) if isinstance(m["content"], list)
            for part in m["content"][1:]]
    assert urls == ["workspace:files/photo_2.jpg", "workspace:files/photo_3.jpg"]


def test_the_summary_goes_in_front_of_the_text_part(counter: TokenCounter) -> None:
    msgs = [Message("user", "old question", turn=1), answer(1), with_photo(2, photo(2))]
    ctx = SessionContext("t:1", msgs[2:], summary="## Goal\nknow the cat", summary_upto_turn=1)
    p = prepare(ctx, system_prompt=SYSTEM, tools=[], budget=budget(), counter=counter)
    (sent,) = user_dicts(p.messages)
    text, image = sent["content"]
    assert text["text"] == injection_text("## Goal\nknow the cat") + "\n\n" + msgs[2].content
    assert image["image_url"]["url"] == "workspace:files/photo_2.jpg"


def test_an_image_that_does_not_fit_the_budget_is_left_out_before_the_text(counter: TokenCounter) -> None:
    msg = with_photo(1, photo(1, 1568, 1176), photo(9, 1568, 1176))
    text_only = prepare(SessionContext("t:0", [msg]), system_prompt=SYSTEM, tools=[],
                        budget=budget(vision=False), counter=counter).tokens
    limit = text_only + 765 + 100  # room for one image, not two
    ctx = SessionContext("t:1", [msg])
    p = prepare(ctx, system_prompt=SYSTEM, tools=[], budget=budget(limit), counter=counter)
    assert p.user_notice is None and p.tokens <= limit
    (sent,) = user_dicts(p.messages)
    assert isinstance(sent["content"], str)  # both went: a turn's images stay or go together
    assert sent["content"].startswith(msg.content)  # the person's text is whole
    assert placeholder(photo(1)) in sent["content"] and placeholder(photo(9)) in sent["content"]
    assert [e.strategy for e in p.events] == ["cut_current_turn"]
    roomy = prepare(SessionContext("t:2", [msg]), system_prompt=SYSTEM, tools=[],
                    budget=budget(text_only + 2 * 765 + 50), counter=counter)
    assert len(user_dicts(roomy.messages)[0]["content"]) == 3  # text and both images


# -- images a tool returned --------------------------------------------------------------------


def tool_step(turn: int, *images: Attachment, calls: int = 2) -> list[Message]:
    """An assistant message with `calls` tool calls and their results; the first result carries `images`."""
    ids = [f"c{turn}_{i}" for i in range(calls)]
    ask = Message("assistant", "", turn=turn, tool_calls=tuple(ToolCall(i, "shot", "{}") for i in ids))
    results = [Message("tool", f"result {i}" + "".join(f"\n[image: {a.path}, {a.width}×{a.height}]" for a in images)
                       if n == 0 else f"result {i}", turn=turn, tool_call_id=i, tool_name="shot",
                       attachments=images if n == 0 else ()) for n, i in enumerate(ids)]
    return [ask, *results]


def test_a_tools_image_follows_its_steps_results_as_a_user_message(counter: TokenCounter) -> None:
    shot = photo(9, 512, 512)
    msgs = [Message("user", "take a screenshot", turn=1), *tool_step(1, shot)]
    ctx = SessionContext("t:1", msgs)
    p = prepare(ctx, system_prompt=SYSTEM, tools=[], budget=budget(), counter=counter)
    roles = [m["role"] for m in p.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]  # after the last result: pairs stay valid
    assert p.messages[3]["content"] == msgs[2].content  # the result keeps its text (it names the file)
    images = p.messages[5]["content"]
    assert images[0]["type"] == "text"
    assert images[1]["image_url"]["url"] == "workspace:files/photo_9.jpg"
    without = prepare(SessionContext("t:2", msgs), system_prompt=SYSTEM, tools=[], budget=budget(vision=False),
                      counter=counter)
    assert [m["role"] for m in without.messages] == ["system", "user", "assistant", "tool", "tool"]
    # Counted: the image and the message that carries it.
    assert p.tokens - without.tokens == counter.count_dict(p.messages[5]) > image_tokens(512, 512)

    # The model answers after seeing it; the next step's request still has it in place.
    ctx.append(Message("assistant", "", turn=1, tool_calls=(ToolCall("c1_x", "read", "{}"),)))
    ctx.append(Message("tool", "more", turn=1, tool_call_id="c1_x", tool_name="read"))
    p2 = prepare(ctx, system_prompt=SYSTEM, tools=[], budget=budget(), counter=counter)
    assert [m["role"] for m in p2.messages] == ["system", "user", "assistant", "tool", "tool", "user", "assistant",
                                                "tool"]


def test_a_tools_image_ages_like_a_persons(counter: TokenCounter) -> None:
    msgs: list[Message] = [Message("user", "shoot", turn=1), *tool_step(1, photo(1)), answer(1)]
    for turn in range(2, 5):
        msgs += [Message("user", f"question {turn}", turn=turn), answer(turn)]
    msgs.pop()  # turn 4 is the current one: turn 1 is three turns back
    ctx = SessionContext("t:1", msgs)
    p = prepare(ctx, system_prompt=SYSTEM, tools=[], budget=budget(), counter=counter)
    assert not any(isinstance(m["content"], list) for m in p.messages)  # no image part left
    tool = next(m for m in p.messages if m["role"] == "tool")
    assert tool["content"].endswith(placeholder(photo(1)))
    assert [m["role"] for m in p.messages].count("user") == 4  # no image message either

    recent = SessionContext("t:2", [*msgs[:-4], Message("user", "next", turn=2)])
    shown = prepare(recent, system_prompt=SYSTEM, tools=[], budget=budget(), counter=counter)
    assert sum(isinstance(m["content"], list) for m in shown.messages) == 1  # still shown one turn later


def test_a_tools_image_that_does_not_fit_becomes_a_placeholder(counter: TokenCounter) -> None:
    msgs = [Message("user", "shoot", turn=1), *tool_step(1, photo(1, 2000, 800))]
    whole = prepare(SessionContext("t:1", msgs), system_prompt=SYSTEM, tools=[], budget=budget(), counter=counter)
    tight = prepare(SessionContext("t:2", msgs), system_prompt=SYSTEM, tools=[],
                    budget=budget(whole.tokens - 200), counter=counter)
    assert not any(isinstance(m["content"], list) for m in tight.messages)
    assert next(m for m in tight.messages if m["role"] == "tool")["content"].endswith(placeholder(photo(1, 2000, 800)))
