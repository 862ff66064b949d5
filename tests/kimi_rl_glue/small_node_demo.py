"""Runs ``kimi-rl demo`` on a machine that reports a small NUMA node: 8 GiB total, 7.29 GiB available.

vLLM's CPU worker reads node 0's ``MemTotal``/``MemAvailable`` through
``vllm.v1.worker.cpu_worker.get_memory_node_info``. This script replaces that name at import, at module
level, because vLLM starts its engine-core and worker processes with ``spawn`` here and a spawned child
re-imports the main module (as ``__mp_main__``) but does not run the ``__main__`` block; then it runs the
CLI with the arguments it was given. The numbers are the ones of the fresh VM in issue #22, where a KV
cache sized as ``gpu_memory_utilization=0.05`` of the node went negative. Started by
tests/kimi_rl_glue/test_demo.py.
"""

import sys

from vllm.utils.cpu_resource_utils import MemoryNodeInfo
from vllm.v1.worker import cpu_worker

GiB = 1 << 30
TOTAL, AVAILABLE = 8 * GiB, int(7.29 * GiB)


def _small_node(node_id: int = 0) -> MemoryNodeInfo:
    return MemoryNodeInfo(total_memory=TOTAL, available_memory=AVAILABLE)


cpu_worker.get_memory_node_info = _small_node

if __name__ == "__main__":
    from kimi_rl_glue.cli import main

    sys.exit(main(sys.argv[1:]))
