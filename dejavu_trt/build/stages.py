"""Stage caching: a stage re-runs only when the hash of its inputs changed or its outputs are gone.

`work/NAME/stages.json` records, per stage, the key it was last completed with. A stage's key
hashes its own parameters together with the key of the stage before it, so changing an early input
(the corpus, say) re-runs everything after it, while re-running after a failure resumes at the stage
that failed.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..artifacts import atomic_write_json

STAGES_FILE = "stages.json"


def stage_key(name: str, params: dict, upstream: str) -> str:
    blob = json.dumps({"stage": name, "params": params, "upstream": upstream}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


@dataclass
class StageLog:
    root: Path
    done: dict = field(default_factory=dict)
    ran: list = field(default_factory=list)       # names of stages that ran this time
    cached: list = field(default_factory=list)    # names of stages reused from an earlier run
    seconds: dict = field(default_factory=dict)

    @classmethod
    def open(cls, root: Path) -> "StageLog":
        root.mkdir(parents=True, exist_ok=True)
        path = root / STAGES_FILE
        done = {}
        if path.is_file():
            try:
                done = json.loads(path.read_text())
            except ValueError:
                done = {}  # a damaged log only costs a re-run
        return cls(root, done if isinstance(done, dict) else {})

    def run(self, name: str, params: dict, upstream: str, outputs: list[Path], fn: Callable[[], object],
            say: Callable[[str], None] = print) -> str:
        key = stage_key(name, params, upstream)
        if self.done.get(name) == key and all(Path(p).exists() for p in outputs):
            self.cached.append(name)
            say(f"[{name}] up to date (inputs unchanged), reusing {', '.join(str(p) for p in outputs)}")
            return key
        say(f"[{name}] running")
        t0 = time.perf_counter()
        fn()
        self.seconds[name] = time.perf_counter() - t0
        self.done[name] = key
        atomic_write_json(self.root / STAGES_FILE, self.done)
        self.ran.append(name)
        return key
