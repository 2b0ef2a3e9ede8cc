"""Stage 2: run the model over a corpus with hooks and record what the predictors learn from."""
from .hooks import ActivityRecorder, block_activity, head_importance
from .records import CalibrationRecords
from .workdir import WorkDir, calibrate, open_workdir

__all__ = ["ActivityRecorder", "block_activity", "head_importance", "CalibrationRecords", "WorkDir",
           "calibrate", "open_workdir"]
