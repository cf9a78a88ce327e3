"""The serving engine: models over paged KV pools, speculative workers and a scheduler.

Initialisation runs in three phases that ``Scheduler.init_model_worker`` orders:
load weights (target, then draft), allocate KV pools (sized once every weight is resident),
initialise attention backends and CUDA graphs.
"""
