"""`dejavu-trt` command line. Each pipeline stage's commands live in their own module."""
from __future__ import annotations

import logging
import sys

from ..errors import DejaVuError
from .app import app

# Importing a module registers its commands on `app`.
from . import models as _models  # noqa: F401,E402
from . import foundation as _foundation  # noqa: F401,E402
from . import evaluate as _evaluate  # noqa: F401,E402
from . import compiler as _compiler  # noqa: F401,E402
from . import runtime as _runtime  # noqa: F401,E402


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors become one line on stderr and exit status 2, without a traceback."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        # With standalone_mode=False click returns typer.Exit(n)'s code instead of raising it.
        rc = app(args=argv, standalone_mode=False)
    except DejaVuError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # Usage errors from typer's (vendored) click: print the usage line, exit 2 like click does.
        if hasattr(e, "show") and hasattr(e, "exit_code"):
            e.show()
            return e.exit_code
        if type(e).__name__ == "Exit":
            return getattr(e, "exit_code", 0)
        if type(e).__name__ == "Abort":
            return 1
        raise
    return rc if isinstance(rc, int) else 0


@app.callback()
def _root() -> None:
    """DejaVu contextual sparsity for LLM decoding."""


if __name__ == "__main__":
    sys.exit(main())
