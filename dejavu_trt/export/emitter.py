"""A thin node emitter over onnx-graphsurgeon graphs and local functions.

The dense decode graph (export) and the plugin ops' local functions (rewrite) are written with the
same helpers, so the math of "dense layer" and "sparse op with everything selected" comes from one
place. Node names are `{scope}/{Op}_{n}`: the per-layer scopes (`layers.3.mlp`, ...) are what the
rewrite anchors on.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs


class Emitter:
    def __init__(self, graph: gs.Graph, scope: str = ""):
        self.graph = graph
        self.scope = scope
        self._count: dict[str, int] = {}

    def scoped(self, scope: str) -> "Emitter":
        e = Emitter(self.graph, scope)
        e._count = self._count  # share counters so names stay unique across scopes
        return e

    def _name(self, op: str) -> str:
        key = f"{self.scope}/{op}"
        n = self._count.get(key, 0)
        self._count[key] = n + 1
        return f"{key}_{n}" if self.scope else f"{op}_{n}"

    def op(self, op: str, inputs: list, attrs: dict | None = None, outputs: int | list = 1,
           domain: str | None = None, name: str | None = None):
        """Emit one node; returns its output tensor (or the list when it has several)."""
        name = name or self._name(op)
        if isinstance(outputs, int):
            outputs = [gs.Variable(f"{name}:{k}") for k in range(outputs)]
        node = gs.Node(op=op, name=name, attrs=attrs or {}, inputs=list(inputs), outputs=outputs, domain=domain)
        self.graph.nodes.append(node)
        return node.outputs[0] if len(node.outputs) == 1 else node.outputs

    # --- constants --------------------------------------------------------------------------
    def const(self, name: str, value) -> gs.Constant:
        return gs.Constant(name, np.ascontiguousarray(value))

    def ints(self, *values: int) -> gs.Constant:
        """A small int64 constant, named after its scope and value (reused names are fine in gs)."""
        key = "_".join(str(v).replace("-", "m") for v in values)
        return gs.Constant(f"{self.scope or 'c'}/i64_{key}_{self._bump('i64')}", np.array(values, dtype=np.int64))

    def scalar(self, value: float, dtype=np.float32) -> gs.Constant:
        return gs.Constant(f"{self.scope or 'c'}/f_{self._bump('f')}", np.array(value, dtype=dtype))

    def attr_int(self, attr: str):
        """Scalar int64 tensor holding a function attribute (only inside a local function)."""
        return self.op("Constant", [], {"value_int": gs.Node.AttributeRef(attr, int)})

    def attr_float(self, attr: str):
        return self.op("Constant", [], {"value_float": gs.Node.AttributeRef(attr, float)})

    def _bump(self, key: str) -> int:
        k = f"__{self.scope}/{key}"
        n = self._count.get(k, 0)
        self._count[k] = n + 1
        return n

    # --- common ops -------------------------------------------------------------------------
    def matmul(self, a, b):
        return self.op("MatMul", [a, b])

    def add(self, a, b):
        return self.op("Add", [a, b])

    def mul(self, a, b):
        return self.op("Mul", [a, b])

    def sub(self, a, b):
        return self.op("Sub", [a, b])

    def reshape(self, x, shape):
        return self.op("Reshape", [x, shape if isinstance(shape, gs.Tensor) else self.ints(*shape)])

    def unsqueeze(self, x, *axes):
        return self.op("Unsqueeze", [x, self.ints(*axes)])

    def cast(self, x, to):
        return self.op("Cast", [x], {"to": to})

    def transpose(self, x, perm):
        return self.op("Transpose", [x], {"perm": list(perm)})

    def gather(self, x, idx, axis=0):
        return self.op("Gather", [x, idx], {"axis": axis})

    def slice(self, x, start, end, axis):
        return self.op("Slice", [x, self.ints(start), self.ints(end), self.ints(axis)])

    def rms_normalize(self, x, eps_tensor):
        """x / sqrt(mean(x^2) + eps) over the last axis (no weight)."""
        ms = self.op("ReduceMean", [self.mul(x, x)], {"axes": [-1], "keepdims": 1})
        return self.op("Div", [x, self.op("Sqrt", [self.add(ms, eps_tensor)])])

    def gelu(self, x):
        """Exact (erf) GELU from opset-17 ops."""
        e = self.op("Erf", [self.op("Div", [x, self.scalar(np.sqrt(2.0))])])
        return self.mul(self.mul(x, self.add(e, self.scalar(1.0))), self.scalar(0.5))

    def silu(self, x):
        return self.mul(x, self.op("Sigmoid", [x]))

    def rope(self, u, cos, sin):
        """rotate_half RoPE on the last axis; cos/sin broadcast against u[..., :hd/2]."""
        u1, u2 = self.op("Split", [u], {"axis": -1}, outputs=2)
        a = self.sub(self.mul(u1, cos), self.mul(u2, sin))
        b = self.add(self.mul(u2, cos), self.mul(u1, sin))
        return self.op("Concat", [a, b], {"axis": -1})


INT64 = onnx.TensorProto.INT64
INT32 = onnx.TensorProto.INT32
FLOAT = onnx.TensorProto.FLOAT
