"""Stage 3: low-rank lookahead predictors of MLP units and heads, and their training."""
from .metrics import kept_count, topk_recall
from .model import PREDICTORS_FILE, PREDICTORS_FORMAT, LookaheadPredictors, input_index
from .training import TrainConfig, train_predictors

__all__ = ["kept_count", "topk_recall", "PREDICTORS_FILE", "PREDICTORS_FORMAT", "LookaheadPredictors",
           "input_index", "TrainConfig", "train_predictors"]
