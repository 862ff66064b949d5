"""benchmarks/w4a16_ncu_profile.py's summary of Nsight Compute CSVs (``--csv --page details``), on a CSV written here
the way ncu writes it: units converted, one row per kernel, stall reasons ranked, a file with no kernel said so."""

from __future__ import annotations

import os

from utils import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _profile_module():
    return load_benchmark("w4a16_ncu_profile")


def _row(kid, kernel, metric, unit, value):
    return (f'"{kid}","7","python3","h","{kernel}","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","S","{metric}",'
            f'"{unit}","{value}"')


def test_summary_rows(tmp_path):
    lines = ["==PROF== Connected to process 7", HEAD,
             _row(0, "w4a16_rs_kernel", "Duration", "us", "17,330.50"),
             _row(0, "w4a16_rs_kernel", "Compute (SM) Throughput", "%", "61.2"),
             _row(0, "w4a16_rs_kernel", "Issue Slots Busy", "%", "48.5"),
             _row(0, "w4a16_rs_kernel", "Stall Wait", "", "1.5"),
             _row(0, "w4a16_rs_kernel", "Stall Long Scoreboard", "", "4.25"),
             _row(0, "w4a16_rs_kernel", "Stall Barrier", "", "0.5"),
             _row(0, "w4a16_rs_kernel", "Stall Math Pipe Throttle", "", "2.0"),
             _row(1, "cutlass_grouped_gemm", "Duration", "ms", "13.9"),
             _row(1, "cutlass_grouped_gemm", "Block Limit Registers", "block", "n/a")]
    path = tmp_path / "k3_fc1.csv"
    path.write_text("\n".join(lines) + "\n")
    empty = tmp_path / "empty.csv"
    empty.write_text("==PROF== No kernels were profiled.\n")
    table = _profile_module().summarize([str(path), str(empty)]).splitlines()
    assert len(table) == 5, table
    ours = table[2].split(" | ")
    assert ours[1] == "0 w4a16_rs_kernel" and ours[2] == "17.3" and ours[3] == "61.2" and ours[6] == "48.5"
    assert ours[-1].rstrip(" |") == "Long Scoreboard 4.2, Math Pipe Throttle 2, Wait 1.5"
    assert table[3].split(" | ")[2] == "13.9"  # ms stays ms
    assert "no kernel profiled" in table[4]


def test_tensor_pipe_column_and_metric_name(tmp_path):
    """The tensor pipe's busy share (asked for with ``--metrics``) lands in its column whatever base name this ncu
    lists, and ``tensor-metric`` picks the first listed base of ``TENSOR_PIPE_BASES`` out of ``--query-metrics``."""
    import subprocess
    import sys

    module = _profile_module()
    path = tmp_path / "k3_fc1_gluon.csv"
    path.write_text("\n".join([HEAD, _row(0, "w4a16_rs_kernel", "Duration", "ms", "15.2"),
                               _row(0, "w4a16_rs_kernel", "sm__pipe_tensor_op_gmma_cycles_active.avg."
                                    "pct_of_peak_sustained_elapsed", "%", "81.25")]) + "\n")
    table = module.summarize([str(path)]).splitlines()
    column = table[0].split(" | ").index("tensor pipe active %")
    assert table[2].split(" | ")[column] == "81.2"
    script = os.path.join(ROOT, "benchmarks", "w4a16_ncu_profile.py")
    listing = ("Device GH100 (sm_90)\n----\nsm__pipe_tensor_op_hmma_cycles_active   Counter   # of cycles\n"
               "sm__pipe_tensor_op_gmma_cycles_active   Counter   # of cycles\n")
    picked = subprocess.run([sys.executable, script, "tensor-metric"], input=listing, capture_output=True, text=True)
    assert picked.stdout.strip() == "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed"
    none = subprocess.run([sys.executable, script, "tensor-metric"], input="nothing\n", capture_output=True, text=True)
    assert none.returncode == 0 and none.stdout.strip() == ""
