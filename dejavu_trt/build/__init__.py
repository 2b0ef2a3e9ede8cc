"""`dejavu-trt build`: the whole pipeline from a model to an engine package."""
