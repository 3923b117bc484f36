"""User-facing errors: `str(e)` is one line naming the file, tensor or field and what is wrong."""


class NinferError(ValueError):
    """Base of every error a CLI reports as `error: <message>` without a traceback."""


class FormatError(NinferError):
    """The container or an encoded tensor violates FORMAT.md."""


class ChecksumError(FormatError):
    """A tensor or resource does not match its recorded checksum."""


class SourceError(NinferError):
    """The packer's input (HF checkpoint, recipe, arguments) is unusable."""


class LoadError(NinferError):
    """The runtime cannot bind an artifact (wrong model, missing tensor, bad TP set)."""
