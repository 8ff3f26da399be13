"""``devkit.simulate.trace``: a Mooncake trace parsed, split into sessions and given token ids,
on small traces written here (answers known by construction; never the shared trace)."""

from __future__ import annotations

import json

import pytest

from devkit.simulate import trace
from devkit.testkit.radix_cache import OUTPUT_TOKEN


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
