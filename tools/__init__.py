"""specrt.tools: training, data building, benchmarks and comparison scripts."""
