"""The request path's small rules, one function at a time: an engine's error passed on
(status, message, param, code), the explain header's view of a decision, the query
parameters' parsing, which chat content parts are accepted, the SSE splitting and
token detection, the JSON splice, and the lean client's HTTP/1.1 answer parser fed byte
by byte (chunk sizes in hex, chunk extensions, trailers, 1xx answers, bodies delimited
by the connection's end)."""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import json
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from mooncake_contract.tokenizer import VOCAB_SIZE
from mooncake_gateway.admin import _bool_query, _int_query
from mooncake_gateway.decoding import _has_token, _split_events
from mooncake_gateway.dispatch import _header_view, finite
from mooncake_gateway.enginecalls import relayed_error, splice_json
from mooncake_gateway.errors import ApiError
from mooncake_gateway.front import FrontServer, _Date
from mooncake_gateway.upstream import UpstreamCallError, UpstreamPool, _Connection
from mooncake_gateway.validate import _text_part, parse_request


# -- an engine's error, passed on ---------------------------------------------------------
def _err(e: ApiError) -> tuple[int, str, str | None, str | None]:
    return e.status, e.message, e.param, e.code


def test_an_engine_4xx_keeps_its_status_message_param_and_code() -> None:
    body = {"error": {"message": "prompt too long", "type": "BadRequestError",
                      "param": "prompt", "code": "context_length_exceeded"}}
    assert _err(relayed_error(400, body)) == (400, "prompt too long", "prompt",
                                               "context_length_exceeded")
    assert _err(relayed_error(499, body))[0] == 499
    assert _err(relayed_error(422, {"error": {"message": "bad", "param": None,
                                               "code": "c"}})) == (422, "bad", None, "c")
    # the OpenAI shape of what the client gets
    assert relayed_error(404, body).body() == {"error": {
        "message": "prompt too long", "type": "not_found_error", "param": "prompt",
        "code": "context_length_exceeded"}}


def test_an_engine_error_outside_4xx_is_a_502() -> None:
    for status in (500, 501, 505, 302, 399):
        e = relayed_error(status, {"error": {"message": "boom", "param": "x", "code": "y"}})
        assert _err(e) == (502, "boom", "x", "y")
        assert e.body()["error"]["type"] == "upstream_error"


def test_an_engine_error_without_an_openai_body_names_the_status() -> None:
    odd: list[Any] = [None, [1, 2], "text", 3, {}, {"error": "a string"}, {"error": None},
                      {"error": [1]}, {"error": {}}, {"error": {"message": ""}},
                      {"error": {"message": None}}]
    for resp in odd:
        assert _err(relayed_error(418, resp)) == (418, "engine answered HTTP 418", None,
                                                   None), resp
        assert _err(relayed_error(503, resp)) == (502, "engine answered HTTP 503", None,
                                                   None), resp


# -- the explain header's view --------------------------------------------------------------
def test_the_header_view_keeps_the_routing_fields_and_makes_floats_finite() -> None:
    record = {"id": "r1", "policy": "conductor", "prefill": "p0", "decode": "d0",
              "local_blocks": 3, "fetch_blocks": 1,
              "predicted": {"queue_s": 0.5, "ttft_s": math.inf, "tbt_s": -math.inf,
                            "transfer_s": math.nan},
              "decision_us": 12.5, "candidates": [{"ttft_s": math.inf, "queue_s": 1.0}],
              "direct": False,
              # not in the header: the body and /conductor/decisions have them
              "time": 1.0, "model": "m", "attempts": [], "reject_reason": None,
              "held_blocks": 2}
    view = _header_view(record)
    assert view == {"id": "r1", "policy": "conductor", "prefill": "p0", "decode": "d0",
                    "local_blocks": 3, "fetch_blocks": 1,
                    "predicted": {"queue_s": 0.5, "ttft_s": None, "tbt_s": None,
                                  "transfer_s": None},
                    "decision_us": 12.5, "candidates": [{"ttft_s": None, "queue_s": 1.0}],
                    "direct": False}
    json.dumps(view, allow_nan=False)  # what a header can carry
    assert _header_view({"id": "x"}) == {"id": "x"}  # fields a record lacks stay out


def test_finite_only_replaces_non_finite_floats() -> None:
    assert finite(1.5) == 1.5 and finite(0.0) == 0.0 and finite(-2.0) == -2.0
    assert finite(math.nan) is None and finite(math.inf) is None
    assert finite(7) == 7 and finite("inf") == "inf" and finite(None) is None
    assert finite([1.0, [math.inf, {"a": -math.inf, "b": 2.0}]]) == \
        [1.0, [None, {"a": None, "b": 2.0}]]
    assert finite({"k": 3, "l": [0.25]}) == {"k": 3, "l": [0.25]}


# -- query parameters -----------------------------------------------------------------------
def _q(query: str) -> Any:
    return make_mocked_request("GET", f"/conductor/hot-prefixes{query}")


def test_bool_query_values() -> None:
    for query, want in (
            ("", False), ("?tokens=", False), ("?tokens=0", False), ("?tokens=false", False),
            ("?tokens=FALSE", False), ("?tokens=No", False), ("?tokens=no", False),
            ("?tokens=1", True), ("?tokens=true", True), ("?tokens=True", True),
            ("?tokens=yes", True), ("?tokens=YES", True), ("?other=1", False)):
        assert _bool_query(_q(query), "tokens") is want, query


def test_bool_query_refuses_other_values_naming_the_parameter() -> None:
    for value in ("2", "on", "off", "y", "n", "truee", "%201", "-1", "t"):
        with pytest.raises(ApiError) as e:
            _bool_query(_q(f"?tokens={value}"), "tokens")
        assert _err(e.value) == (400, "'tokens' must be 1/true/yes or 0/false/no", "tokens",
                                 None), value


def test_int_query_values_and_refusals() -> None:
    assert _int_query(_q(""), "limit", 9) == 9
    assert _int_query(_q("?limit=0"), "limit", 9) == 0
    assert _int_query(_q("?limit=12"), "limit", 9) == 12
    assert _int_query(_q("?limit=+3"), "limit", 9) == 3
    for bad in ("x", "1.5", ""):
        with pytest.raises(ApiError) as e:
            _int_query(_q(f"?limit={bad}"), "limit", 9)
        assert _err(e.value) == (400, "'limit' must be an integer", "limit", None)
    for neg in ("-1", "-100"):
        with pytest.raises(ApiError) as e:
            _int_query(_q(f"?limit={neg}"), "limit", 9)
        assert _err(e.value) == (400, "'limit' must not be negative", "limit", None)


# -- chat content parts ---------------------------------------------------------------------
PARTS: list[tuple[Any, bool]] = [
    ({"type": "text", "text": "hi"}, True),
    ({"text": "hi"}, True),  # the type defaults to text
    ({"type": "text"}, True),  # no text: nothing to tokenize
    ({"type": "text", "text": None}, True),
    ({}, True),
    ({"type": "image_url", "image_url": {"url": "x"}}, True),  # tokenized as no text
    ({"type": "text", "text": 5}, False),
    ({"type": "text", "text": ["a"]}, False),
    ({"text": {"a": 1}}, False),
    ({"type": 5, "text": "hi"}, False),
    ({"type": None, "text": "hi"}, False),
    ("hi", False), (["hi"], False), (None, False), (3, False),
]


def test_text_parts() -> None:
    for part, ok in PARTS:
        assert _text_part(part) is ok, part


def test_chat_content_that_is_no_text_parts_is_refused_naming_the_message() -> None:
    for messages, problem in (
            ([{"role": "user", "content": [{"type": "text", "text": 5}]}],
             "messages[0].content must be a string or text parts"),
            ([{"role": "user", "content": "ok"}, {"role": "user", "content": ["x"]}],
             "messages[1].content must be a string or text parts"),
            ([{"role": "user", "content": 3}],
             "messages[0].content must be a string or text parts"),
            ([], "'messages' must be a non-empty list")):
        with pytest.raises(ApiError) as e:
            parse_request({"model": "m", "messages": messages}, True, None)
        assert _err(e.value) == (400, problem, "messages", None)
    parts = [{"type": "text", "text": "a"}, {"text": "b"}]
    p = parse_request({"model": "m", "messages": [{"role": "user", "content": parts}]},
                      True, None)
    assert p.messages == [{"role": "user", "content": parts}] and p.chat


# -- SSE events -----------------------------------------------------------------------------
def test_split_events_keeps_the_unfinished_tail() -> None:
    assert _split_events(b"") == ([], b"")
    assert _split_events(b"data: 1") == ([], b"data: 1")
    assert _split_events(b"data: 1\n\n") == ([b"data: 1"], b"")
    assert _split_events(b"data: 1\n\n\n\ndata: 2\n\ndata: 3") == \
        ([b"data: 1", b"data: 2"], b"data: 3")
    assert _split_events(b" data: 1 \n\n  \n\n") == ([b"data: 1"], b"")


def _ev(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode()


def test_has_token_only_for_generated_text() -> None:
    assert _has_token(_ev({"choices": [{"text": "a"}]}))
    assert _has_token(b"data:" + json.dumps({"choices": [{"text": "a"}]}).encode())
    assert _has_token(_ev({"choices": [{"delta": {"content": "a"}}]}))
    assert _has_token(_ev({"choices": [{"text": ""}, {"text": "b"}]}))
    assert not _has_token(_ev({"choices": [{"delta": {"role": "assistant"}}]}))
    assert not _has_token(_ev({"choices": [{"delta": {"content": ""}}]}))
    assert not _has_token(_ev({"choices": [{"delta": None, "text": None}]}))
    assert not _has_token(_ev({"choices": [{"text": ""}]}))
    assert not _has_token(_ev({"choices": []}))
    assert not _has_token(_ev({"choices": None}))
    assert not _has_token(_ev({"usage": {"completion_tokens": 3}}))
    assert not _has_token(b"data: [DONE]")
    assert not _has_token(b"data: {not json")
    assert not _has_token(b": comment " + _ev({"choices": [{"text": "a"}]}))
    assert not _has_token(b"event: x\n" + _ev({"choices": [{"text": "a"}]}))


# -- the JSON splice ------------------------------------------------------------------------
def test_splice_appends_overrides_as_later_keys_without_reencoding() -> None:
    raw = b'{ "prompt" : [1,  2], "max_tokens": 9 }\n  '
    out = splice_json(raw, {"max_tokens": 1, "kv_transfer_params": {"a": None}})
    assert out == b'{ "prompt" : [1,  2], "max_tokens": 9 ,"max_tokens":1,' \
                  b'"kv_transfer_params":{"a":null}}'
    assert json.loads(out) == {"prompt": [1, 2], "max_tokens": 1,
                               "kv_transfer_params": {"a": None}}


@pytest.mark.parametrize("raw", [b"{}", b"{ }", b' {\n}\n', b'{"x": {}}', b'{"x": "{"}',
                                 b'{"x": ["}", {"y": {}}]}'])
def test_splice_of_any_object_parses_with_the_overrides_last(raw: bytes) -> None:
    assert json.loads(splice_json(raw, {"a": 1, "x": 2})) == {**json.loads(raw), "a": 1,
                                                              "x": 2}


def test_splice_refuses_a_body_that_is_not_an_object() -> None:
    for raw in (b'{"x": 1}  junk', b"[1, 2]", b""):
        with pytest.raises(ValueError, match="not a JSON object"):
            splice_json(raw, {"a": 1})


# -- the lean client's answer parser --------------------------------------------------------
Run = Callable[[Coroutine[Any, Any, None]], None]


class _Transport:
    """What the parser writes to and closes."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, _name: str, default: Any = None) -> Any:
        return default


def _conn() -> tuple[_Connection, _Transport]:
    pool = UpstreamPool(1.0, 1.0, 1.0)
    conn = _Connection(pool, ("127.0.0.1", 1))
    transport = _Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


def _feed(answer: bytes, pieces: list[int]) -> tuple[Any, _Connection, list[bool]]:
    """``answer`` fed in pieces cut at ``pieces``: the waiter, the connection, and
    whether the waiter was done after each piece."""
    conn, _t = _conn()
    waiter = conn.start(b"POST /x HTTP/1.1\r\n\r\n")
    done = []
    cuts = [0, *pieces, len(answer)]
    for a, b in itertools.pairwise(cuts):
        if a < b:
            conn.data_received(answer[a:b])
            done.append(waiter.done())
    return waiter, conn, done


def _every_way(answer: bytes, status: int, body: bytes, reusable: bool = True) -> None:
    """Whole, byte by byte and in two pieces at every cut: done only with the last byte,
    with ``(status, body)``."""
    async def main() -> None:
        for pieces in ([], list(range(1, len(answer))),
                       *([cut] for cut in range(1, len(answer)))):
            waiter, conn, done = _feed(answer, pieces)
            assert done == [False] * (len(done) - 1) + [True], (pieces, done)
            assert waiter.result() == (status, body), pieces
            assert conn.reusable is reusable

    asyncio.run(main())


def test_chunk_sizes_are_hex_with_extensions_and_trailers() -> None:
    data1, data2 = b"x" * 0x1A, b"0123456789AB"
    answer = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"1a\r\n" + data1 + b"\r\n"
              b"C;name=value;other=\"x\"\r\n" + data2 + b"\r\n"
              b"0\r\nX-Trailer: 1\r\nX-Other: 2\r\n\r\n")
    _every_way(answer, 200, data1 + data2)


def test_a_chunked_answer_without_trailers_ends_at_its_empty_line() -> None:
    answer = (b"HTTP/1.1 201 Created\r\ntransfer-encoding: gzip, Chunked\r\n"
              b"Content-Length: 3\r\n\r\n"  # chunked wins over a length
              b"3\r\nabc\r\n0\r\n\r\n")
    _every_way(answer, 201, b"abc")


def test_informational_answers_precede_the_real_one() -> None:
    answer = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"
              b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
    _every_way(answer, 200, b"hello")


def test_content_length_bodies_and_bodiless_statuses() -> None:
    _every_way(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n{\"a\":1}", 200, b'{"a":1}')
    _every_way(b"HTTP/1.1 200\r\ncontent-length:  0 \r\n\r\n", 200, b"")  # no reason phrase
    _every_way(b"HTTP/1.1 204 No Content\r\n\r\n", 204, b"")
    _every_way(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n", 304, b"")
    _every_way(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
               200, b"ok", reusable=False)
    _every_way(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", 200, b"ok",
               reusable=False)
    _every_way(b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 2\r\n\r\nok",
               200, b"ok")
    _every_way(b"HTTP/1.1 200 OK\r\nX: y\r\nno colon here\r\nContent-Length: 2\r\n\r\nok",
               200, b"ok")


def test_bytes_past_the_answer_make_the_connection_unusable() -> None:
    async def main() -> None:
        waiter, conn, _done = _feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA", [])
        assert waiter.result() == (200, b"ok") and not conn.reusable
        waiter, conn, _done = _feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", [])
        assert waiter.result() == (200, b"ok") and conn.reusable
        # bytes nobody asked for, between calls: closed
        conn.data_received(b"HTTP/1.1 200 OK\r\n")
        assert conn.closed and not conn.reusable

    asyncio.run(main())


def test_a_body_until_the_connection_ends() -> None:
    async def main() -> None:
        conn, _t = _conn()
        waiter = conn.start(b"POST /x HTTP/1.1\r\n\r\n")
        conn.data_received(b"HTTP/1.1 200 OK\r\n\r\n")
        conn.data_received(b"part one, ")
        conn.data_received(b"part two")
        assert not waiter.done()
        assert conn.eof_received() is None
        assert waiter.result() == (200, b"part one, part two")
        assert not conn.reusable
        # an end before the head is complete: no answer (the loss fails the call)
        conn, _t = _conn()
        waiter = conn.start(b"POST /x HTTP/1.1\r\n\r\n")
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Le")
        conn.eof_received()
        assert not waiter.done()
        conn.connection_lost(None)
        with pytest.raises(UpstreamCallError) as e:
            waiter.result()
        assert str(e.value) == "ServerDisconnectedError"
        # a length-delimited body cut short by the end: not an answer either
        conn, _t = _conn()
        waiter = conn.start(b"POST /x HTTP/1.1\r\n\r\n")
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        conn.eof_received()
        assert not waiter.done()
        conn.connection_lost(ConnectionResetError())
        with pytest.raises(UpstreamCallError) as e:
            waiter.result()
        assert str(e.value) == "ConnectionResetError"
        # chunked, cut short
        conn, _t = _conn()
        waiter = conn.start(b"POST /x HTTP/1.1\r\n\r\n")
        conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab")
        conn.eof_received()
        assert not waiter.done()

    asyncio.run(main())


MALFORMED = [
    b"SSH-2.0-x\r\n\r\n",
    b"HTTP/1.1 20\r\n\r\n",  # shorter than a status line
    b"HTTP/2 200 OK\r\n\r\n",
    b"HTTP/1.1 2x0 OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
]


def test_a_malformed_answer_fails_the_call_and_closes() -> None:
    async def main() -> None:
        for answer in MALFORMED:
            waiter, conn, _done = _feed(answer, [])
            with pytest.raises(UpstreamCallError) as e:
                waiter.result()
            assert str(e.value).startswith("bad HTTP answer: "), answer
            assert conn.closed

    asyncio.run(main())


def test_a_timed_out_call_fails_as_timeout_error_and_closes() -> None:
    async def main() -> None:
        conn, transport = _conn()
        waiter = conn.start(b"POST /x HTTP/1.1\r\n\r\n")
        assert transport.written == [b"POST /x HTTP/1.1\r\n\r\n"]
        conn.timed_out()
        with pytest.raises(UpstreamCallError) as e:
            waiter.result()
        assert str(e.value) == "TimeoutError"
        assert conn.closed and transport.closed and not conn.reusable

    asyncio.run(main())


def test_a_new_call_on_a_connection_starts_from_a_clean_parser() -> None:
    async def main() -> None:
        conn, transport = _conn()
        first = conn.start(b"A")
        conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                           b"2\r\nab\r\n0\r\n\r\n")
        assert first.result() == (200, b"ab")
        second = conn.start(b"B")
        conn.data_received(b"HTTP/1.1 404 NF\r\nContent-Length: 3\r\n\r\nxyz")
        assert second.result() == (404, b"xyz")
        third = conn.start(b"C")
        conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                           b"1\r\nq\r\n0\r\n\r\n")
        assert third.result() == (200, b"q")
        assert transport.written == [b"A", b"B", b"C"] and conn.reusable

    asyncio.run(main())


# -- prompts as token ids -------------------------------------------------------------------
def test_token_id_prompts_accepted_and_refused() -> None:
    good: list[Any] = [[5], [[5]], [0, VOCAB_SIZE - 1], [7] * 3]
    for prompt in good:
        p = parse_request({"model": "m", "prompt": prompt}, False, None)
        assert p.prompt_ids is not None and p.prompt_ids.dtype == np.int64
        assert p.prompt_ids.tolist() == (prompt[0] if isinstance(prompt[0], list) else prompt)
    not_ids = "'prompt' must be a string or a list of token ids"
    bad: list[tuple[Any, str]] = [
            ([2**64 - 1], not_ids),  # unsigned 64-bit: no token id, not wrapped around
            ([1, 2**64 - 1], not_ids),
            ([2**70], not_ids),
            ([True, 1], not_ids),
            ([1.0, 2], not_ids),
            ([-1], f"token ids must be in [0, {VOCAB_SIZE})"),
            ([1, VOCAB_SIZE], f"token ids must be in [0, {VOCAB_SIZE})"),
            ([1, "a"], not_ids)]
    for prompt, message in bad:
        with pytest.raises(ApiError) as e:
            parse_request({"model": "m", "prompt": prompt}, False, None)
        assert _err(e.value) == (400, message, "prompt", None), prompt


def test_prompts_that_are_empty_batched_or_of_another_type_are_refused_by_name() -> None:
    empty = "'prompt' must not be empty"
    batch = "batches of several prompts are not supported"
    not_ids = "'prompt' must be a string or a list of token ids"
    cases: list[tuple[Any, str]] = [
        ("", empty), ([], empty), ([""], empty), ([[]], empty),
        (["a", "b"], batch), ([[1], [2]], batch), (["a", [1]], batch),
        (None, not_ids), (3, not_ids), ({"text": "a"}, not_ids), ([None], not_ids),
        ([1, None], not_ids), ([[1], "a", 3], not_ids)]
    for prompt, message in cases:
        with pytest.raises(ApiError) as e:
            parse_request({"model": "m", "prompt": prompt}, False, None)
        assert _err(e.value) == (400, message, "prompt", None), prompt
    # a batch of one is its prompt
    assert parse_request({"model": "m", "prompt": ["hi"]}, False, None).prompt_text == "hi"


def test_request_fields_refused_with_their_message_and_parameter() -> None:
    ok = {"model": "m", "prompt": "hi"}
    cases: list[tuple[Any, bool, str | None, str, str | None]] = [
        ([ok], False, "m", "request body must be a JSON object", None),
        ("text", True, "m", "request body must be a JSON object", None),
        ({"prompt": "hi"}, False, None, "'model' is required", "model"),
        ({**ok, "model": None}, False, None, "'model' is required", "model"),
        ({**ok, "model": 3}, False, "m", "'model' must be a string", "model"),
        ({**ok, "stream": "yes"}, False, None, "'stream' must be a boolean", "stream"),
        ({**ok, "stream": 1}, False, None, "'stream' must be a boolean", "stream"),
        ({**ok, "stream_options": []}, False, None, "'stream_options' must be an object",
         "stream_options"),
        ({**ok, "n": 2}, False, None, "only n=1 is supported", "n"),
        ({**ok, "n": True}, False, None, "only n=1 is supported", "n"),
        ({**ok, "n": 1.0}, False, None, "only n=1 is supported", "n"),
        ({**ok, "max_tokens": 0}, False, None, "'max_tokens' must be a positive integer",
         "max_tokens"),
        ({**ok, "max_tokens": True}, False, None, "'max_tokens' must be a positive integer",
         "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "a"}],
          "max_completion_tokens": -1}, True, None,
         "'max_completion_tokens' must be a positive integer", "max_completion_tokens"),
        ({**ok, "kv_transfer_params": {}}, False, None,
         "'kv_transfer_params' is set by the gateway", "kv_transfer_params"),
    ]
    for data, chat, default, message, param in cases:
        with pytest.raises(ApiError) as e:
            parse_request(data, chat, default)
        assert _err(e.value) == (400, message, param, None), data
    # what is accepted: the default model, no stream, max_completion_tokens first in chat
    p = parse_request({"prompt": "hi", "stream": None, "n": 1}, False, "dflt")
    assert (p.model, p.chat, p.stream, p.max_tokens) == ("dflt", False, False, None)
    p = parse_request({"model": "m", "messages": [{"role": "user", "content": "a"}],
                       "max_completion_tokens": 5, "max_tokens": 9, "stream": True},
                      True, None)
    assert (p.chat, p.stream, p.max_tokens) == (True, True, 5)
    assert parse_request({**ok, "max_tokens": 7}, False, None).max_tokens == 7


# -- the front end's answer head ------------------------------------------------------------
def test_the_date_header_is_now_in_gmt() -> None:
    d = _Date()
    before = time.time()
    value = d.get()
    stamp = email.utils.parsedate_to_datetime(value.decode("ascii")).timestamp()
    assert value.endswith(b" GMT")
    assert int(before) - 1 <= stamp <= time.time() + 1
    assert d.get() in (value, _Date().get())  # the same within a second


def test_the_front_end_writes_its_own_length_date_and_connection_headers() -> None:
    async def main() -> None:
        front = FrontServer(None, lambda: asyncio.Protocol(), 1000,  # type: ignore[arg-type]
                            60.0)
        try:
            resp = web.Response(body=b'{"a":1}', status=404, headers={
                "Content-Type": "application/json", "X-Keep": "1", "Content-Length": "99",
                "Connection": "keep-alive", "Transfer-Encoding": "chunked", "Date": "x"})
            for keep_alive in (True, False):
                raw = front.encode(resp, keep_alive)
                head, body = raw.split(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                assert lines[0] == b"HTTP/1.1 404 Not Found" and body == b'{"a":1}'
                date = next(x for x in lines if x.startswith(b"Date: "))
                assert email.utils.parsedate_to_datetime(date[6:].decode()).timestamp() > 0
                assert sorted(x for x in lines[1:] if x != date) == sorted(
                    [b"Content-Type: application/json", b"X-Keep: 1", b"Content-Length: 7"]
                    + ([] if keep_alive else [b"Connection: close"]))
            # no body, a status without a phrase
            raw = front.encode(web.Response(status=599), True)
            assert raw.startswith(b"HTTP/1.1 599 Unknown\r\n")
            assert b"\r\nContent-Length: 0\r\n" in raw and raw.endswith(b"\r\n\r\n")
        finally:
            front.close()

    asyncio.run(main())
