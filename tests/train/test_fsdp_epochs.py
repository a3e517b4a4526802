"""Two gloo processes through whole epochs: each rank reads its own share of the blocks, the filters leave the
shares with different numbers of steps, and the trainer's agreement callback ends every epoch on both at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rollshard.store.loader import LoaderConfig, RolloutLoader
from rollshard.store.format.schema import Row, Status
from rollshard.store.io.writer import ShardWriter, WriterOptions

HERE = Path(__file__).parent
BLOCKS, GROUPS_PER_BLOCK = 16, 2


def write_blocks(out: Path) -> Path:
    """16 row groups of 2 groups; every other block holds only zero-variance groups (both rows reward 0.5)."""
    with ShardWriter(out, writer_id="test", config={}, options=WriterOptions(row_group_bytes=1 << 30)) as w:
        for b in range(BLOCKS):
            for j in range(GROUPS_PER_BLOCK):
                g = b * GROUPS_PER_BLOCK + j
                rewards = [0.5, 0.5] if b % 2 else [0.0, 1.0]
                w.write_group([
                    Row(
                        sample_id=f"p{g}-{i}", prompt_id=f"p{g}", group_id=f"p{g}/policy/0", agent="policy", round=0,
                        prompt_tokens=[5 + g, 6, 7], response_tokens=[(11 * i + k + g) % 500 + 3 for k in range(4)],
                        rollout_logprobs=[-1.0] * 4, loss_mask=[1] * 4, reward=r, status=Status.COMPLETED,
                        finish_reason="stop", weight_version="0", temperature=1.0, top_p=1.0, top_k=-1,
                    )
                    for i, r in enumerate(rewards)
                ])
            w.flush()
            if b % 4 == 3:
                w.commit()
    return out


def steps_per_epoch_alone(data: Path, rank: int) -> list[int]:
    """What one rank's share yields per epoch with no agreement between the ranks."""
    cfg = LoaderConfig(groups_per_step=1, num_epochs=2, drop_zero_variance=True, shuffle_window=4)
    with RolloutLoader(data, cfg, rank=rank, world_size=2) as ld:
        counts = [0, 0]
        for step in ld:
            counts[step.epoch] += 1
    return counts


def test_epochs_end_on_every_rank_at_once(tiny_gpt2, tmp_path):
    data = write_blocks(tmp_path / "data")
    alone = [steps_per_epoch_alone(data, r) for r in (0, 1)]
    # The premise: the shares hold different numbers of steps (else the callback would have nothing to do).
    assert alone[0] != alone[1], alone
    expected = [e for e in (0, 1) for _ in range(min(alone[0][e], alone[1][e]))]

    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(HERE / "fsdp_epochs_worker.py"),
         str(data), str(tiny_gpt2), str(tmp_path / "out")],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    epochs = [json.loads((tmp_path / "out" / f"epochs-{r}.json").read_text()) for r in (0, 1)]
    # Both ranks trained the steps of epoch 0, then of epoch 1, as many as the poorer share held in each.
    assert epochs[0] == epochs[1] == expected
    # The loader's filter counts are each rank's, summed like the packing figures: every group examined for a
    # step was trained (one a rank) or filtered out.
    history = json.loads((tmp_path / "out" / "history.json").read_text())
    for m in history:
        assert m["data/groups"] == 2
        assert m["loader/groups_examined"] == 2 + m["loader/filtered_groups/zero_variance"]
    assert sum(m["loader/filtered_groups/zero_variance"] for m in history) > 0
