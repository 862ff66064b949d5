"""Framework-free single source of truth of kimi-rl-plugins: configs, 4-bit formats, kernels,
the numerical reference, LoRA adapter formats and checkpoint I/O."""

__version__ = "0.1.0"
