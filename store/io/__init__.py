"""Storage (local, S3) and datasets on it: the shard writer, the dataset, integrity checks, validation."""
