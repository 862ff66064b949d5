"""Glue that wires the Kimi plugins into the RL loops of miles and SkyRL, plus the ``kimi-rl`` CLI."""
