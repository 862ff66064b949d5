"""``kimi-rl prepare-data --format skyrl --task token-set``: SkyRL parquet of the token-set task, read back the way
SkyRL reads it (pyarrow, HF ``datasets`` + the checkpoint's chat template, as
``NovaSky-AI/SkyRL:skyrl/train/dataset/dataset.py`` does)."""

from __future__ import annotations

import json
import os

import pytest

from kimi_core.checkpoint.tokenizer import ASSISTANT_ID, FIRST_WORD_ID, USER_ID
from kimi_rl_glue.cli import main
from kimi_rl_glue.demo.task import TokenSetTask

pq = pytest.importorskip("pyarrow.parquet")
VOCAB = 1024  # make-tiny --size tiny


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("k25")  # transformers' AutoTokenizer loads K2.5 configs without a registered config class


def _write(ckpt, out, *extra) -> int:
    return main(["prepare-data", "--task", "token-set", "--checkpoint", ckpt, "--output", str(out), *extra])


def _ids(text: str) -> list[int]:
    """Word ids of ``w<i>`` text, parsed here independently of the package."""
    assert all(w[0] == "w" and w[1:].isdigit() for w in text.split()), text
    return [int(w[1:]) for w in text.split()]


def test_rows_read_back_with_pyarrow(ckpt, tmp_path, capsys):
    """12 rows with SkyRL's columns: one user message of 8 words outside the target set, env_class kimi_token_set,
    reward_model.ground_truth = the demo task's 64 targets for the seed, data_source."""
    out = tmp_path / "train.parquet"
    assert _write(ckpt, out, "--prompts", "12", "--seed", "5") == 0
    assert "wrote 12 token-set rows" in capsys.readouterr().out
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 12
    want = sorted(TokenSetTask(VOCAB, seed=5, n_targets=64, first_id=FIRST_WORD_ID).targets)
    for r in rows:
        assert set(r) == {"prompt", "env_class", "reward_model", "data_source"}
        assert r["env_class"] == r["data_source"] == "kimi_token_set"
        assert _ids(r["reward_model"]["ground_truth"]) == want
        (msg,) = r["prompt"]
        assert msg["role"] == "user"
        words = _ids(msg["content"])
        assert len(words) == 8
        assert all(FIRST_WORD_ID <= i < VOCAB and i not in want for i in words)
    assert len({r["prompt"][0]["content"] for r in rows}) == 12


def test_same_seed_same_file_other_seed_other_targets(ckpt, tmp_path):
    """The file is a function of the flags: equal bytes for one seed; another seed draws another target set."""
    a, b, c = (tmp_path / f"{n}.parquet" for n in "abc")
    assert _write(ckpt, a, "--prompts", "4") == 0
    assert _write(ckpt, b, "--prompts", "4", "--seed", "0") == 0
    assert _write(ckpt, c, "--prompts", "4", "--seed", "1") == 0
    assert a.read_bytes() == b.read_bytes()
    truth = [pq.read_table(p).to_pylist()[0]["reward_model"]["ground_truth"] for p in (a, c)]
    assert truth[0] != truth[1]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no temporary left


def test_skyrl_reader_and_chat_template(ckpt, tmp_path):
    """HF datasets (SkyRL's parquet reader) yields the prompt messages and the extras the env reads; the checkpoint's
    chat template turns a prompt into ``<|user|> ids <|assistant|>`` with every id a word below vocab_size."""
    datasets = pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "train.parquet"
    assert _write(ckpt, out, "--prompts", "6", "--targets", "16", "--prompt-len", "5") == 0
    ds = datasets.load_dataset("parquet", data_files=str(out), keep_in_memory=True)["train"]
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert len(ds) == 6
    for row in ds:
        messages = row.pop("prompt")
        assert row.pop("env_class") == "kimi_token_set"
        assert set(row) == {"reward_model", "data_source"}  # what SkyRL passes to the env as extras
        assert len(_ids(row["reward_model"]["ground_truth"])) == 16
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ids == [USER_ID, *_ids(messages[0]["content"]), ASSISTANT_ID]


def _bad_checkpoint(tmp_path, ckpt):
    """A copy of the checkpoint's config.json without a tokenizer (an older make-tiny)."""
    d = tmp_path / "old"
    d.mkdir()
    with open(os.path.join(ckpt, "config.json")) as f:
        (d / "config.json").write_text(f.read())
    return str(d)


# (id, argv after `prepare-data`, exit code, text in the one error line); {ck} is the checkpoint, {t} tmp_path
CASES = [
    ("token-set-no-checkpoint", ["--task", "token-set", "--output", "{t}/a.parquet"], 2, "--checkpoint"),
    (
        "token-set-not-parquet",
        ["--task", "token-set", "--checkpoint", "{ck}", "--output", "{t}/a.jsonl"],
        2,
        "name a .parquet file",
    ),
    (
        "token-set-with-input",
        ["--task", "token-set", "--checkpoint", "{ck}", "--input", "x.jsonl", "--output", "{t}/a.parquet"],
        2,
        "--input: not a flag of --format skyrl",
    ),
    (
        "token-set-format-miles",
        ["--task", "token-set", "--format", "miles", "--checkpoint", "{ck}", "--output", "{t}/a.jsonl"],
        2,
        "--format miles with --task token-set",
    ),
    (
        "aime-format-skyrl",
        ["--task", "aime", "--format", "skyrl", "--input", "x.jsonl", "--output", "{t}/a.parquet"],
        2,
        "--format skyrl with --task aime",
    ),
    ("aime-no-input", ["--task", "aime", "--output", "{t}/a.jsonl"], 2, "--input: --task aime converts a local file"),
    (
        "aime-with-seed",
        ["--task", "aime", "--input", "x.jsonl", "--seed", "1", "--output", "{t}/a.jsonl"],
        2,
        "--seed: not a flag of --format miles",
    ),
    (
        "token-set-prompts-0",
        ["--task", "token-set", "--checkpoint", "{ck}", "--prompts", "0", "--output", "{t}/a.parquet"],
        2,
        "argument --prompts: must be >= 1, got 0",
    ),
    (
        "token-set-targets-fill-vocab",
        ["--task", "token-set", "--checkpoint", "{ck}", "--targets", "1017", "--output", "{t}/a.parquet"],
        2,
        "--targets 1017: the tokenizer of",
    ),
    (
        "token-set-no-config",
        ["--task", "token-set", "--checkpoint", "{t}/none", "--output", "{t}/a.parquet"],
        1,
        "no config.json",
    ),
    (
        "token-set-no-tokenizer",
        ["--task", "token-set", "--checkpoint", "{old}", "--output", "{t}/a.parquet"],
        1,
        "no tokenizer.json",
    ),
]


@pytest.mark.parametrize("argv, code, text", [pytest.param(a, c, x, id=i) for i, a, c, x in CASES])
def test_bad_input_is_one_line_naming_it(argv, code, text, ckpt, tmp_path, capsys):
    """Each refusal exits with docs/cli.md's code and one stderr line naming the flag or file; nothing is written."""
    fill = {"ck": ckpt, "t": str(tmp_path), "old": _bad_checkpoint(tmp_path, ckpt)}
    try:
        rc = main(["prepare-data", *(a.format(**fill) for a in argv)])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == code, err
    assert len(err.splitlines()) == 1 and text in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["old"]


def test_tokenizer_of_another_size_is_refused(ckpt, tmp_path, capsys):
    """A tokenizer.json whose vocabulary disagrees with config.json's vocab_size is a bad input (exit 1)."""
    d = tmp_path / "ck"
    d.mkdir()
    for name in ("config.json", "tokenizer.json"):
        with open(os.path.join(ckpt, name)) as f:
            (d / name).write_text(f.read())
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["vocab_size"] = 2048
    (d / "config.json").write_text(json.dumps(cfg))
    assert _write(str(d), tmp_path / "a.parquet") == 1
    assert "1024 words in the tokenizer, config.json's vocab_size is 2048" in capsys.readouterr().err


def test_skyrl_prompt_dataset_reads_the_rows(ckpt, tmp_path):
    """SkyRL's own PromptDataset (where skyrl is installed: the py312 venv) keeps every row under a small
    max_prompt_length and yields the chat messages, env_class and the extras kimi_token_set reads."""
    pytest.importorskip("datasets")
    dataset = pytest.importorskip("skyrl.train.dataset.dataset")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "train.parquet"
    assert _write(ckpt, out, "--prompts", "5", "--prompt-len", "8") == 0
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    ds = dataset.PromptDataset([str(out)], tok, max_prompt_length=10, num_workers=1)  # 8 words + 2 role tokens
    assert len(ds) == 5
    batch = ds.collate_fn([ds[i] for i in range(len(ds))])
    rows = pq.read_table(out).to_pylist()
    for got, row in zip(batch, rows):
        assert got["prompt"] == row["prompt"]
        assert got["env_class"] == "kimi_token_set"
        assert got["env_extras"] == {"reward_model": row["reward_model"], "data_source": "kimi_token_set"}
