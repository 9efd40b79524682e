"""The stop check alone: which appended token ends a request, and why.

``StopChecker`` is built from a two-field config and, for stop strings, a tokenizer that decodes each token id
to one character (``chr``), so every expected text and stop below is worked out by hand from the rules in
``minillm/core/stopping.py`` (vLLM's ``check_stop``): EOS, a stop token, a stop string, ``max_tokens``,
``max_model_len``, the simulator's trace length; ``min_tokens`` holds back all but the length limits.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minillm.core.request import Request
from minillm.core.stopping import StopChecker
from minillm.sampling_params import SamplingParams

EOS = 2


class CharTokenizer:
    """Token id i is the character chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def checker(max_model_len: int = 100, runs_model: bool = True, tokenizer=None) -> StopChecker:
    return StopChecker(SimpleNamespace(max_model_len=max_model_len, runs_model=runs_model), tokenizer)


def request(prompt_len: int = 6, expected_output_len=None, **params) -> Request:
    params.setdefault("max_tokens", 16)
    return Request(
        "r",
        list(range(10, 10 + prompt_len)),
        SamplingParams(**params),
        arrival_time=0.0,
        eos_token_id=EOS,
        expected_output_len=expected_output_len,
    )


def run(stops: StopChecker, req: Request, tokens) -> list:
    """Append each token and check it, as the scheduler does: the check's answer per token."""
    out = []
    for i, tok in enumerate(tokens):
        req.append_token(tok, float(i))
        out.append(stops.check(req, tok))
    return out


def test_eos_stops_and_leaves_no_stop_reason():
    r = request()
    assert run(checker(), r, [50, EOS]) == [None, "stop"] and r.stop_reason is None


def test_ignore_eos_runs_past_it_to_max_tokens():
    r = request(max_tokens=3, ignore_eos=True)
    assert run(checker(), r, [EOS, EOS, EOS]) == [None, None, "length"]


def test_a_stop_token_stops_and_is_kept_as_the_stop_reason():
    r = request(stop_token_ids=[7, 8])
    assert run(checker(), r, [50, 8]) == [None, "stop"] and r.stop_reason == 8


def test_min_tokens_holds_back_eos_and_stop_tokens_until_it_is_reached():
    r = request(min_tokens=3, stop_token_ids=[7])
    # outputs of length 1 and 2 are below min_tokens: neither EOS nor 7 ends them; the third token does
    assert run(checker(), r, [EOS, 7, EOS]) == [None, None, "stop"] and r.stop_reason is None
    r = request(min_tokens=2, stop_token_ids=[7])
    assert run(checker(), r, [7, 7]) == [None, "stop"] and r.stop_reason == 7


def test_the_length_limits_max_tokens_and_max_model_len():
    assert run(checker(), request(max_tokens=2), [50, 51]) == [None, "length"]
    # prompt 6 + output 2 reaches max_model_len 8, before max_tokens 16
    assert run(checker(max_model_len=8), request(), [50, 51]) == [None, "length"]


def test_min_tokens_does_not_hold_back_the_length_limits():
    # prompt 6 + 1 output token reaches max_model_len 7, although min_tokens asks for 3
    assert run(checker(max_model_len=7), request(min_tokens=3), [50]) == ["length"]


def test_the_simulator_stops_at_the_traces_output_length_and_a_model_does_not():
    assert run(checker(runs_model=False), request(expected_output_len=2), [50, 51]) == [None, "stop"]
    assert run(checker(runs_model=True), request(expected_output_len=2), [50, 51, 52]) == [None, None, None]


def test_a_stop_string_is_matched_on_the_text_and_cut_from_it():
    # tokens 97..100 are "a", "b", "c", "d": "cd" appears when "d" arrives
    r = request(stop=["cd"])
    assert run(checker(tokenizer=CharTokenizer()), r, [97, 98, 99, 100]) == [None, None, None, "stop"]
    assert r.stop_reason == "cd" and r.stop_text == "ab"
    r = request(stop=["cd"], include_stop_str_in_output=True)
    run(checker(tokenizer=CharTokenizer()), r, [97, 98, 99, 100])
    assert r.stop_text == "abcd"


def test_the_earliest_of_two_stop_strings_wins():
    r = request(stop=["bcd", "cd"])
    run(checker(tokenizer=CharTokenizer()), r, [97, 98, 99, 100])
    assert r.stop_reason == "bcd" and r.stop_text == "a"


def test_stop_strings_need_the_tokenizer_and_wait_for_min_tokens():
    assert run(checker(tokenizer=None), request(stop=["cd"]), [99, 100]) == [None, None]
    # "cd" completes at the second token, below min_tokens=3: it is not matched then, nor later
    r = request(stop=["cd"], min_tokens=3)
    assert run(checker(tokenizer=CharTokenizer()), r, [99, 100, 101]) == [None, None, None]
    assert r.stop_reason is None


@pytest.mark.parametrize(
    "kw, tok, expected",
    [
        (dict(), 50, 6),  # min(max_tokens 10, 100 - 6) - 3 output - 1
        (dict(max_model_len=12), 50, 2),  # min(10, 12 - 6) - 3 - 1
        (dict(runs_model=False, expected_output_len=5), 50, 1),  # min(10, 94, 5) - 3 - 1
        (dict(), EOS, 0),  # EOS may end it
        (dict(stop_token_ids=[50]), 50, 0),  # a stop token may end it
        (dict(stop=["x"], tokenizer=CharTokenizer()), 50, 0),  # stop strings are matched on each token
    ],
)
def test_num_tokens_before_stop_is_how_far_the_check_is_certain_to_say_none(kw, tok, expected):
    stops = checker(
        max_model_len=kw.pop("max_model_len", 100),
        runs_model=kw.pop("runs_model", True),
        tokenizer=kw.pop("tokenizer", None),
    )
    r = request(max_tokens=10, expected_output_len=kw.pop("expected_output_len", None), **kw)
    run(stops, r, [60, 61, 62])
    assert stops.num_tokens_before_stop(r, tok) == expected
    if expected:  # that many more: the check says None after each, and the next ends it
        assert run(stops, r, [tok] * expected) == [None] * expected
        assert run(stops, r, [tok]) != [None]
