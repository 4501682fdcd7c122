"""specrt.runtime: the speculative loop, verification, sampling, KV cache, proposers, backends and serving."""
