"""The loader: ``make_loader``'s plan, its worker pool, samplers and orders, the fetch-ahead for datasets read a
block at a time, and ``stream()`` over WebDataset shards.
"""
