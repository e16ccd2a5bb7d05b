"""User-facing errors: every one names the file, the field, what was expected and what was found."""
from __future__ import annotations


class NanoqwenError(Exception):
    """A user error (bad file, bad checkpoint, bad argument). The CLI prints it on one line, exit 2."""

    def __init__(self, file, field: str, expected, found, hint: str | None = None):
        self.file = str(file) if file is not None else "<arguments>"
        self.field = field
        self.expected = expected
        self.found = found
        self.hint = hint
        msg = f"{self.file}: {field}: expected {expected}, found {found}"
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)


class FormatError(NanoqwenError):
    """A .nanoqwen file that fails validation."""


class CheckpointError(NanoqwenError):
    """A Hugging Face checkpoint directory that cannot be packed."""


class ConfigError(NanoqwenError):
    """A model config outside what nanoqwen supports."""


class LimitError(NanoqwenError):
    """A request that does not fit (prompt length, KV pool, vocab range)."""
