"""Unit tests of the protocol layer that need no engine: stop strings, tool calls, SSE frames, schemas."""

from __future__ import annotations

import json

import pytest

from astrai.serving.errors import APIError, error_body
from astrai.serving.schemas import ChatCompletionRequest, MessagesRequest
from astrai.serving.sse import sse_event
from astrai.inference.stop import StopChecker
from astrai.serving.toolcalls import ParsedToolCall, ToolCallStreamParser, parse_tool_calls, render_tool_call


def feed_all(checker: StopChecker, pieces: list[str]) -> str:
    return "".join(checker.push(p) for p in pieces) + checker.flush()


def test_stop_string_split_across_pieces_is_cut_and_never_emitted():
    checker = StopChecker(["END"])
    out = [checker.push(p) for p in ["hello E", "N", "D and more"]]
    assert "".join(out) == "hello "
    assert checker.matched == "END"
    assert out[0] == "hello "  # the possible start "E" was held back
    assert checker.push("more") == "" and checker.flush() == ""


def test_stop_checker_releases_held_text_when_ruled_out_and_at_flush():
    checker = StopChecker(["###"])
    assert checker.push("a#") == "a"
    assert checker.push("#b") == "##b"
    assert checker.push("c#") == "c"
    assert checker.flush() == "#"
    assert checker.matched is None


def test_stop_checker_picks_earliest_match_among_several():
    checker = StopChecker(["world", "lo w"])
    assert feed_all(checker, ["hel", "lo world"]) == "hel"
    assert checker.matched == "lo w"


def test_stop_checker_without_stops_passes_text_through():
    checker = StopChecker([])
    assert feed_all(checker, ["a", "b"]) == "ab"


def test_tool_call_in_tags_is_parsed_with_surrounding_content():
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "巴黎"}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert calls == [ParsedToolCall("get_weather", json.dumps({"city": "巴黎"}, ensure_ascii=False))]
    assert json.loads(calls[0].arguments) == {"city": "巴黎"}


def test_bare_json_reply_is_a_tool_call_as_the_template_asks():
    content, calls = parse_tool_calls('  {"name": "add", "arguments": "{\\"a\\": 1}"} {"name": "neg", "arguments": {}}')
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1}), ("neg", {})]


@pytest.mark.parametrize("text", ['{"name": "f", "arguments": [1]}', '<tool_call>{"name": 3}</tool_call>',
                                  "<tool_call>{not json}</tool_call>", "{ just braces", "plain text"])
def test_text_that_is_not_a_valid_call_stays_content(text):
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == text


def test_streaming_parser_holds_a_split_tag_and_emits_the_call_whole():
    parser = ToolCallStreamParser()
    pieces = []
    for chunk in ["Hi <tool", '_call>{"name": "f", "argu', 'ments": {"x": 1}}</tool_', "call> bye"]:
        pieces += parser.feed(chunk)
    pieces += parser.finish()
    texts = [p for p in pieces if isinstance(p, str)]
    calls = [p for p in pieces if isinstance(p, ParsedToolCall)]
    assert "".join(texts) == "Hi  bye"
    assert calls == [ParsedToolCall("f", '{"x": 1}')]
    assert pieces[0] == "Hi "  # text before the tag was not held


def test_streaming_parser_releases_plain_text_immediately():
    parser = ToolCallStreamParser()
    assert parser.feed("Hello") == ["Hello"]
    assert parser.feed(" <b>") == [" <b>"]


def test_rendered_past_call_parses_back():
    rendered = render_tool_call("lookup", '{"q": "astrai"}')
    assert parse_tool_calls(rendered)[1] == [ParsedToolCall("lookup", '{"q": "astrai"}')]


def test_sse_frames_are_single_line_json_ending_in_a_blank_line():
    frame = sse_event({"text": "a\nb"}, event="content_block_delta")
    assert frame == 'event: content_block_delta\ndata: {"text":"a\\nb"}\n\n'
    assert sse_event("[DONE]") == "data: [DONE]\n\n"


def test_error_bodies_follow_each_protocol():
    err = APIError("overloaded", "busy")
    assert err.status == 503 and err.headers() == {"Retry-After": "1"}
    assert error_body(err, anthropic=True) == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    assert error_body(err, anthropic=False)["error"]["message"] == "busy"


def test_schemas_bound_the_fields_the_server_acts_on():
    ok = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                               "stop": "x", "unknown_vendor_field": 1})
    assert ok.stop_list() == ["x"] and ok.n == 1
    for bad in ({"model": "m", "messages": []}, {"model": "m", "messages": [{"role": "user"}], "max_tokens": -1},
                {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [""]},
                {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}):
        with pytest.raises(ValueError):
            ChatCompletionRequest.model_validate(bad)
    with pytest.raises(ValueError):
        MessagesRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
