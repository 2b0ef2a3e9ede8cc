"""`dejavu-trt models`: list the model aliases and whether each is available locally."""
from __future__ import annotations

import typer

from .app import app


@app.command("models")
def list_models() -> None:
    """List known model aliases and whether their weights are present locally (never downloads)."""
    from rich.console import Console
    from rich.table import Table

    from ..errors import DejaVuError
    from ..models.loading import locate
    from ..models.registry import DEFAULT_MODEL, REGISTRY

    table = Table("alias", "family", "source", "local")
    for alias, spec in sorted(REGISTRY.items()):
        try:
            where = str(locate(spec))
        except DejaVuError:
            where = "-"
        name = f"{alias} (default)" if alias == DEFAULT_MODEL else alias
        table.add_row(name, spec.family or "?", spec.hf_id or spec.package or "folder", where)
    Console().print(table)
