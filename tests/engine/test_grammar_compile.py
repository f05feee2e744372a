"""Grammar compiles run off the step thread: a request whose grammar is compiling is held out of
the scheduler while the others decode, a compile past the time limit fails its request naming
the setting, and each grammar is built once (on the compile thread, or by an in-process edge
that hands its build on). The compile is gated by an event, so nothing here depends on timing."""
from __future__ import annotations

import re
import threading

import pytest

import raypaged.model.grammar as grammar_module
from raypaged.core.sampling_params import SamplingParams

ASK = [{"role": "user", "content": "Give me a phone number."}]


class GatedCompiler:
    """xgrammar's GrammarCompiler, whose compiles wait for `gate` once they have started."""

    def __init__(self, real, gate: threading.Event) -> None:
        self.real, self.gate = real, gate

    def compile_grammar(self, grammar):
        self.gate.wait(timeout=60)  # bounded: without the hold the step thread would wait here
        return self.real.compile_grammar(grammar)


@pytest.fixture
def gate(llm, monkeypatch):
    gate = threading.Event()
    grammars = llm.engine.grammars
    monkeypatch.setattr(grammars, "_compiler", GatedCompiler(grammars._compiler_once(), gate))
    yield gate
    gate.set()


def prompt_ids(llm) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def drain(engine, tokens: dict, finished: dict, until=lambda: False) -> None:
    while engine.has_unfinished() and not until():
        for out in engine.step():
            if out.new_token_ids:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out


def test_a_request_whose_grammar_compiles_is_held_while_the_others_decode(llm, gate,
                                                                          monkeypatch):
    engine, ids = llm.engine, prompt_ids(llm)
    monkeypatch.setattr(engine.grammars, "max_compile_s", 600.0)  # the gate is the compile here
    regex = r"\+44 [0-9]{4} [0-9]{6}"
    constrained = SamplingParams(temperature=0, max_tokens=32, structured_outputs={"regex": regex})
    engine.add_request("plain", ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request("held", ids, constrained)
    tokens, finished = {}, {}
    drain(engine, tokens, finished, until=lambda: "plain" in finished)
    assert len(tokens["plain"]) == 8 and finished["plain"].finish_reason == "length"
    assert "held" not in tokens  # not one step of it ran, and nobody waited for it
    assert engine.stats().num_waiting == 1
    gate.set()
    drain(engine, tokens, finished)
    text = llm.get_tokenizer().decode(tokens["held"], skip_special_tokens=True)
    assert text == "+44 1234 567890" and re.fullmatch(regex, text)
    assert finished["held"].finish_reason == "stop"
    # the same request alone, its grammar compiled already: the same tokens
    engine.add_request("again", ids, constrained)
    drain(engine, tokens, finished)
    assert tokens["again"] == tokens["held"]


def test_a_grammar_past_the_compile_limit_fails_its_request_naming_the_setting(
        llm, gate, monkeypatch):
    engine, ids = llm.engine, prompt_ids(llm)
    monkeypatch.setattr(engine.grammars, "max_compile_s", 0.2)
    slow = SamplingParams(temperature=0, max_tokens=8,
                          structured_outputs={"regex": r"[0-9]{2}:[0-9]{2} slow"})
    engine.add_request("slow", ids, slow)
    engine.add_request("plain", ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    tokens, finished = {}, {}
    drain(engine, tokens, finished)  # the gate stays shut: the compile never ends by itself
    out = finished["slow"]
    assert out.finish_reason == "error" and "slow" not in tokens
    assert ("took more than 0.2 s to compile: simplify it, or raise the setting "
            "max_structured_output_compile_s (--max-structured-output-compile-s)"
            in out.stop_reason)
    assert len(tokens["plain"]) == 4
    # the same spec again is refused at once, before anything is queued
    with pytest.raises(ValueError, match="max_structured_output_compile_s"):
        engine.add_request("slow2", ids, slow)
    assert not engine.has_unfinished()


def test_each_grammar_is_built_once_off_the_step_thread(llm, monkeypatch):
    engine, ids = llm.engine, prompt_ids(llm)
    builds = []
    real = grammar_module.build_grammar

    def counting(spec):
        builds.append(threading.current_thread().name)
        return real(spec)
    monkeypatch.setattr(grammar_module, "build_grammar", counting)
    # the worker's path: built and compiled on the cache's thread, once for both requests
    so = {"regex": r"[0-9]{3} once"}
    engine.add_request("a", ids, SamplingParams(temperature=0, max_tokens=8, structured_outputs=so))
    engine.add_request("b", ids, SamplingParams(temperature=0, max_tokens=8, structured_outputs=so))
    tokens, finished = {}, {}
    drain(engine, tokens, finished)
    assert [n.split("_")[0] for n in builds] == ["grammar-compile"]
    assert tokens["a"] == tokens["b"] and finished["a"].finish_reason == "stop"
    # the offline LLM checks at its edge (in the caller's thread) and the compile uses that build
    builds.clear()
    llm.generate("Time:", SamplingParams(temperature=0, max_tokens=8,
                                          structured_outputs={"regex": r"[0-9]{2} edge"}),
                 use_tqdm=False)
    assert builds == [threading.current_thread().name]


def test_a_bad_grammar_given_straight_to_the_engine_fails_its_request_with_the_reason(llm):
    engine, ids = llm.engine, prompt_ids(llm)
    engine.add_request("bad", ids, SamplingParams(max_tokens=4,
                                                  structured_outputs={"regex": "a(b"}))
    tokens, finished = {}, {}
    drain(engine, tokens, finished)
    assert finished["bad"].finish_reason == "error" and "bad" not in tokens
    assert finished["bad"].stop_reason.startswith("structured_outputs.regex cannot be compiled")
    assert "parenthesis is not closed" in finished["bad"].stop_reason
