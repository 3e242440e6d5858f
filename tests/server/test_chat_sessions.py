"""How a named session continues a re-sent conversation (kiln/server/chat_sessions.py), on SmolLM2-135M-
Instruct's own tokenizer and chat template: the kept history, what is appended, and why anything is
computed again."""

from __future__ import annotations

import pytest

from kiln.chat import prompt_for_chat
from kiln.errors import InvalidArgumentError
from kiln.models.embedded import embedded_model_path
from kiln.models.gguf_import import read_metadata
from kiln.server.chat_sessions import GENERATED, RENDERED, Segment, check_name, continuation
from kiln.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are terse."}
ASK = {"role": "user", "content": "The capital of France?"}
REPLY = "Paris."
FOLLOW_UP = {"role": "user", "content": "And of Italy?"}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(read_metadata(embedded_model_path("smollm2-135m-instruct")))


def rendered(tokenizer: Tokenizer, messages: list[dict]) -> tuple[str, bool]:
    return prompt_for_chat(messages, tokenizer)


def first_turn(tokenizer: Tokenizer, reply_ids: list[int]) -> tuple[list[int], list[Segment]]:
    """The history after the first turn: the rendered prompt, then the reply as generated (ending with the
    end-of-turn token the model stops on)."""
    text, add_bos = rendered(tokenizer, [SYSTEM, ASK])
    prompt = tokenizer.encode(text, add_special_tokens=add_bos)
    history = prompt + reply_ids + [tokenizer.eos_token_ids[0]]
    return history, [Segment(len(prompt), RENDERED), Segment(len(history), GENERATED)]


def test_a_resent_conversation_appends_only_its_new_messages(tokenizer: Tokenizer) -> None:
    history, segments = first_turn(tokenizer, tokenizer.encode(REPLY))
    text, add_bos = rendered(tokenizer, [SYSTEM, ASK, {"role": "assistant", "content": REPLY}, FOLLOW_UP])
    plan = continuation(history, segments, text, add_bos, tokenizer)
    assert plan.reason == "none" and plan.keep == len(history)
    assert history + plan.append == tokenizer.encode(text, add_special_tokens=add_bos)  # the stateless tokens
    assert plan.segments == [*segments, Segment(len(history) + len(plan.append), RENDERED)]


def test_a_reply_is_kept_as_generated_when_the_client_echoes_its_text(tokenizer: Tokenizer) -> None:
    spelled = [tokenizer.encode(character)[0] for character in REPLY]  # as a model may write it: one per character
    assert spelled != tokenizer.encode(REPLY) and tokenizer.decode(spelled) == REPLY
    history, segments = first_turn(tokenizer, spelled)
    text, add_bos = rendered(tokenizer, [SYSTEM, ASK, {"role": "assistant", "content": REPLY}, FOLLOW_UP])
    plan = continuation(history, segments, text, add_bos, tokenizer)
    assert plan.reason == "none" and plan.keep == len(history)  # re-tokenising would have lost the reply


def test_an_edited_reply_is_recomputed_from_its_start(tokenizer: Tokenizer) -> None:
    history, segments = first_turn(tokenizer, tokenizer.encode(REPLY))
    text, add_bos = rendered(tokenizer, [SYSTEM, ASK, {"role": "assistant", "content": "Paris, of course."}, FOLLOW_UP])
    plan = continuation(history, segments, text, add_bos, tokenizer)
    assert plan.keep == segments[0].end
    assert plan.reason == f"the reply at token {segments[0].end} differs from the one generated"
    assert history[:plan.keep] + plan.append == tokenizer.encode(text, add_special_tokens=add_bos)


def test_a_changed_rendering_keeps_the_tokens_before_the_first_difference(tokenizer: Tokenizer) -> None:
    history, segments = first_turn(tokenizer, tokenizer.encode(REPLY))
    edited = {"role": "system", "content": "You are terse and kind."}
    text, add_bos = rendered(tokenizer, [edited, ASK, {"role": "assistant", "content": REPLY}, FOLLOW_UP])
    plan = continuation(history, segments, text, add_bos, tokenizer)
    stateless = tokenizer.encode(text, add_special_tokens=add_bos)
    first_difference = next(i for i, (a, b) in enumerate(zip(history, stateless, strict=False)) if a != b)
    assert plan.keep == first_difference > 0
    assert plan.reason == f"the rendering of earlier messages changed at token {first_difference}"
    assert history[:plan.keep] + plan.append == stateless
    assert plan.segments == [Segment(first_difference, RENDERED), Segment(len(stateless), RENDERED)]


def test_tokens_no_binding_recorded_count_as_a_reply(tokenizer: Tokenizer) -> None:
    history, segments = first_turn(tokenizer, tokenizer.encode(REPLY))
    text, add_bos = rendered(tokenizer, [SYSTEM, ASK, {"role": "assistant", "content": REPLY}, FOLLOW_UP])
    plan = continuation(history, segments[:1], text, add_bos, tokenizer)  # the reply's segment was never written
    assert plan.reason == "none" and plan.keep == len(history)
    assert plan.segments[1] == Segment(len(history), GENERATED)


def test_token_prompts_keep_their_common_prefix(tokenizer: Tokenizer) -> None:
    history = [1, 2, 3, 4]
    assert continuation(history, [], [1, 2, 3, 4, 5], False, tokenizer).append == [5]
    plan = continuation(history, [], [1, 2, 9], False, tokenizer)
    assert (plan.keep, plan.append) == (2, [9])
    assert plan.reason == "the prompt's token ids differ from the session's at token 2"


@pytest.mark.parametrize("name", ["", "a b", "x" * 129, "naïve", "../etc"])
def test_names_outside_the_alphabet_are_refused(name: str) -> None:
    with pytest.raises(InvalidArgumentError, match="Kiln-Session header"):
        check_name(name)
    assert check_name("agent-7.main_x") == "agent-7.main_x"
