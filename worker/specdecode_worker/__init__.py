"""specdecode worker: the memory planner and the speculative-decoding server."""
