"""The plugin ops' contract (docs/ops.md) and their torch reference implementations."""
from .contract import OP_CONTRACT_VERSION, PLUGIN_NAMESPACE, OP_NAMES

__all__ = ["OP_CONTRACT_VERSION", "PLUGIN_NAMESPACE", "OP_NAMES"]
