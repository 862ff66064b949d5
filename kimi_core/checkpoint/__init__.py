"""Checkpoint I/O: lazy sharded safetensors reader, atomic sharded writer, tiny-checkpoint factory."""

from kimi_core.checkpoint.reader import CheckpointError, CheckpointReader
from kimi_core.checkpoint.writer import write_checkpoint

__all__ = ["CheckpointError", "CheckpointReader", "write_checkpoint"]
