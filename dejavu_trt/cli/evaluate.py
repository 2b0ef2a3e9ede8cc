"""Commands of this stage group are registered here (see cli/app.py)."""
from .app import app  # noqa: F401
