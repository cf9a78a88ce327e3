"""Trains the small draft models the CPU benchmarks measure (an EAGLE head, an MTP model); run once, cached."""
