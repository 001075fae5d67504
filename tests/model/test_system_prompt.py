"""A system prompt per chat: rendered as the first message, saved with the
session, changed by reading the conversation again; on the real embedded model and
real SQLite files."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from kvchat import cli, compress
from kvchat.chat import persist
from kvchat.chat.controller import Controller
from kvchat.errors import Cancelled
from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.storage.db import Store
from kvchat.tui.slash import SlashCommand, parse_input

EXACT = CacheSettings(method="full", budget="100000")
# sinks 4 + window 16 + middle 16 per KV head: the system prompt alone overflows it.
SMALL = CacheSettings(method="window", budget="16", window=16, sinks=4, batch=16, prefill_mode="streaming")
PIRATE = "You are a pirate named Zorro."
QUESTION = "What is your name?"
TURN = SamplingSettings(max_new_tokens=8)

METHODS = compress.available()


def exact() -> CacheSettings:
    return CacheSettings(**{**EXACT.__dict__, "params": {}})


def rendered(engine, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of the chat template's own rendering of `messages`."""
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(engine.tokenizer(text, add_special_tokens=False).input_ids)


def reference(engine, messages: list[dict[str, str]], tokens: int) -> list[int]:
    """Greedy tokens of transformers' own generate on the chat template's rendering."""
    prompt = rendered(engine, messages)
    model = engine.model
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False)
    finally:
        model.set_attn_implementation("kvchat")
    return out[0, len(prompt) :].tolist()


def test_without_a_system_prompt_the_prompt_and_greedy_tokens_are_todays(engine):
    asked = [{"role": "user", "content": QUESTION}]
    today = rendered(engine, asked)  # after the template's default system prompt
    want = reference(engine, asked, TURN.max_new_tokens)
    for system in (None, "", "  \n"):
        session = engine.new_session(exact(), system=system)
        assert session.system is None
        assert session.prompt_ids(QUESTION) == today
        assert session.send(QUESTION, TURN).token_ids == want


def test_a_system_prompt_is_the_first_message_and_changes_the_answer(engine):
    session = engine.new_session(exact(), system=PIRATE)
    asked = [{"role": "system", "content": PIRATE}, {"role": "user", "content": QUESTION}]
    prompt = session.prompt_ids(QUESTION)
    assert prompt == rendered(engine, asked)
    text = engine.tokenizer.decode(prompt)
    assert text.startswith(f"<|im_start|>system\n{PIRATE}<|im_end|>") and "SmolLM" not in text
    result = session.send(QUESTION, TURN)
    assert result.token_ids == reference(engine, asked, TURN.max_new_tokens)
    assert "Zor" in result.text  # "Aye, my name is Zor…"
    assert "Zor" not in engine.new_session(exact()).send(QUESTION, TURN).text
    assert session.spans[0].role == "system" and session.spans[0].start == 0


def test_set_system_reads_the_conversation_again_as_if_it_had_started_with_it(engine):
    session = engine.new_session(exact())
    session.send(QUESTION, TURN)
    heard = []
    assert session.set_system(PIRATE, on_progress=lambda done, total: heard.append((done, total)))
    assert session.system == PIRATE and heard[-1][0] == heard[-1][1] == len(session.token_ids)
    fresh = engine.new_session(exact(), system=PIRATE)
    fresh.read_transcript(session.messages)
    assert session.token_ids == fresh.token_ids
    assert [s.role for s in session.spans] == ["system", "user", "assistant"]
    assert session.spans == fresh.spans and session.spans[-1].end == len(session.token_ids)
    assert session.send("Say it again.", TURN).token_ids == fresh.send("Say it again.", TURN).token_ids
    # Back to the template's default: the same tokens as a conversation that never had one.
    assert session.set_system(None)
    plain = engine.new_session(exact())
    plain.read_transcript(session.messages)
    assert session.system is None and session.token_ids == plain.token_ids


def test_set_system_on_an_empty_conversation_feeds_nothing_and_a_stopped_one_keeps_the_old(engine):
    session = engine.new_session(SMALL)
    calls = engine.forward_calls
    assert not session.set_system(PIRATE)
    assert session.system == PIRATE and engine.forward_calls == calls
    session.send(QUESTION, TURN)
    cache, ids, spans = session.cache, list(session.token_ids), list(session.spans)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled):
        session.set_system("You are a cat.", cancel=cancel)
    assert (session.system, session.cache, session.token_ids, session.spans) == (PIRATE, cache, ids, spans)
    assert not session.set_system(PIRATE)  # unchanged: nothing to do


def test_a_fork_keeps_the_system_prompt(engine):
    session = engine.new_session(SMALL, system=PIRATE)
    session.send(QUESTION, TURN)
    twin = session.fork(CacheSettings(**{**SMALL.__dict__, "method": "h2o", "params": {}}))
    assert twin.system == PIRATE
    assert twin.prompt_ids("Again?") == session.prompt_ids("Again?")


def test_the_system_prompt_is_saved_and_resumed_and_old_sessions_have_none(engine, store):
    session = engine.new_session(SMALL, system=PIRATE)
    sid = persist.new_session_row(store, session, "pirate")
    persist.save_turn(store, sid, session, QUESTION, session.send(QUESTION, TURN))
    assert store.get_session(sid).params["system"] == PIRATE
    assert store.snapshot_meta(sid)["settings"]["system"] == PIRATE
    assert json.loads(store.export_session(sid, "json"))["session"]["params"]["system"] == PIRATE
    resumed, _ = persist.resume(store, engine, sid)
    assert resumed.system == PIRATE and resumed.token_ids == session.token_ids
    # Rebuilt from the transcript (another model, say): under the saved system prompt too.
    rebuilt, _ = persist.rebuild(store, engine, sid, SMALL)
    assert rebuilt.system == PIRATE and rebuilt.token_ids[:4] == session.token_ids[:4]
    assert engine.tokenizer.decode(rebuilt.token_ids).startswith(f"<|im_start|>system\n{PIRATE}")

    plain = engine.new_session(SMALL)
    old = persist.new_session_row(store, plain, "plain")
    persist.save_turn(store, old, plain, QUESTION, plain.send(QUESTION, TURN))
    assert "system" not in store.get_session(old).params  # the saved form of today
    assert "system" not in store.snapshot_meta(old)["settings"]
    assert persist.resume(store, engine, old)[0].system is None


def test_the_controller_gives_new_sessions_its_prompt_and_set_system_saves(engine, store):
    chat = Controller(engine, store, SMALL, TURN, system=PIRATE)
    assert chat.system == PIRATE  # before the model: that of new sessions
    outcome = chat.send(QUESTION)
    assert chat.conversation.session.system == PIRATE and outcome.save_error is None
    sid = chat.conversation.session_id
    changed = chat.set_system("You are a cat.")
    assert changed.system == "You are a cat." and changed.tokens == len(chat.conversation.session.token_ids)
    assert changed.save_error is None and store.get_session(sid).params["system"] == "You are a cat."
    assert store.snapshot_meta(sid)["settings"]["system"] == "You are a cat."
    chat.new_session()
    assert chat.system == "You are a cat."  # like the method, it follows the open conversation
    other = Controller(engine, store, SMALL, TURN)
    other.resume(sid)
    assert other.system == "You are a cat." and other.conversation.session.system == "You are a cat."


def test_compare_reads_the_history_under_the_system_prompt(engine):
    chat = Controller(engine, None, exact(), TURN, system=PIRATE)
    first = chat.send(QUESTION).result
    comparison = chat.compare(["full"])
    assert comparison.answers[0].answer == first.text
    assert comparison.answers[0].session.system == PIRATE
    chat.set_system("You are a cat.")  # the tokens before the question changed
    assert not chat.can_compare()


def test_slash_system_takes_the_rest_of_the_line_and_the_lines_after():
    assert parse_input("/system Be brief.", METHODS) == SlashCommand("system", "Be brief.")
    assert parse_input("/system", METHODS) == SlashCommand("system")
    assert parse_input("/system\nBe brief.\nAnd kind.", METHODS) == SlashCommand("system", "Be brief.\nAnd kind.")
    assert parse_input("/file  my notes.txt", METHODS) == SlashCommand("file", "my notes.txt")


def run_cli(argv, engine, capsys, monkeypatch, tmp_path) -> tuple[int, str, str]:
    """`kvchat ARGV` in this process, on the already loaded engine."""
    monkeypatch.setattr(cli.options, "load_engine", lambda args, on_status=None: engine)
    monkeypatch.setenv("KVCHAT_DB", str(tmp_path / "kvchat.db"))
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_ask_system_show_and_a_session_continued_under_another(engine, capsys, monkeypatch, tmp_path):
    small = ["--method", "window", "--budget", "16", "--window", "16", "--max-new-tokens", "8", "--json"]
    code, out, err = run_cli(["ask", QUESTION, "--system", PIRATE, *small], engine, capsys, monkeypatch, tmp_path)
    assert code == 0, err
    first = json.loads(out)
    assert first["system"] == PIRATE
    sid = str(first["session"])
    code, out, _ = run_cli(["sessions", "show", sid], engine, capsys, monkeypatch, tmp_path)
    assert code == 0 and f"system: {PIRATE}" in out.splitlines()
    # Continued without --system: the saved prompt stays, and nothing is read again.
    code, out, err = run_cli(["ask", "Again?", "--session", sid, *small], engine, capsys, monkeypatch, tmp_path)
    second = json.loads(out)
    assert code == 0 and second["system"] == PIRATE and second["prompt_tokens"] < 20, err
    # With --system: the conversation is read again under the new one, then answered.
    code, out, err = run_cli(
        ["ask", "Who are you?", "--session", sid, "--system", "You are a cat.", *small],
        engine,
        capsys,
        monkeypatch,
        tmp_path,
    )
    third = json.loads(out)
    assert code == 0 and third["system"] == "You are a cat." and third["prompt_tokens"] < 20, err
    with Store(tmp_path / "kvchat.db") as store:
        assert store.get_session(int(sid)).params["system"] == "You are a cat."
    code, out, _ = run_cli(["ask", "Hi", "--no-save", *small], engine, capsys, monkeypatch, tmp_path)
    assert code == 0 and json.loads(out)["system"] is None
