"""load_rows: both formats, dotted keys, chat prompts, and a one-line BadInputError per bad input."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polyrl.core.data import load_rows
from polyrl.core.errors import BadInputError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_jsonl_rows_are_normalised(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1?", "answer": "2", "source": "x"},
                                             {"prompt": "2+2?", "answer": 4}])
    rows = load_rows(path)
    assert [r["prompt"] for r in rows] == ["1+1?", "2+2?"]
    assert [r["answer"] for r in rows] == ["2", "4"]  # numbers become text
    assert [r["row"] for r in rows] == [1, 2]
    assert rows[0]["fields"]["source"] == "x"
    assert rows[0]["messages"] is None


def test_parquet_dapo_layout_with_dotted_answer_key_and_chat_prompt(tmp_path):
    table = pa.Table.from_pylist([
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 6*7?"}],
         "reward_model": {"ground_truth": "42", "style": "rule"}},
    ])
    pq.write_table(table, tmp_path / "d.parquet")
    rows = load_rows(tmp_path / "d.parquet", answer_key="reward_model.ground_truth")
    assert rows[0]["prompt"] == "What is 6*7?"
    assert rows[0]["answer"] == "42"
    assert rows[0]["messages"][0] == {"role": "system", "content": "be brief"}


def test_blank_lines_are_skipped_and_rows_keep_line_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"}\n')
    with pytest.raises(BadInputError) as err:
        load_rows(path)
    msg = str(err.value)
    assert "\n" not in msg
    assert str(path) in msg and "line 3" in msg and "'answer'" in msg


@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"prompt": "a", "answer": "1"}\n{not json}\n', "line 2: not valid JSON"),
        ('[1, 2]\n', "line 1: expected a JSON object"),
        ('{"answer": "1"}\n', "line 1: missing field 'prompt'"),
        ('{"prompt": "a", "answer": null}\n', "line 1: missing field 'answer'"),
        ('{"prompt": "", "answer": "1"}\n', "line 1: field 'prompt' is empty"),
        ('{"prompt": 3, "answer": "1"}\n', "line 1: field 'prompt' must be a string"),
        ('{"prompt": "a", "answer": [1]}\n', "line 1: field 'answer' must be a string or a number"),
        ('{"prompt": [{"role": "system", "content": "x"}], "answer": "1"}\n', "has no user message"),
        ("\n\n", "no rows"),
    ],
)
def test_bad_jsonl_is_one_line_bad_input(tmp_path, content, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(BadInputError) as err:
        load_rows(path)
    msg = str(err.value)
    assert expected in msg and str(path) in msg and "\n" not in msg


def test_missing_wrong_suffix_and_corrupt_files(tmp_path):
    with pytest.raises(BadInputError, match="not found"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(BadInputError, match=r"unsupported suffix '\.csv'"):
        load_rows(tmp_path / "d.csv")
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(BadInputError, match="not a readable parquet file"):
        load_rows(tmp_path / "bad.parquet")
    (tmp_path / "latin.jsonl").write_bytes('{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(BadInputError, match="not UTF-8"):
        load_rows(tmp_path / "latin.jsonl")
    with pytest.raises(BadInputError, match="not a file"):
        load_rows(tmp_path)


def test_parquet_row_without_field_names_row(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"question": "a", "answer": "1"}] * 2), tmp_path / "d.parquet")
    with pytest.raises(BadInputError, match=r"row 1: missing field 'prompt'"):
        load_rows(tmp_path / "d.parquet")
    rows = load_rows(tmp_path / "d.parquet", prompt_key="question")
    assert [r["row"] for r in rows] == [1, 2]
