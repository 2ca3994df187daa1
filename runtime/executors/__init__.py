"""The executors: the step contract (`StepBatch`) and what runs a step (ONNX Runtime over gathered
blocks or lanes, the native step); `choose` picks one per graph."""
