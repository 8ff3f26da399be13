"""``overlay_tools.simulate.trace``: a Mooncake trace parsed, split into sessions and given token ids,
on small traces written here (answers known by construction; never the shared trace)."""

from __future__ import annotations

import json

import pytest

from overlay_tools.simulate import trace
from overlay_tools.simulate.cache_kit import OUTPUT_TOKEN


def _write(tmp_path, rows, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _row(ts, n_in, n_out, ids):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


@pytest.mark.parametrize(("line", "field", "value"), [
    ('{"timestamp": 0, "input_length": 512, "output_length": 4}', "hash_ids", "None"),
    ('{"timestamp": "soon", "input_length": 512, "output_length": 4, "hash_ids": [1]}', "timestamp", "'soon'"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 4, "hash_ids": []}', "input_length", "0"),
    ('{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1]}', "hash_ids", "[1]"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 4, "hash_ids": ["a"]}', "hash_ids", "['a']"),
    ('{"timestamp": 0, "input_length": 512,', "(json)", ""),
    ('[1, 2]', "(json)", "[1, 2]"),
])
def test_a_malformed_line_is_an_error_naming_its_line_field_and_value(tmp_path, line, field, value):
    path = _write(tmp_path, [_row(0, 512, 4, [0]), line])
    with pytest.raises(trace.TraceError) as err:
        trace.read(path)
    assert err.value.line == 2 and err.value.field == field
    assert f":2: {field}=" in str(err.value) and value in str(err.value) and "expected" in str(err.value)


def test_arrivals_that_go_back_in_time_are_an_error_on_the_later_line(tmp_path):
    path = _write(tmp_path, [_row(10, 512, 4, [0]), _row(5, 512, 4, [1])])
    with pytest.raises(trace.TraceError, match=r":2: timestamp=5: expected arrivals in order"):
        trace.read(path)


def test_a_continuation_is_its_parents_prompt_then_its_output_then_new_tokens(tmp_path):
    """B's hash_ids start with all of A's full blocks: B continues A. C shares only A's first block
    (a shared system prompt): a new session whose first block has A's token ids."""
    path = _write(tmp_path, [
        _row(0, 1024 + 100, 40, [1, 2, 3]),
        _row(5, 2048, 8, [1, 2, 9, 10]),
        _row(6, 700, 8, [1, 77]),
    ])
    a, b, c = trace.load(path, page=16)
    assert (b.parent, b.session, c.parent, c.session) == (a.index, a.session, None, c.index)
    # the prompt page-rounded (1124 -> 1136); the tree keeps whole pages of prompt + output - 1 (1175 -> 1168)
    assert a.prompt_len == 1136 and a.out_tokens == 32 and a.history_len == 1168
    ta, tb, tc = (trace.materialize(r.prompt) for r in (a, b, c))
    history = list(ta) + [OUTPUT_TOKEN] * a.out_tokens
    assert list(tb[: len(history)]) == history and len(tb) == 2048
    assert len(set(tb[len(history):]) & set(ta)) == 0  # the new part is fresh
    assert list(tc[:512]) == list(ta[:512]) and len(set(tc[512:]) & set(ta)) == 0


def test_share_keeps_whole_sessions_and_is_seeded(tmp_path):
    rows = []
    for s in range(40):  # 40 sessions of two turns each
        rows.append(_row(2 * s, 512, 4, [1000 + s]))
        rows.append(_row(2 * s + 1, 1024, 4, [1000 + s, 5000 + s]))
    path = _write(tmp_path, rows)
    kept = trace.load(path, page=16, share=0.25, seed=3)
    again = trace.load(path, page=16, share=0.25, seed=3)
    assert [r.index for r in kept] == [r.index for r in again] and 0 < len(kept) < 80
    sessions = {r.session for r in kept}
    assert all(sum(r.session == s for r in kept) == 2 for s in sessions)
    with pytest.raises(ValueError, match="--share"):
        trace.sample_sessions(kept, 1.5, 0)


def _parents(requests):
    return [r.parent for r in requests]


def test_a_one_block_prompt_shared_by_many_requests_never_makes_a_parent(tmp_path):
    """Block 0 is a shared system prompt: requests of one full block plus a short message, and
    longer ones extending it with their own documents (different full blocks). Every length grows
    past the one before's prompt + output (the old rule linked each to the one before); none is a
    continuation: the one-block prefix is a branch point."""
    rows = [_row(10 * i, 520 + 40 * i, 4, [0, 100 + i]) for i in range(6)]
    rows += [_row(100 + i, 2048, 4, [0, 200 + 3 * i, 201 + 3 * i, 202 + 3 * i]) for i in range(3)]
    requests = trace.read(_write(tmp_path, rows))
    stats = trace.link_sessions(requests)
    assert _parents(requests) == [None] * 9 and stats.linked == 0 and stats.roots == 9
    assert stats.refused["branch point"] == 8  # every request after the first had a one-block candidate
    assert "0 requests linked to a parent, 9 roots" in stats.describe() and "8 branch point" in stats.describe()


def test_a_shared_prompt_whose_users_add_less_than_a_block_is_not_a_conversation(tmp_path):
    """No request extends block 0 with a full block (no branch to see), but their lengths are not one
    growing conversation (the third is shorter than the second's prompt + output): block 0 is a
    shared prefix and links nothing; the second's candidate is refused as that too, the third's as
    shorter than its history."""
    rows = [_row(0, 600, 20, [0, 1]), _row(1, 700, 20, [0, 2]), _row(2, 650, 20, [0, 3])]
    requests = trace.read(_write(tmp_path, rows))
    stats = trace.link_sessions(requests)
    assert _parents(requests) == [None, None, None]
    assert stats.refused == {"branch point": 0, "shorter than its history": 1, "shared prefix": 1}


def test_multi_turn_sessions_beside_a_shared_system_prompt_still_link(tmp_path):
    """Two conversations open with the shared one-block prompt 0 (and a stranger uses it too): each
    later turn carries its earlier turn's prompt + output (the parent's full blocks, then new ones),
    so turns link to their own conversation and the shared prompt links nothing."""
    rows = [
        _row(0, 700, 5, [0, 99]),                        # a stranger on the shared prompt
        _row(1, 1100, 60, [0, 10, 11]),                  # A1
        _row(2, 1200, 30, [0, 20, 21]),                  # B1
        _row(3, 1700, 40, [0, 10, 12, 13]),              # A2: A1's full blocks (0, 10) + new
        _row(4, 1600, 30, [0, 20, 22, 23]),              # B2
        _row(5, 2600, 40, [0, 10, 12, 14, 15, 16]),      # A3: A2's full blocks (0, 10, 12) + new
    ]
    requests = trace.read(_write(tmp_path, rows))
    stats = trace.link_sessions(requests)
    assert _parents(requests) == [None, None, None, 1, 2, 3]
    assert [r.session for r in requests] == [0, 1, 2, 1, 2, 1]
    # A1 and B1 were offered the stranger (its one full block, 0): a branch point
    assert stats.linked == 3 and stats.roots == 3 and stats.refused["branch point"] == 2


def test_an_explicit_session_key_decides_instead_of_the_heuristic(tmp_path):
    """With --session-key conv, the id decides: two requests on the shared block 0 that the heuristic
    keeps apart (a shared prefix) are one conversation when the trace says so, and a request the
    heuristic links (it carries all of y's full blocks and outgrows y's prompt + output) is a new
    session when its id is new. A line without the field is an error
    naming the line and the field."""
    rows = [dict(_row(0, 700, 5, [0, 1]), conv="x"), dict(_row(1, 1024, 5, [0, 2]), conv="y"),
            dict(_row(2, 900, 5, [0, 3]), conv="x"), dict(_row(3, 1100, 5, [0, 2, 7]), conv=7)]
    path = _write(tmp_path, rows)
    heuristic = trace.read(path)
    trace.link_sessions(heuristic)
    assert _parents(heuristic) == [None, None, None, 1]
    keyed = trace.read(path, session_key="conv")
    stats = trace.link_sessions(keyed, session_key="conv")
    assert _parents(keyed) == [None, None, 0, None] and [r.session for r in keyed] == [0, 1, 0, 3]
    assert stats.linked == 1 and stats.roots == 3 and "session key 'conv'" in stats.describe()
    bad = _write(tmp_path, [dict(_row(0, 700, 5, [0, 1]), conv="x"), _row(1, 800, 5, [0, 2])], name="bad.jsonl")
    with pytest.raises(trace.TraceError, match=r":2: conv=None: expected a session id"):
        trace.read(bad, session_key="conv")


@pytest.mark.parametrize(("sessions", "share", "said"), [
    (1, 0.5, "--share=0.5: the trace has 1 session"),
    (3, 1 / 16, "--share=0.0625 (seed 0) keeps none of the trace's 3 sessions"),
])
def test_a_share_that_keeps_no_session_is_an_error_naming_the_share_and_the_session_count(tmp_path, sessions, share,
                                                                                          said):
    rows = [_row(i, 512, 4, [1000 + i]) for i in range(sessions)]
    requests = trace.read(_write(tmp_path, rows))
    trace.link_sessions(requests)
    with pytest.raises(trace.ShareError, match=said.replace("(", r"\(").replace(")", r"\)")):
        trace.sample_sessions(requests, share, 0)


CONTEXT = 4096  # the model's context length these lines are read against


@pytest.mark.parametrize(("line", "field", "said"), [
    (_row(0, 4096, 4, list(range(8))), "input_length", "input_length=4096: expected an integer 1..4,095 (a prompt "
                                                       "shorter than the model's context length 4,096"),
    (_row(0, 1024, 3073, [1, 2]), "output_length", "output_length=3073: expected an integer 1..3,072 (input_length "
                                                   "1,024 + output_length within the model's context length 4,096)"),
    (_row(0, 1024, 10**15, [1, 2]), "output_length", "output_length=1000000000000000: expected an integer 1..3,072"),
    (_row(0, 1024, 4, list(range(9))), "hash_ids", "expected at most 8 block ids of 512 tokens (a prompt shorter "
                                                   "than the model's context length 4,096), got 9"),
    (_row(10**400, 1024, 4, [1, 2]), "timestamp", "expected an integer 0..9,007,199,254,740,992 (milliseconds; 2**53"),
    (_row(2**53 + 1, 1024, 4, [1, 2]), "timestamp", "timestamp=9007199254740993: expected an integer 0..9,007,199,"),
])
def test_a_length_or_timestamp_past_its_limit_is_a_one_line_error_naming_line_field_value_and_limit(
        tmp_path, line, field, said):
    """Each bounded field: the model's context length bounds the prompt (shorter than it, as SGLang's
    tokenizer manager admits it), prompt + output and the block count; the clock's float bounds the
    timestamp (a 400-digit one used to overflow it)."""
    path = _write(tmp_path, [_row(0, 512, 4, [0]), line])
    with pytest.raises(trace.TraceError) as err:
        trace.read(path, context_len=CONTEXT)
    message = str(err.value)
    assert err.value.line == 2 and err.value.field == field and "\n" not in message
    assert message.startswith(f"{path}:2: {field}=") and said in message
    assert len(message) < 400  # a 400-digit value is shown cut, not whole


def test_lengths_at_their_limits_are_read(tmp_path):
    path = _write(tmp_path, [_row(0, 4095, 1, list(range(8))), _row(2**53, 1024, 3072, [1, 2])])
    a, b = trace.read(path, context_len=CONTEXT)
    assert (a.input_length, b.output_length, b.arrival_ms) == (4095, 3072, 2**53)


def test_a_keyed_child_whose_blocks_disagree_with_its_parent_is_built_from_its_own_blocks(tmp_path):
    """Two 2,048-token requests with one session id and disjoint hash_ids (an agent that summarized
    its context): linked by the key, counted as disagreeing, and the child's prompt shares no token
    with the parent's history. A third turn keeps the second's first two blocks only: it inherits
    those 1,024 tokens, then its own blocks."""
    rows = [dict(_row(0, 2048, 8, [1, 2, 3, 4]), conv="s"), dict(_row(1, 2048, 8, [5, 6, 7, 8]), conv="s"),
            dict(_row(2, 2560, 8, [5, 6, 9, 10, 11]), conv="s")]
    requests = trace.read(_write(tmp_path, rows), session_key="conv")
    stats = trace.link_sessions(requests, session_key="conv")
    a, b, c = requests
    assert _parents(requests) == [None, 0, 1] and stats.disagreeing == 2
    assert "2 keyed pairs disagree" in stats.describe() and stats.as_dict()["disagreeing"] == 2
    trace.TokenBuilder(16).build(requests, {r.index: r for r in requests})
    ta, tb, tc = (list(trace.materialize(r.prompt)) for r in (a, b, c))
    assert b.inherited == 0 and not set(tb) & set(ta) and OUTPUT_TOKEN not in tb
    assert c.inherited == 1024 and tc[:1024] == tb[:1024] and not set(tc[1024:]) & set(ta + tb)


def test_a_keyed_child_that_carries_its_parents_blocks_continues_its_whole_history(tmp_path):
    rows = [dict(_row(0, 1100, 40, [1, 2, 3]), conv=7), dict(_row(1, 2048, 8, [1, 2, 4, 5]), conv=7)]
    requests = trace.read(_write(tmp_path, rows), session_key="conv")
    stats = trace.link_sessions(requests, session_key="conv")
    a, b = requests
    trace.TokenBuilder(16).build(requests, {r.index: r for r in requests})
    assert stats.disagreeing == 0 and b.inherited == a.history_len
    assert list(trace.materialize(b.prompt))[:a.history_len] == list(trace.materialize(a.prompt)) + [OUTPUT_TOKEN] * a.out_tokens
