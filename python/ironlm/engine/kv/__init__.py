"""The KV tier under the device pool: `tier` stores the blocks (host memory or a file) and persists the core's
index of them; `lifecycle` is what the engine does for it outside the step (restore, cost model, pins, save).

Nothing is imported here: `ironlm.engine.kv.tier` loads torch, and the model runner needs only that half.
"""
