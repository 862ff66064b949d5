"""One file per architecture. Imported lazily by vLLM through the strings in ``registration.MODEL_CLASSES``."""
