"""KV memory: the paged pools, phase 2's measurement of how many slots fit, and the slots' one owner."""
