"""Publish a ``ServerArgs`` as the values in effect in this process (SGLang's runtime context), as an
engine process does at start; for tests that run SGLang code reading ``runtime_context`` without an engine."""

from __future__ import annotations

__all__ = ["publish"]


def publish(server_args) -> None:
    """Reset SGLang's runtime context and publish ``server_args`` (0.5.17 and 0.5.23)."""
    import sglang.srt.runtime_context as rc

    rc.reset_context()
    # 0.5.23 publishes the spawn ranks too; 0.5.17's publish takes the role only
    rc.publish(
        server_args, role="test", **({"ranks": rc.SpawnRanks(world_rank=0)} if hasattr(rc, "SpawnRanks") else {})
    )
