"""The on-disk format: the row schema and its invariants, routing, manifests, lineage, group statistics."""
