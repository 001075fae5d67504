"""Copying (F4, F5): an answer, or one of its code blocks, goes to the clipboard
(Textual's `copy_to_clipboard`: OSC 52 to the terminal, and the app's own copy, which
these tests read)."""

from __future__ import annotations

import asyncio

from kvchat.tui.copying import CodeBlock, code_blocks

from .conftest import APP_SIZE, make_app, notifications, send_and_wait, wait_for

TWO_BLOCKS = (
    "Save it as `hello.py`:\n\n```python\nprint('hello')\nprint('world')\n```\n\n"
    "Then run it:\n\n```sh\npython hello.py\n```\n"
)


def test_code_blocks_are_read_as_the_markdown_widget_renders_them():
    assert code_blocks(TWO_BLOCKS) == [
        CodeBlock("python", "print('hello')\nprint('world')\n"),
        CodeBlock("sh", "python hello.py\n"),
    ]
    assert code_blocks("Indented:\n\n    x = 1\n") == [CodeBlock("", "x = 1\n")]
    assert code_blocks("Still streaming:\n```js\nlet a") == [CodeBlock("js", "let a")]
    assert code_blocks("No code, only `inline` code.") == []


async def _started(pilot) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.conversation is not None and app.activity is None, 60, "the model")


def test_f4_copies_the_last_answer_as_the_model_wrote_it(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=12)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "Name a colour.")
            answer = app.chat.message_list.assistant_messages()[-1].text
            await pilot.press("f4")
            assert answer.strip() and app.clipboard == answer
            assert notifications(app)[-1].startswith("Copied the answer (")

    asyncio.run(body())


def test_f4_copies_the_focused_answer_and_up_down_move_between_answers(engine, store):
    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await _started(pilot)
            messages = app.chat.message_list
            first = await messages.add_assistant("The first answer.")
            await messages.add_assistant("The second answer.")
            await pilot.pause()  # laid out where the click lands
            await pilot.click(first)
            await pilot.press("f4")
            assert app.clipboard == "The first answer."
            await pilot.press("down", "f4")
            assert app.clipboard == "The second answer."
            await pilot.press("up", "up", "f4")  # the first has no answer before it: focus stays
            assert app.clipboard == "The first answer."

    asyncio.run(body())


def test_f5_copies_the_last_code_block_then_the_ones_before_it(engine, store):
    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await _started(pilot)
            await app.chat.message_list.add_assistant(TWO_BLOCKS)
            await pilot.press("f5")
            assert app.clipboard == "python hello.py\n"
            assert notifications(app)[-1] == "Copied code block 2 of 2 (sh, 1 line) (F5 again: block 1)."
            await pilot.press("f5")
            assert app.clipboard == "print('hello')\nprint('world')\n"
            await pilot.press("f5")  # round to the last again
            assert app.clipboard == "python hello.py\n"

    asyncio.run(body())


def test_nothing_to_copy_says_so_and_leaves_the_clipboard(engine, store):
    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await _started(pilot)
            app.copy_to_clipboard("kept")
            await pilot.press("f4")
            assert app.clipboard == "kept" and notifications(app)[-1] == "There is no answer to copy yet."
            await app.chat.message_list.add_assistant("Plain prose, no code.")
            await pilot.press("f5")
            assert app.clipboard == "kept"
            assert notifications(app)[-1] == "This answer has no code block; F4 copies the whole answer."

    asyncio.run(body())
