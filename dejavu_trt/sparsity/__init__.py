"""Stage 4: choose the sparsity (plan, budget search) and measure what it costs (sparse reference, metrics)."""
from .metrics import bytes_per_token, evaluate_selection, perplexity, token_nll_batched, token_nll_decode
from .plan import PLAN_FILE, SparsityPlan, kept_count
from .reference import MODES, SelectionStats, SparseReference, sparse_model, topk_mask

__all__ = ["bytes_per_token", "evaluate_selection", "perplexity", "token_nll_batched", "token_nll_decode",
           "PLAN_FILE", "SparsityPlan", "kept_count", "MODES", "SelectionStats", "SparseReference",
           "sparse_model", "topk_mask"]
