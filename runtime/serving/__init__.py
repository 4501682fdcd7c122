"""Serving many requests from one engine: continuous batching, scheduled verification, HTTP.

    rows.py        row views of a slot-cache engine / proposer, per-row reset
    policy.py      verify-length policies: fixed, DSpark Algorithm 1 over survivals (+ draft gate)
    batcher.py     the continuous-batching loop (one thread owns it)
    loading.py     model flags, engine sizing, SPS lookup: shared by serve, calibrate and the bench
    loop.py        the background engine thread: bounded queue, cancellation, metrics
    calibrate.py   SPS(B) profiling (`specrt calibrate`), sps.json + plot
    openai_api.py  OpenAI request validation and response shapes
    server.py      the FastAPI app (`specrt serve`)
"""
