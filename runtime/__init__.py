"""specrt.runtime: generation loops, sampling, KV cache, backends and the `specrt` CLI."""
