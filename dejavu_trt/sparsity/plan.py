"""How many MLP units and heads each layer keeps per decode token: the `SparsityPlan`.

A plan comes from global fractions (`--sparsity S`, `--head-sparsity H`: kept count
`max(1, round(f * units))` in every layer) or from the perplexity-budget search in
`budget.py`. The chosen plan is written to `WORKDIR/sparsity.json` (atomically) so that later
stages (export, build) use the same kept counts. Schema of `sparsity.json`:

    {
      "schema": "dejavu-trt/sparsity-plan",
      "version": 1,
      "block_size": 1,                       # MLP selection unit in neurons (docs/ops.md)
      "num_units": 1536,                     # selectable MLP units per layer = N / block_size
      "num_heads": 9,                        # query heads per layer
      "mlp_kept_units": [768, 768, ...],     # per layer, the op's `kept_units` (K), 1..num_units
      "heads_kept": [6, 6, ...],             # per layer, the op's `kept_heads` (Kh), 1..num_heads
      "source": "--sparsity 0.5 --head-sparsity 1.0"   # or "budget 0.05 (...)"
    }
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..artifacts import atomic_write_json
from ..errors import ArtifactError, DejaVuError, check_fraction
from ..models.adapters import ModelDims

PLAN_FILE = "sparsity.json"
PLAN_SCHEMA = "dejavu-trt/sparsity-plan"
PLAN_VERSION = 1


def kept_count(fraction: float, units: int) -> int:
    """Units kept for a kept fraction: max(1, round(f * units)) (Python rounds halves to even)."""
    return max(1, min(units, int(round(fraction * units))))


@dataclass
class SparsityPlan:
    num_units: int                     # selectable MLP units per layer (N / block_size)
    num_heads: int
    mlp_kept_units: list[int]          # per layer
    heads_kept: list[int]              # per layer
    block_size: int = 1
    source: str = ""
    extra: dict = field(default_factory=dict)   # free-form provenance (e.g. the budget search)

    def __post_init__(self):
        if len(self.mlp_kept_units) != len(self.heads_kept):
            raise DejaVuError("sparsity plan: mlp_kept_units and heads_kept have different lengths")
        for k in self.mlp_kept_units:
            if not 1 <= int(k) <= self.num_units:
                raise DejaVuError(f"sparsity plan: kept MLP units {k} outside 1..{self.num_units}")
        for k in self.heads_kept:
            if not 1 <= int(k) <= self.num_heads:
                raise DejaVuError(f"sparsity plan: kept heads {k} outside 1..{self.num_heads}")
        self.mlp_kept_units = [int(k) for k in self.mlp_kept_units]
        self.heads_kept = [int(k) for k in self.heads_kept]

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def dense(cls, dims: ModelDims, block_size: int = 1, source: str = "dense") -> "SparsityPlan":
        nb = _num_units(dims, block_size)
        L = dims.num_layers
        return cls(nb, dims.num_heads, [nb] * L, [dims.num_heads] * L, block_size, source)

    @classmethod
    def from_fractions(cls, dims: ModelDims, sparsity: float | None = None, head_sparsity: float | None = None,
                       block_size: int = 1) -> "SparsityPlan":
        """The same kept fraction in every layer. None means dense (1.0)."""
        s = check_fraction("--sparsity", sparsity if sparsity is not None else 1.0)
        h = check_fraction("--head-sparsity", head_sparsity if head_sparsity is not None else 1.0)
        nb = _num_units(dims, block_size)
        L = dims.num_layers
        return cls(nb, dims.num_heads, [kept_count(s, nb)] * L, [kept_count(h, dims.num_heads)] * L,
                   block_size, f"--sparsity {s:g} --head-sparsity {h:g}")

    def replace(self, mlp_kept_units=None, heads_kept=None, source=None) -> "SparsityPlan":
        return SparsityPlan(self.num_units, self.num_heads,
                            list(mlp_kept_units if mlp_kept_units is not None else self.mlp_kept_units),
                            list(heads_kept if heads_kept is not None else self.heads_kept),
                            self.block_size, self.source if source is None else source, dict(self.extra))

    # --- views --------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.mlp_kept_units)

    def mlp_fraction(self, layer: int) -> float:
        return self.mlp_kept_units[layer] / self.num_units

    def head_fraction(self, layer: int) -> float:
        return self.heads_kept[layer] / self.num_heads

    @property
    def mlp_fractions(self) -> list[float]:
        return [self.mlp_fraction(i) for i in range(self.num_layers)]

    @property
    def head_fractions(self) -> list[float]:
        return [self.head_fraction(i) for i in range(self.num_layers)]

    @property
    def is_dense(self) -> bool:
        return all(k == self.num_units for k in self.mlp_kept_units) and \
            all(k == self.num_heads for k in self.heads_kept)

    # --- persistence --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {"schema": PLAN_SCHEMA, "version": PLAN_VERSION, "block_size": self.block_size,
               "num_units": self.num_units, "num_heads": self.num_heads,
               "mlp_kept_units": self.mlp_kept_units, "heads_kept": self.heads_kept, "source": self.source}
        if self.extra:
            out["extra"] = self.extra
        return out

    @classmethod
    def from_dict(cls, d: dict, dims: ModelDims | None = None) -> "SparsityPlan":
        if not isinstance(d, dict) or d.get("schema") != PLAN_SCHEMA:
            raise ArtifactError("not a dejavu-trt sparsity plan (schema mismatch)")
        if d.get("version") != PLAN_VERSION:
            raise ArtifactError(f"sparsity plan version {d.get('version')} is not {PLAN_VERSION}: re-run evaluate")
        try:
            plan = cls(int(d["num_units"]), int(d["num_heads"]), list(d["mlp_kept_units"]), list(d["heads_kept"]),
                       int(d["block_size"]), str(d.get("source", "")), dict(d.get("extra", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"sparsity plan is malformed ({e.__class__.__name__}: {e})") from None
        if dims is not None:
            if (plan.num_layers, plan.num_heads, plan.num_units) != \
                    (dims.num_layers, dims.num_heads, _num_units(dims, plan.block_size)):
                raise ArtifactError("sparsity plan does not match the model's layers/heads/units: re-run evaluate")
        return plan

    def save(self, workdir: str | Path) -> Path:
        path = Path(workdir) / PLAN_FILE
        atomic_write_json(path, self.to_dict())
        return path

    @classmethod
    def load(cls, workdir: str | Path, dims: ModelDims | None = None) -> "SparsityPlan":
        path = Path(workdir) / PLAN_FILE
        if not path.is_file():
            raise ArtifactError(f"{path} does not exist: run `dejavu-trt evaluate {workdir} --sparsity S` "
                                f"or `--max-ppl-increase P` first")
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ArtifactError(f"{path} is corrupt ({e.__class__.__name__}): re-run evaluate") from None
        return cls.from_dict(d, dims)


def _num_units(dims: ModelDims, block_size: int) -> int:
    if block_size < 1 or dims.intermediate_size % block_size:
        raise DejaVuError(f"block size {block_size} must be >= 1 and divide N={dims.intermediate_size}")
    return dims.intermediate_size // block_size
