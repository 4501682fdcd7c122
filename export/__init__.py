"""specrt.export: torch model definitions, checkpoint loading, ONNX export, quantization and TensorRT builds."""
