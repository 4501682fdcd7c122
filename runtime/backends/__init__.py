"""Engine backends: torch now; ONNX Runtime and TensorRT arrive with their issues."""
