"""Engine backends behind one `TargetEngine` contract: torch (the reference), ONNX Runtime (`ort_backend`) and
TensorRT plans (`trt_backend`)."""
