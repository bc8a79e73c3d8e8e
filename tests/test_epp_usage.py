"""The endpoint picker's usage question and the usage event it takes out of the answer
(router.epp.usage): the answer the client gets is byte for byte the engine's, less that event,
however the gateway cuts it into chunks."""

from __future__ import annotations

import json

import msgspec
import pytest

from router.epp.usage import HOLD_MAX, UsageStrip, asking, is_usage_only, needs_asking


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chunk(text, usage=None) -> bytes:
    c = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    if usage is not None:
        c["usage"] = usage
    return ev(c)


USAGE = ev({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
            "usage": {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33,
                      "prompt_tokens_details": {"cached_tokens": 16}}})
DONE = b"data: [DONE]\n\n"
ANSWER = chunk("a") + chunk("b") + chunk("c") + USAGE + DONE
WITHOUT = chunk("a") + chunk("b") + chunk("c") + DONE


def run(parts) -> tuple[bytes, list[bytes], UsageStrip]:
    s = UsageStrip()
    out = [s.feed(p) for p in parts]
    out.append(s.flush())
    return b"".join(out), out, s


def test_the_usage_event_split_across_two_chunks_is_taken_out():
    i = ANSWER.index(USAGE) + 25  # inside the usage event
    got, outs, s = run([ANSWER[:i], ANSWER[i:]])
    assert got == WITHOUT and s.dropped == 1
    assert outs[0] == chunk("a") + chunk("b") + chunk("c")  # the complete events went on at once


def test_several_events_in_one_chunk_and_done_kept():
    got, outs, s = run([ANSWER])
    assert got == WITHOUT and outs[0] == WITHOUT and s.dropped == 1
    assert outs[0].endswith(DONE)


@pytest.mark.parametrize("size", [1, 2, 7, 64, 200])
def test_any_cut_gives_the_same_bytes(size):
    got, outs, _ = run([ANSWER[i:i + size] for i in range(0, len(ANSWER), size)])
    assert got == WITHOUT
    # nothing is held back past its event's end: what went on after each chunk ends at an event boundary
    assert all(o == b"" or o.endswith(b"\n\n") for o in outs[:-1])


def test_an_answer_without_the_usage_event_passes_unchanged():
    body = chunk("a") + chunk("b") + DONE
    got, outs, s = run([body])
    assert got == body and outs[0] == body and s.dropped == 0


def test_continuous_usage_chunks_error_events_and_other_lines_are_kept():
    cont = chunk("a", usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4})
    err = ev({"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}})
    odd = b": keep-alive\n\n" + b"data: not json with \"usage\"\n\n" + b'data: {"usage":{},"choices":null}\n\n'
    body = cont + odd + err + USAGE + DONE
    got, _, s = run([body])
    assert got == cont + odd + err + DONE and s.dropped == 1


def test_an_answer_that_ends_without_its_blank_line():
    got, _, _ = run([chunk("a") + USAGE[:-2]])
    assert got == chunk("a")
    got, _, _ = run([chunk("a") + b"data: [DONE]"])
    assert got == chunk("a") + b"data: [DONE]"


def test_an_endless_event_is_not_held_forever():
    s = UsageStrip()
    assert s.feed(b"data: " + b"x" * 1000) == b""
    big = b"y" * HOLD_MAX
    out = s.feed(big)
    assert out == b"data: " + b"x" * 1000 + big  # given up on: passed on as it is
    assert s.feed(b"z\n\n") == b"z\n\n"


def test_is_usage_only():
    assert is_usage_only(USAGE[:-2])
    assert not is_usage_only(chunk("a", usage={"prompt_tokens": 1})[:-2])
    assert not is_usage_only(DONE[:-2])
    assert not is_usage_only(b'data: {"choices":[]}')  # no usage: not vLLM's usage event


def test_needs_asking_and_asking():
    base = {"model": "m", "messages": [{"role": "user", "content": "héllo"}], "temperature": 0.7}
    assert not needs_asking(base)  # not a stream: the JSON answer has usage
    assert not needs_asking({**base, "stream": False})
    assert needs_asking({**base, "stream": True})
    assert needs_asking({**base, "stream": True, "stream_options": None})
    assert needs_asking({**base, "stream": True, "stream_options": {"include_usage": False}})
    assert not needs_asking({**base, "stream": True, "stream_options": {"include_usage": True}})
    out = msgspec.json.decode(asking({**base, "stream": True}))
    assert out == {**base, "stream": True, "stream_options": {"include_usage": True}}
    # vLLM reads continuous_usage_stats only with include_usage: for this client it meant nothing
    out = msgspec.json.decode(asking({**base, "stream": True,
                                      "stream_options": {"include_usage": False, "continuous_usage_stats": True}}))
    assert out["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert out["messages"] == base["messages"] and out["temperature"] == 0.7
