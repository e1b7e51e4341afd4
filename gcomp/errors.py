"""Errors gcomp raises on purpose.

Every error a user can cause derives from :class:`GcompError`; the CLI turns
these into one line on stderr and exit code 2.  Anything else escaping is a bug
in gcomp.
"""


class GcompError(Exception):
    """Base class of all errors that describe a problem with the user's input."""


class IRError(GcompError):
    """The Graph IR is malformed (raised by the verifier, parser and builder)."""


class InputError(GcompError):
    """A graph, feature or edge-value input is invalid."""


class ArtifactError(GcompError):
    """An artifact is corrupt, truncated, or from an incompatible version."""


class CompileError(GcompError):
    """A model could not be compiled for the requested target."""


class ModelImportError(GcompError):
    """A model file (ONNX) could not be imported."""
