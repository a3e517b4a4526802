"""Datasets derived from another: the shard-by-shard primitive and row filters."""
