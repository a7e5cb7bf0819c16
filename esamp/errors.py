"""Errors a user can act on. Each carries a message and a hint that says what to do."""

from __future__ import annotations

SHOWN_CHARS = 40  # characters of a value that an error message repeats


def shown(value: object, quote: bool = True) -> str:
    """``value`` as an error message repeats it: ``repr(value)`` (``quote``) or ``str(value)``, cut
    to its first ``SHOWN_CHARS`` characters with an ellipsis and the whole length when longer. A
    message names what was wrong; it does not send a client's 100 KB value back to it."""
    text = repr(value) if quote else str(value)
    if len(text) <= SHOWN_CHARS:
        return text
    length = len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else len(text)
    unit = "items" if isinstance(value, (list, tuple, dict)) else "characters"
    return f"{text[:SHOWN_CHARS]}… ({length} {unit})"


class EsampError(Exception):
    """Base class: ``str(err)`` is the message, ``err.hint`` tells the user what to do next."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def user_text(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class ConfigError(EsampError):
    """A setting is outside its allowed range or of the wrong type."""


class ModelNotFoundError(EsampError):
    """A --model argument matched nothing on disk."""


class ModelFormatError(EsampError):
    """A model file exists but is not what it claims to be (e.g. a .gguf that is not GGUF)."""


class PromptError(EsampError):
    """The prompt is empty or does not fit the model's context."""


class BankFullError(EsampError):
    """Every Distiller slot is held by a running prompt group."""


class EngineError(EsampError):
    """The engine could not start or failed while running."""
