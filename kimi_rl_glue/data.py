"""``kimi-rl prepare-data``: convert a local math dataset (JSONL or parquet) to miles' prompt format.

miles reads JSONL rows with ``--input-key prompt --label-key label --apply-chat-template``
(``radixark/miles:miles/utils/data.py``: ``prompt`` is a string or a list of chat messages,
``label`` is what the reward compares against, ``metadata`` is optional). The K3 recipe trains on
dapo-math-17k and evaluates on AIME-2024 (``--eval-prompt-data aime <file> --eval-input-key prompt``).
Nothing is downloaded: point ``--input`` at a file you already have.

Accepted input rows (first match wins):

| schema | prompt from | label from |
| --- | --- | --- |
| miles-ready | ``prompt`` (str or messages) | ``label`` |
| DAPO original (verl) | ``prompt`` (messages) | ``reward_model.ground_truth`` |
| problem/answer | ``problem`` / ``question`` / ``Problem`` | ``answer`` / ``Answer`` / ``label`` |

Output rows: ``{"prompt": [{"role": "user", "content": ...}], "label": "<answer>", "metadata":
{"task": ..., "source_row": i}}``. A bare problem is wrapped in :data:`BOXED_TEMPLATE` (the reward,
``kimi_rl_glue.miles.reward``, grades the last ``\\boxed{}``).

``--format skyrl --task token-set`` (:func:`prepare_token_set`) writes SkyRL's parquet for the demo's
token-set task instead, generated rather than read: a random tiny model earns a reward there (it never does
on math). SkyRL's ``PromptDataset`` (``NovaSky-AI/SkyRL:skyrl/train/dataset/dataset.py``) reads the
``prompt`` column as chat messages, ``env_class`` as the skyrl_gym environment, and hands every other column
to the environment as ``extras``; ``kimi_token_set`` (:mod:`kimi_rl_glue.skyrl.token_set_env`) reads its
target words from ``reward_model.ground_truth``. Rows::

    {"prompt": [{"role": "user", "content": "w812 w95 ..."}], "env_class": "kimi_token_set",
     "reward_model": {"ground_truth": "w17 w40 ..."}, "data_source": "kimi_token_set"}

The words are the tiny checkpoints' tokenizer's (:mod:`kimi_core.checkpoint.tokenizer`: id ``i`` is
``w<i>``); the target set and prompts are :class:`kimi_rl_glue.demo.task.TokenSetTask`'s for the seed, over the
word ids (special-token ids excluded), so the same seed gives the same file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = [
    "TASKS",
    "SKYRL_TASKS",
    "BOXED_TEMPLATE",
    "PrepareReport",
    "read_rows",
    "convert_row",
    "prepare_data",
    "checkpoint_vocab_size",
    "token_set_rows",
    "write_parquet",
    "prepare_token_set",
]

log = logging.getLogger(__name__)

TASKS = ("dapo-math", "aime")  # --format miles: converted from a local file
SKYRL_TASKS = ("token-set",)  # --format skyrl: generated
TOKEN_SET_ENV = "kimi_token_set"  # the skyrl_gym id of kimi_rl_glue.skyrl.token_set_env (its ENV_ID)
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
BOXED_TEMPLATE = "{problem}\n\n" + BOXED_INSTRUCTION.replace("{}", "{{}}")  # str.format template


@dataclass
class PrepareReport:
    """What ``prepare_data`` wrote: ``rows`` written, ``skipped`` row numbers with reasons."""

    output: str
    rows: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)


def read_rows(path: str) -> Iterator[dict]:
    """Yield dict rows of a ``.jsonl`` / ``.json`` (list) / ``.parquet`` file.

    :raises ValueError: unsupported suffix or a malformed JSON line (file and line named).
    :raises ImportError: parquet without pyarrow (says what to install).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--input {path}: no such file")
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"--input {path} line {n}: not valid JSON ({e})") from e
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, list):
            raise ValueError(f"--input {path}: a .json input must hold a list of rows")
        yield from data
    elif path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(
                f"--input {path}: reading parquet needs pyarrow (pip install pyarrow), "
                "or convert the file to JSONL first"
            ) from e
        for batch in pq.ParquetFile(path).iter_batches():
            yield from batch.to_pylist()
    else:
        raise ValueError(f"--input {path}: unsupported file type; expected .jsonl, .json or .parquet")


def _messages(prompt, add_instruction: bool) -> list[dict]:
    if isinstance(prompt, str):
        msgs = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        msgs = [{"role": m.get("role", "user"), "content": m["content"]} for m in prompt]
    else:
        raise ValueError("prompt is neither a string nor a list of {role, content} messages")
    if add_instruction and "\\boxed" not in msgs[-1]["content"]:
        msgs[-1] = {**msgs[-1], "content": msgs[-1]["content"].rstrip() + "\n\n" + BOXED_INSTRUCTION}
    return msgs


def convert_row(row: dict, task: str, index: int, add_boxed_instruction: bool = False) -> dict:
    """One input row -> one miles row; ValueError says which field is missing."""
    if task not in TASKS:
        raise ValueError(f"--task {task!r}; expected one of {TASKS}")
    label = None
    if "label" in row and row["label"] not in (None, ""):
        label = row["label"]
    elif isinstance(row.get("reward_model"), dict) and row["reward_model"].get("ground_truth") not in (None, ""):
        label = row["reward_model"]["ground_truth"]
    else:
        for k in ("answer", "Answer", "final_answer"):
            if row.get(k) not in (None, ""):
                label = row[k]
                break
    if label is None:
        raise ValueError("no label: expected 'label', 'reward_model.ground_truth' or 'answer'")
    if isinstance(label, list) and len(label) == 1:
        label = label[0]
    if row.get("prompt") not in (None, "", []):
        prompt = _messages(row["prompt"], add_boxed_instruction)
    else:
        problem = next((row[k] for k in ("problem", "question", "Problem", "Question") if row.get(k)), None)
        if problem is None:
            raise ValueError("no prompt: expected 'prompt' or 'problem'/'question'")
        prompt = [{"role": "user", "content": BOXED_TEMPLATE.format(problem=str(problem).strip())}]
    meta = {"task": task, "source_row": index}
    for k in ("data_source", "id", "ID", "year"):
        if k in row and isinstance(row[k], (str, int)):
            meta[k.lower()] = row[k]
    return {"prompt": prompt, "label": str(label).strip(), "metadata": meta}


def prepare_data(
    task: str, input_path: str, output_path: str, *, limit: int | None = None, add_boxed_instruction: bool = False
) -> PrepareReport:
    """Convert ``input_path`` to miles JSONL at ``output_path`` (atomic: temp file + ``os.replace``).

    Rows without a label or prompt are skipped and listed in the report; a file where every row is
    skipped is an error (nothing is written).
    """
    if task not in TASKS:
        raise ValueError(f"--task {task!r}; expected one of {TASKS}")
    if limit is not None and limit <= 0:
        raise ValueError(f"--limit {limit} must be > 0")
    rep = PrepareReport(output=output_path)
    out_rows = []
    for i, row in enumerate(read_rows(input_path)):
        if limit is not None and len(out_rows) >= limit:
            break
        try:
            out_rows.append(convert_row(row, task, i, add_boxed_instruction))
        except ValueError as e:
            rep.skipped.append((i, str(e)))
    if not out_rows:
        first = f"; first problem: row {rep.skipped[0][0]}: {rep.skipped[0][1]}" if rep.skipped else ""
        raise ValueError(f"--input {input_path}: no usable rows for --task {task}{first}")
    d = os.path.dirname(os.path.abspath(output_path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(output_path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in out_rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, output_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    rep.rows = len(out_rows)
    for i, why in rep.skipped[:5]:
        log.warning("skipped row %d of %s: %s", i, input_path, why)
    return rep


def checkpoint_vocab_size(checkpoint: str) -> int:
    """``vocab_size`` of a checkpoint folder's ``config.json`` (``text_config``'s for K2.5 / K3), checked against
    its ``tokenizer.json``.

    :raises FileNotFoundError: no folder, no ``config.json`` or no ``tokenizer.json`` (says how to get one).
    :raises ValueError: no ``vocab_size``, or a tokenizer whose vocabulary has another size.
    """
    cfg_path = os.path.join(checkpoint, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"--checkpoint {checkpoint}: no config.json (not a checkpoint folder)")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    vocab = text.get("vocab_size") if isinstance(text, dict) else None
    if not isinstance(vocab, int) or vocab <= 0:
        raise ValueError(f"--checkpoint {cfg_path}: no positive integer vocab_size")
    tok_path = os.path.join(checkpoint, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise FileNotFoundError(
            f"--checkpoint {checkpoint}: no tokenizer.json; SkyRL loads the tokenizer from the model folder "
            "(re-run kimi-rl make-tiny, which writes one)"
        )
    with open(tok_path, encoding="utf-8") as f:
        words = len(json.load(f).get("model", {}).get("vocab", {}))
    if words != vocab:
        raise ValueError(
            f"--checkpoint {tok_path}: {words} words in the tokenizer, config.json's vocab_size is {vocab}"
        )
    return vocab


def token_set_rows(
    vocab_size: int, prompts: int, *, seed: int = 0, n_targets: int = 64, prompt_len: int = 8
) -> list[dict]:
    """``prompts`` SkyRL rows of the token-set task over a ``vocab_size`` word tokenizer (see the module docstring).

    The target set is ``TokenSetTask(vocab_size, seed, n_targets, prompt_len, first_id=FIRST_WORD_ID)``'s; the
    prompts are its ``prompts(prompts, torch.Generator().manual_seed(seed))``, words outside the target set.
    """
    import torch

    from kimi_core.checkpoint.tokenizer import FIRST_WORD_ID, word
    from kimi_rl_glue.demo.task import TokenSetTask

    task = TokenSetTask(vocab_size, seed=seed, n_targets=n_targets, prompt_len=prompt_len, first_id=FIRST_WORD_ID)
    truth = " ".join(word(i) for i in sorted(task.targets))
    return [
        {
            "prompt": [{"role": "user", "content": " ".join(word(i) for i in ids)}],
            "env_class": TOKEN_SET_ENV,
            "reward_model": {"ground_truth": truth},
            "data_source": TOKEN_SET_ENV,
        }
        for ids in task.prompts(prompts, torch.Generator().manual_seed(seed))
    ]


def write_parquet(rows: list[dict], output_path: str) -> None:
    """Write ``rows`` (dicts of one layout) as a parquet file, atomically (temporary name, then ``os.replace``).

    :raises ImportError: no pyarrow (says what to install).
    """
    from kimi_core.checkpoint.writer import make_group_readable

    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"--output {output_path}: writing parquet needs pyarrow (pip install pyarrow)") from e
    d = os.path.dirname(os.path.abspath(output_path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(output_path)}.tmp{os.getpid()}")
    try:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        make_group_readable(tmp)  # the mode open() gives, so a host running as another user reads it
        os.replace(tmp, output_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def prepare_token_set(
    checkpoint: str, output_path: str, *, prompts: int, seed: int = 0, n_targets: int = 64, prompt_len: int = 8
) -> PrepareReport:
    """Write ``prompts`` token-set rows for the tokenizer of ``checkpoint`` as SkyRL parquet at ``output_path``.

    :raises FileNotFoundError, ValueError: see :func:`checkpoint_vocab_size`; ``n_targets`` leaves no word for the
        prompts; ``output_path`` is not a ``.parquet`` file (SkyRL picks its reader by the suffix).
    """
    from kimi_core.checkpoint.tokenizer import FIRST_WORD_ID

    if not output_path.endswith(".parquet"):
        raise ValueError(f"--output {output_path}: SkyRL reads by suffix; name a .parquet file")
    if prompts < 1 or prompt_len < 1 or n_targets < 1:
        raise ValueError(f"--prompts {prompts}, --prompt-len {prompt_len}, --targets {n_targets}: each must be >= 1")
    vocab = checkpoint_vocab_size(checkpoint)
    words = vocab - FIRST_WORD_ID
    if n_targets >= words:
        raise ValueError(
            f"--targets {n_targets}: the tokenizer of {checkpoint} has {words} words; "
            "leave at least one outside the target set for the prompts"
        )
    rows = token_set_rows(vocab, prompts, seed=seed, n_targets=n_targets, prompt_len=prompt_len)
    write_parquet(rows, output_path)
    return PrepareReport(output=output_path, rows=len(rows))
