import numpy as np
import pytest
import torch

from rollshard.store.packing import Sequences, first_fit_decreasing, pack, packing_efficiency, unpack


def seqs_of(rows: list[dict]) -> Sequences:
    return Sequences(
        prompt=[np.asarray(r["prompt"], np.int32) for r in rows],
        response=[np.asarray(r["response"], np.int32) for r in rows],
        logprobs=[np.asarray(r["logprobs"], np.float32) for r in rows],
        mask=[np.asarray(r["mask"], np.uint8) for r in rows],
        temperature=np.asarray([r["temperature"] for r in rows], np.float32),
        reward=np.asarray([r["reward"] for r in rows], np.float32),
        group=np.asarray([r["group"] for r in rows], np.int64),
        agent=[r["agent"] for r in rows],
        sample_id=[r["sample_id"] for r in rows],
        weight_version=[r["version"] for r in rows],
    )


def test_first_fit_decreasing_worked_example():
    # Longest first: 5 -> bin0 (room 3); 4 -> bin1 (room 4); 3 -> bin0 (room 0); 3 -> bin1 (room 1);
    # 2 -> bin2 (room 6); 1 -> bin1 (room 0). Members listed in index order.
    bins = first_fit_decreasing(np.array([5, 4, 3, 3, 2, 1]), 8)
    assert [b.tolist() for b in bins] == [[0, 2], [1, 3, 5], [4]]
    # 18 real tokens in 3 micro-batches of 8
    assert packing_efficiency([8, 8, 2], 8) == pytest.approx(18 / 24)


def test_oversize_sequence_gets_its_own_micro_batch_and_counts_as_full():
    bins = first_fit_decreasing(np.array([3, 10, 3, 9]), 8)
    assert [b.tolist() for b in bins] == [[1], [3], [0, 2]]
    # 25 tokens over max(8, 10) + max(8, 9) + max(8, 6) = 27
    assert packing_efficiency([10, 9, 6], 8) == pytest.approx(25 / 27)


def test_pack_layout_and_round_trip():
    rows = [
        dict(prompt=[7, 8], response=[1, 2, 3], logprobs=[-0.5, 0.0, -1.5], mask=[1, 0, 1], temperature=0.7,
             reward=1.0, group=0, agent="solver", sample_id="a", version="3"),
        dict(prompt=[9], response=[4], logprobs=[-0.25], mask=[1], temperature=float("nan"),
             reward=0.0, group=0, agent="solver", sample_id="b", version=None),
        dict(prompt=[5, 5, 5], response=[6, 6], logprobs=[-2.0, -3.0], mask=[1, 1], temperature=0.0,
             reward=0.5, group=1, agent="selector", sample_id="c", version="2"),
    ]
    batches, eff = pack(seqs_of(rows), budget=7)
    # lengths 5, 2, 5 with budget 7: 5 -> bin0, 5 -> bin1, 2 -> bin0 => bins [0, 1] and [2]
    assert [b.sample_ids for b in batches] == [["a", "b"], ["c"]]
    assert eff == pytest.approx(12 / 14)
    b = batches[0]
    assert b.num_tokens == 7 and b.num_sequences == 2
    assert (b.num_loss_tokens, batches[1].num_loss_tokens) == (3, 2)  # masks [1, 0, 1] + [1]; [1, 1]
    assert b.input_ids.tolist() == [7, 8, 1, 2, 3, 9, 4]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert b.cu_seqlens.tolist() == [0, 5, 7] and b.cu_seqlens.dtype == torch.int32
    assert b.response_start.tolist() == [2, 6]
    assert b.loss_mask.tolist() == [0, 0, 1, 0, 1, 0, 1]
    assert b.rollout_logprobs.tolist() == [0, 0, -0.5, 0, -1.5, 0, -0.25]
    # row temperature on every token; a null temperature is 1.0
    assert b.temperature.tolist() == pytest.approx([0.7] * 5 + [1.0] * 2)
    assert batches[1].temperature.tolist() == [0.0] * 5  # greedy stays 0; the trainer maps <= 0 to 1
    assert b.seq_group.tolist() == [0, 0] and batches[1].seq_group.tolist() == [1]
    assert b.rewards.tolist() == [1.0, 0.0] and b.weight_versions == ["3", None]
    assert b.input_ids.dtype == torch.int64 and b.loss_mask.dtype == torch.float32
    back = {r["sample_id"]: r for batch in batches for r in unpack(batch)}
    for r in rows:
        u = back[r["sample_id"]]
        assert u["prompt_tokens"] == r["prompt"] and u["response_tokens"] == r["response"]
        assert u["loss_mask"] == r["mask"] and u["rollout_logprobs"] == r["logprobs"]
        assert (u["agent"], u["reward"], u["group"]) == (r["agent"], r["reward"], r["group"])


def test_empty_prompt_cannot_train_its_first_token():
    rows = [dict(prompt=[], response=[1, 2], logprobs=[-0.5, -0.5], mask=[1, 1], temperature=1.0,
                 reward=1.0, group=0, agent="policy", sample_id="a", version="0")]
    (b,), _ = pack(seqs_of(rows), budget=8)
    assert b.loss_mask.tolist() == [0, 1]  # nothing predicts position 0


def test_budget_respected_on_random_lengths():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 500)
    bins = first_fit_decreasing(lengths, 256)
    assert sorted(np.concatenate(bins).tolist()) == list(range(500))
    for b in bins:
        assert lengths[b].sum() <= 256 or len(b) == 1
    # FFD leaves less than one bin of slack on this mix: well above 0.9
    assert packing_efficiency([int(lengths[b].sum()) for b in bins], 256) > 0.9


def test_rows_without_tokens_pack_to_empty_sequences():
    rows = [dict(prompt=[], response=[], logprobs=[], mask=[], temperature=1.0, reward=0.0, group=0, agent="policy",
                 sample_id=s, version="0") for s in "ab"]
    (b,), eff = pack(seqs_of(rows), budget=8)
    assert b.num_tokens == 0 and b.cu_seqlens.tolist() == [0, 0, 0] and b.num_loss_tokens == 0
    assert eff == 0.0
