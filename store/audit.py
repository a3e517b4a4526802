"""The per-token audit report: the trainer's logprob of every stored response token beside the engine's.

``rollshard-train audit`` writes it (one Parquet file, :data:`AUDIT_SCHEMA`, one row per trained token,
loss_mask 1); ``rollshard-store report --audit`` and ``rollshard-store inspect --sample worst-mismatch
--audit`` read it. The schema lives here, in store, because train writes it and store reads it.
"""

from __future__ import annotations

import pyarrow as pa

AUDIT_SCHEMA_VERSION = "1.0"

AUDIT_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("agent", pa.string(), nullable=False),
        pa.field("weight_version", pa.string(), nullable=False),  # the row's (last) version
        pa.field("temperature", pa.float32(), nullable=False),  # the row's sampling temperature
        pa.field("position", pa.int32(), nullable=False),  # index in response_tokens
        pa.field("token", pa.int32(), nullable=False),
        pa.field("rollout_logprob", pa.float32(), nullable=False),  # the engine's, as stored
        pa.field("trainer_logprob", pa.float32(), nullable=False),  # recomputed: fp32 log softmax(logits / T)
    ],
    metadata={"rollshard.audit_schema_version": AUDIT_SCHEMA_VERSION},
)
