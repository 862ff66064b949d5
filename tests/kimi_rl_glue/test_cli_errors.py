"""Bad input across ``kimi-rl``: one row per case of ``docs/cli.md``, each a one-line error naming the flag, file or
tensor, with the exit code the table gives, raised before any long work starts."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil

import pytest
import torch

from kimi_rl_glue.cli import build_parser, main

K2 = "model.layers.1.mlp.experts.0.gate_proj"  # a packed INT4 expert of the tiny K2 checkpoint


def _shard_of(ckpt: str, tensor: str) -> str:
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"][tensor]


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _truncated(tmp, ck):
    a = _copy(ck("k2"), tmp / "A")
    shard = os.path.join(a, _shard_of(a, f"{K2}.weight_packed"))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    return ["dequantize", "--input", a, "--output", str(tmp / "B")], os.path.basename(shard)


def _wrong_packed_shape(tmp, ck):
    from safetensors.torch import load_file, save_file

    a = _copy(ck("k2"), tmp / "A")
    shard = os.path.join(a, _shard_of(a, f"{K2}.weight_packed"))
    t = load_file(shard)
    t[f"{K2}.weight_packed"] = t[f"{K2}.weight_packed"][:, :-1].contiguous()  # one packed column short
    save_file(t, shard, metadata={"format": "pt"})
    return ["dequantize", "--input", a, "--output", str(tmp / "B")], f"{os.path.basename(shard)}: {K2}"


def _used_dequantize_output(tmp, ck):
    b = tmp / "B"
    b.mkdir()
    (b / "notes.txt").write_text("someone else's")
    return ["dequantize", "--input", ck("k2"), "--output", str(b)], "without kimi-dequantize.json"


def _file(tmp, name="afile"):
    p = tmp / name
    p.write_text("x")
    return str(p)


def _used_demo_folder(tmp, ck):
    d = tmp / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("{}\n")
    return ["demo", "--out", str(d), "--steps", "1"], "holds an earlier run"


# (id, argv or setup(tmp_path, tiny_ckpt) -> (argv, text), exit code, text in the one error line)
CASES = [
    (
        "dequantize-output-is-input",
        lambda t, ck: (["dequantize", "--input", ck("k2"), "--output", ck("k2")], "is the same folder as --input"),
        2,
        None,
    ),
    (
        "dequantize-output-inside-input",
        lambda t, ck: (
            ["dequantize", "--input", ck("k2"), "--output", os.path.join(ck("k2"), "bf16")],
            "lies inside --input",
        ),
        2,
        None,
    ),
    (
        "dequantize-input-inside-output",
        lambda t, ck: (
            ["dequantize", "--input", _copy(ck("k2"), t / "O" / "A"), "--output", str(t / "O")],
            "lies inside --output",
        ),
        2,
        None,
    ),
    ("dequantize-used-output", _used_dequantize_output, 2, None),
    ("dequantize-truncated-shard", _truncated, 1, "truncated"),
    ("dequantize-wrong-packed-shape", _wrong_packed_shape, 1, "disagree"),
    (
        "dequantize-scale-divisor-0",
        lambda t, ck: (
            ["dequantize", "--input", ck("k2"), "--output", str(t / "B"), "--scale-divisor", "0"],
            "--scale-divisor: must be > 0",
        ),
        2,
        None,
    ),
    (
        "dequantize-workers-0",
        lambda t, ck: (
            ["dequantize", "--input", ck("k2"), "--output", str(t / "B"), "--workers", "0"],
            "--workers: must be >= 1",
        ),
        2,
        None,
    ),
    (
        "dequantize-workers-negative",
        lambda t, ck: (
            ["dequantize", "--input", ck("k2"), "--output", str(t / "B"), "--workers", "-1"],
            "--workers: must be >= 1",
        ),
        2,
        None,
    ),
    (
        "dequantize-q-min-positive",
        lambda t, ck: (
            ["dequantize", "--input", ck("k2"), "--output", str(t / "B"), "--q-min", "3"],
            "--q-min: must be in [-8, -1]",
        ),
        2,
        None,
    ),
    (
        "dequantize-missing-input",
        lambda t, ck: (["dequantize", "--input", str(t / "nope"), "--output", str(t / "B")], "does not exist"),
        1,
        None,
    ),
    ("demo-steps-0", lambda t, ck: (["demo", "--steps", "0", "--out", str(t / "r")], "--steps: must be >= 1"), 2, None),
    (
        "demo-steps-negative",
        lambda t, ck: (["demo", "--steps", "-2", "--out", str(t / "r")], "--steps: must be >= 1"),
        2,
        None,
    ),
    (
        "demo-prompts-0",
        lambda t, ck: (["demo", "--prompts", "0", "--out", str(t / "r")], "--prompts: must be >= 1"),
        2,
        None,
    ),
    (
        "demo-group-0",
        lambda t, ck: (["demo", "--group", "0", "--out", str(t / "r")], "--group: must be >= 1"),
        2,
        None,
    ),
    (
        "demo-max-tokens-0",
        lambda t, ck: (["demo", "--max-tokens", "0", "--out", str(t / "r")], "--max-tokens: must be >= 1"),
        2,
        None,
    ),
    (
        "demo-rank-0",
        lambda t, ck: (["demo", "--rank", "0", "--out", str(t / "r")], "--rank: must be >= 1"),
        2,
        None,
    ),
    ("demo-lr-0", lambda t, ck: (["demo", "--lr", "0", "--out", str(t / "r")], "--lr: must be > 0"), 2, None),
    (
        "demo-cuda-without-gpu",
        lambda t, ck: (["demo", "--device", "cuda", "--out", str(t / "r")], "--device cuda: torch sees no CUDA device"),
        2,
        "needs-no-cuda",
    ),
    ("demo-out-is-a-file", lambda t, ck: (["demo", "--out", _file(t), "--steps", "1"], "is a file"), 2, None),
    ("demo-used-folder", _used_demo_folder, 2, None),
    (
        "make-tiny-rtn-on-k3",
        lambda t, ck: (
            ["make-tiny", "--model", "k3", "--convention", "rtn", "--out", str(t / "k3")],
            "--convention rtn: only INT4 experts",
        ),
        2,
        None,
    ),
    (
        "make-tiny-out-is-a-file",
        lambda t, ck: (["make-tiny", "--model", "k2", "--out", _file(t)], "is a file"),
        2,
        None,
    ),
    (
        "make-tiny-layers-9",
        lambda t, ck: (
            ["make-tiny", "--model", "k2", "--layers", "9", "--out", str(t / "k")],
            "--layers: must be in [2, 6]",
        ),
        2,
        None,
    ),
    (
        "check-numerics-unknown-engine",
        lambda t, ck: (
            ["check-numerics", "--model", ck("k2"), "--engines", "reference,nonsense"],
            "unknown engine 'nonsense'",
        ),
        2,
        None,
    ),
    (
        "check-numerics-megatron-bf16",
        lambda t, ck: (
            ["check-numerics", "--model", ck("k2"), "--engines", "reference,megatron", "--dtype", "bf16"],
            "megatron engine scores in fp32 only",
        ),
        2,
        None,
    ),
    (
        "check-numerics-batch-0",
        lambda t, ck: (["check-numerics", "--model", ck("k2"), "--batch", "0"], "--batch: must be >= 1"),
        2,
        None,
    ),
    (
        "check-numerics-tokens-0",
        lambda t, ck: (["check-numerics", "--model", ck("k2"), "--tokens", "0"], "--tokens: must be >= 1"),
        2,
        None,
    ),
]


@pytest.mark.parametrize("setup, code, extra", [pytest.param(s, c, e, id=i) for i, s, c, e in CASES])
def test_bad_input_is_one_line_naming_it(setup, code, extra, tmp_path, tiny_ckpt, capsys, monkeypatch):
    """Each bad input exits with the table's code and one stderr line naming the flag, file or tensor, before any
    long work: no reference sampling, no engine, nothing written into an input folder."""
    if extra == "needs-no-cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cmp = importlib.import_module("kimi_rl_glue.numerics.compare")

    def no_long_work(*a, **k):
        raise AssertionError("the reference started sampling before the arguments were checked")

    monkeypatch.setattr(cmp, "sample_sequences", no_long_work)
    argv, text = setup(tmp_path, tiny_ckpt)
    before = {p: os.path.getmtime(p) for p in argv if os.path.isdir(p) and "tiny_" in p}
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == code, err
    assert len(err.splitlines()) == 1, err
    assert text in err and "Traceback" not in err, err
    if extra and extra != "needs-no-cuda":
        assert extra in err, err
    assert {p: os.path.getmtime(p) for p in before} == before  # the input is untouched


def test_every_flag_has_help():
    """``--help`` of every subcommand describes each of its flags."""
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in subs.choices.items():
        for action in sp._actions:
            assert action.help, f"kimi-rl {name} {'/'.join(action.option_strings)} has no help"


def test_rtn_hint_names_only_flags_dequantize_takes(tiny_ckpt, tmp_path, capsys):
    """The RTN checkpoint's hint suggests only flags dequantize accepts, and with them the RTN checkpoint
    dequantizes (exit 0)."""
    from kimi_core.checkpoint.dequantize import RTN_HINT

    flags = re.findall(r"--[a-z][a-z-]+", RTN_HINT)
    assert flags == ["--no-verify"]
    rtn = tiny_ckpt("k2", convention="rtn")
    assert main(["dequantize", "--input", rtn, "--output", str(tmp_path / "B")]) == 2
    assert "RTN" in capsys.readouterr().err and not (tmp_path / "B").exists()  # no half output to trip a re-run
    assert main(["dequantize", "--input", rtn, "--output", str(tmp_path / "B"), *flags]) == 0


def test_step0_table_marks_nothing_at_the_bf16_floor():
    """The demo's step-0 table (judged against the bf16 floor under it) carries no FLAGGED marks; check-numerics
    still marks flagged pairs."""
    from kimi_rl_glue.numerics.report import PairStats, format_table

    p = PairStats("trainer", "reference(bf16)", 0.2, 0.01, 1e-3, 0.99, None, None, flagged=True)
    assert "FLAGGED" not in format_table([p], {}, mark_flagged=False)
    assert "FLAGGED" in format_table([p], {})
