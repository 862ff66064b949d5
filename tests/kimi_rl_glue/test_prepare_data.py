"""``kimi-rl prepare-data`` (kimi_rl_glue/data.py, cli.py) on the shipped sample files."""

from __future__ import annotations

import json
import os

import pytest

from kimi_rl_glue.cli import main as cli_main
from kimi_rl_glue.data import BOXED_INSTRUCTION, prepare_data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DAPO = os.path.join(ROOT, "examples", "data", "dapo-math-sample.jsonl")
AIME = os.path.join(ROOT, "examples", "data", "aime-sample.jsonl")


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_cli_converts_both_tasks_to_miles_keys(tmp_path, capsys):
    """Both sample files become JSONL with prompt (chat messages) and label (string) keys, labels preserved."""
    out = tmp_path / "dapo.jsonl"
    assert cli_main(["prepare-data", "--task", "dapo-math", "--input", DAPO, "--output", str(out)]) == 0
    src, rows = _rows(DAPO), _rows(out)
    assert len(rows) == len(src)
    assert [r["label"] for r in rows] == [s["reward_model"]["ground_truth"] for s in src]
    assert rows[0]["prompt"] == src[0]["prompt"] and rows[0]["metadata"]["task"] == "dapo-math"
    out2 = tmp_path / "aime.jsonl"
    assert cli_main(["prepare-data", "--task", "aime", "--input", AIME, "--output", str(out2), "--limit", "2"]) == 0
    rows2 = _rows(out2)
    assert [r["label"] for r in rows2] == [str(s["answer"]) for s in _rows(AIME)[:2]]
    assert rows2[0]["prompt"][0]["role"] == "user" and rows2[0]["prompt"][0]["content"].endswith(BOXED_INSTRUCTION)
    assert "wrote 2 aime rows" in capsys.readouterr().out


def test_boxed_instruction_and_skips(tmp_path):
    """--add-boxed-instruction appends the instruction once; rows without a label are skipped and reported."""
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"prompt": "What is 1+1?", "label": "2"})
        + "\n"
        + json.dumps({"problem": "x"})
        + "\n"
        + json.dumps({"prompt": r"Put it in \boxed{}: 2+2?", "answer": 4})
        + "\n"
    )
    rep = prepare_data("dapo-math", str(src), str(tmp_path / "o.jsonl"), add_boxed_instruction=True)
    rows = _rows(tmp_path / "o.jsonl")
    assert rep.rows == 2 and [i for i, _ in rep.skipped] == [1]
    assert rows[0]["prompt"][0]["content"].endswith(BOXED_INSTRUCTION)
    assert rows[1]["prompt"][0]["content"] == r"Put it in \boxed{}: 2+2?" and rows[1]["label"] == "4"


def test_errors_name_the_file(tmp_path):
    """A missing file, a bad line, an unknown suffix or a file without usable rows fails naming --input and leaves no output."""
    with pytest.raises(FileNotFoundError, match="--input"):
        prepare_data("aime", str(tmp_path / "none.jsonl"), str(tmp_path / "o.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "label": "1"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2"):
        prepare_data("aime", str(bad), str(tmp_path / "o.jsonl"))
    empty = tmp_path / "e.jsonl"
    empty.write_text(json.dumps({"prompt": "no label"}) + "\n")
    with pytest.raises(ValueError, match="no usable rows"):
        prepare_data("aime", str(empty), str(tmp_path / "o.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported"):
        prepare_data("aime", str(tmp_path / "x.csv"), str(tmp_path / "o.jsonl"))
    assert not (tmp_path / "o.jsonl").exists()


def test_parquet_input(tmp_path):
    """A parquet file in the DAPO schema converts like its JSONL twin (pyarrow: the root test extra)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows(DAPO)
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "d.parquet"))
    rep = prepare_data("dapo-math", str(tmp_path / "d.parquet"), str(tmp_path / "o.jsonl"))
    assert rep.rows == len(rows)
