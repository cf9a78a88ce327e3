"""The serving engine: models over paged KV pools, speculators, and continuous batching.

Initialisation runs in three phases that ``ModelWorker.init_model_worker`` orders:
load weights (target, then draft), allocate KV pools (sized once every weight is resident),
initialise attention backends and CUDA graphs.
"""
