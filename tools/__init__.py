"""specrt.tools: the `specrt` CLI, training, data building, benchmarks and comparison scripts."""
