"""User-facing errors.

Anything the user can fix (a bad argument, a missing model, a corrupt artifact) raises a
`DejaVuError`. The CLI prints it as one line and exits with status 2, without a traceback.
"""


class DejaVuError(Exception):
    """An error the user can act on. Its message is one line and says what to do."""

    exit_code = 2


class ModelNotAvailableError(DejaVuError):
    """The model's weights are not present locally (the tool never downloads)."""


class ArtifactError(DejaVuError):
    """An artifact (work dir, export, engine package, safetensors file) is missing, corrupt or foreign."""


def check_fraction(name: str, value: float | None) -> float | None:
    """Validate a kept fraction: must lie in (0, 1]."""
    if value is None:
        return None
    if not (0.0 < float(value) <= 1.0):
        raise DejaVuError(f"{name} must be in (0, 1] (a fraction kept active), got {value}")
    return float(value)
