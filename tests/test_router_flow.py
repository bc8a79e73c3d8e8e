"""router.flow: reading an engine's answer as it passes (SSE events in vLLM's OpenAI chunk shape,
whole JSON answers), what a migration and vllm-ascend's ``recomputed`` re-issue continue from."""

from __future__ import annotations

import json

import pytest

from router import flow as answer
from router.flow import Flow
from router.types import RoutingRequest


def _flow(kind: str = "completions", *, stream: bool = True, wants_usage: bool = False, migrations: int = 0) -> Flow:
    f = Flow(rid="r1", kind=kind, path=f"/v1/{'chat/completions' if kind == 'chat' else 'completions'}",
             body={"model": "m"}, stream=stream, arrival=0.0, t0=0.0, rreq=RoutingRequest(model="m"),
             wants_usage=wants_usage)
    f.migrations = migrations
    return f


def _ev(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode()


def _text_chunk(text: str, finish: str | None = None, **extra) -> bytes:
    c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, **extra}
    return _ev({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [c]})


def _chat_chunk(delta: dict, finish: str | None = None, **extra) -> bytes:
    c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}
    return _ev({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [c]})


USAGE = {"prompt_tokens": 40, "total_tokens": 43, "completion_tokens": 3,
         "prompt_tokens_details": {"cached_tokens": 32}}


@pytest.mark.parametrize("wants_usage", [False, True])
def test_a_completion_stream_is_tracked_token_by_token(wants_usage):
    f = _flow(wants_usage=wants_usage)
    pieces = ["Hel", "lo", " world"]
    for p in pieces:
        assert answer.on_event(f, _text_chunk(p)) is True
    assert f.text == "Hello world" and f.out_tokens == 3
    assert f.first_token_t is not None and f.last_token_t >= f.first_token_t
    usage_only = _ev({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [],
                      "usage": USAGE})
    # the usage chunk the router asked for itself is not passed to a client that did not ask
    assert answer.on_event(f, usage_only) is wants_usage
    assert (f.prompt_tokens_reported, f.cached_tokens, f.out_tokens) == (40, 32, 3)
    assert not f.done
    assert answer.on_event(f, b"data: [DONE]") is True and f.done


def test_the_text_so_far_stays_whole_however_often_it_is_read():
    f = _flow()
    for i in range(500):
        answer.on_event(f, _text_chunk(f"t{i} "))
        if i in (0, 1, 99, 250):
            assert f.text == "".join(f"t{k} " for k in range(i + 1))
    assert f.text == "".join(f"t{k} " for k in range(500)) and f.out_tokens == 500
    assert len(f.pieces) == 1  # joined once by the read, not again by the next


def test_events_that_are_not_openai_chunks_pass_untouched():
    f = _flow()
    for ev in (b": keep-alive comment", b"data: not json", b"data: [1, 2]", b"event: ping"):
        assert answer.on_event(f, ev) is True
    assert f.text == "" and f.out_tokens == 0 and f.first_token_t is None


def test_after_a_migration_the_chat_role_delta_is_not_sent_twice():
    f = _flow("chat", migrations=1)
    f.pieces.append("Hello")  # what the first engine said
    assert answer.on_event(f, _chat_chunk({"role": "assistant", "content": ""})) is False  # nothing left: dropped
    rewritten = answer.on_event(f, _chat_chunk({"role": "assistant", "content": " again"}))
    assert isinstance(rewritten, bytes)
    obj = json.loads(rewritten[len(b"data: "):])
    assert obj["choices"][0]["delta"] == {"content": " again"}
    assert answer.on_event(f, _chat_chunk({"content": "!"})) is True  # no role: unchanged
    assert f.text == "Hello again!" and f.out_tokens == 2
    # a closing chunk with no content still goes out (it carries the finish reason)
    assert isinstance(answer.on_event(f, _chat_chunk({"role": "assistant"}, finish="stop")), bytes)


def test_a_recomputed_stop_drops_the_rest_of_that_decode_when_it_is_re_issued():
    stop = _text_chunk("", finish="stop", stop_reason="recomputed")
    f = _flow()
    answer.on_event(f, _text_chunk("par"), retries_recomputed=True)
    assert answer.on_event(f, stop, retries_recomputed=True) is False and f.recomputed
    assert answer.on_event(f, _text_chunk("tial"), retries_recomputed=True) is False
    assert answer.on_event(f, b"data: [DONE]", retries_recomputed=True) is False
    assert f.text == "par" and not f.done
    g = _flow()  # a router that does not re-issue: the stop is an ordinary last chunk
    assert answer.on_event(g, stop) is True and not g.recomputed


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_re_issued_json_answer_is_merged_with_the_text_before_the_recompute(kind):
    def body(text: str, stop_reason=None, completion=2):
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "stop"}
        if stop_reason:
            choice["stop_reason"] = stop_reason
        return json.dumps({"id": "x", "choices": [choice], "usage": {
            "prompt_tokens": 10, "completion_tokens": completion, "total_tokens": 10 + completion}}).encode()

    f = _flow(kind, stream=False)
    first = body("The quick", "recomputed", completion=2)
    assert not answer.recomputed_json(f, first)  # a router that does not re-issue keeps the answer
    assert answer.recomputed_json(f, first, retries_recomputed=True)
    assert f.text == "The quick" and f.out_tokens == 2 and f.first_token_t is not None
    assert not answer.recomputed_json(f, body(" brown fox", completion=3), retries_recomputed=True)
    merged = json.loads(answer.merge_recomputed(f, body(" brown fox", completion=3)))
    c = merged["choices"][0]
    assert (c["message"]["content"] if kind == "chat" else c["text"]) == "The quick brown fox"
    assert merged["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert answer.merge_recomputed(f, b"not json") == b"not json"


def test_a_json_answer_gives_its_usage_and_one_moment_for_the_first_and_last_token():
    f = _flow(stream=False)
    answer.account_json(f, json.dumps({"choices": [{"index": 0, "text": "abc"}], "usage": USAGE}).encode())
    assert (f.prompt_tokens_reported, f.cached_tokens, f.out_tokens) == (40, 32, 3)
    assert f.first_token_t == f.last_token_t is not None
    g = _flow(stream=False)
    answer.account_json(g, b"<html>bad gateway</html>")  # not JSON: timed, nothing counted
    assert g.first_token_t is not None and g.out_tokens == 0 and g.prompt_tokens_reported is None


def test_a_continuation_s_usage_does_not_replace_the_tokens_counted_before_it():
    f = _flow(migrations=1)
    for p in ("a", "b", "c", "d"):
        answer.on_event(f, _text_chunk(p))
    answer.account_usage(f, {"prompt_tokens": 50, "completion_tokens": 1})  # the second engine's own count
    assert f.out_tokens == 4 and f.prompt_tokens_reported == 50
