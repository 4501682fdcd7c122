"""specrt.plugins: the custom ops TreeAttention and ConfidenceTruncate (torch reference, ONNX function body,
Triton kernel, TensorRT plugin) and the user-facing error type."""
