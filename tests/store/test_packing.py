import dataclasses

import numpy as np
import pytest
import torch

from rollshard.store.loader.packing import (
    Sequences,
    first_fit_decreasing,
    pack,
    packing_efficiency,
    positions_from_cu_seqlens,
    token_temperatures,
    unpack,
)


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
    assert b.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1]  # derived from cu_seqlens, not stored
    assert b.cu_seqlens.tolist() == [0, 5, 7] and b.cu_seqlens.dtype == torch.int32
    assert b.response_start.tolist() == [2, 6]
    assert b.loss_mask.tolist() == [0, 0, 1, 0, 1, 0, 1]
    assert b.rollout_logprobs.tolist() == [0, 0, -0.5, 0, -1.5, 0, -0.25]
    # one temperature per sequence (float32 0.7); a null temperature is 1.0; on every token by derivation
    assert b.temperatures.tolist() == [np.float32(0.7), 1.0] and b.temperatures.dtype == torch.float32
    assert b.temperature.tolist() == [np.float32(0.7)] * 5 + [1.0] * 2
    assert batches[1].temperatures.tolist() == [0.0]  # greedy stays 0; the trainer maps <= 0 to 1
    assert {f.name for f in dataclasses.fields(b)}.isdisjoint({"position_ids", "temperature"})  # no [T] copies
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


def with_supports(rows: list[dict]) -> Sequences:
    seqs = seqs_of(rows)
    sup = [r.get("support") for r in rows]
    seqs.sampling_logprobs = [None if s is None else np.asarray(r["sampling"], np.float32) for r, s in zip(rows, sup)]
    seqs.support = [None if s is None else (np.asarray([i for t in s for i in t], np.int32),
                                            np.asarray([len(t) for t in s], np.int64)) for s in sup]
    return seqs


SUPPORTED = [
    # "s" was sampled from top-k supports (tokens 1 and 3; token 2 is a tool result), "n" without truncation.
    dict(prompt=[7, 8], response=[1, 2, 3], logprobs=[-0.5, 0.0, -1.5], mask=[1, 0, 1], temperature=1.0,
         reward=1.0, group=0, agent="solver", sample_id="s", version="0",
         sampling=[-0.25, 0.0, -1.0], support=[[1, 5], [], [0, 3, 9]]),
    dict(prompt=[9], response=[4], logprobs=[-0.25], mask=[1], temperature=1.0,
         reward=0.0, group=0, agent="solver", sample_id="n", version="0"),
]


def test_pack_supports_worked_example():
    (b,), _ = pack(with_supports(SUPPORTED), budget=16)
    # positions: 0-1 prompt of s, 2-4 response of s (targets 1, 2, 3), 5 prompt of n, 6 response of n.
    assert b.input_ids.tolist() == [7, 8, 1, 2, 3, 9, 4]
    assert b.has_support.tolist() == [False, False, True, False, True, False, False]  # s's mask-1 tokens only
    assert b.sampling_logprobs.tolist() == [0.0, 0.0, -0.25, 0.0, -1.0, 0.0, 0.0]
    # support sizes per position [0, 0, 2, 0, 3, 0, 0]
    assert b.support_offsets.tolist() == [0, 0, 0, 2, 2, 5, 5, 5]
    assert b.support_ids.tolist() == [1, 5, 0, 3, 9]
    assert (b.sampling_logprobs.dtype, b.has_support.dtype, b.support_ids.dtype, b.support_offsets.dtype) == (
        torch.float32, torch.bool, torch.int64, torch.int64)
    assert [r.get("sampling_support") for r in unpack(b)] == [[[1, 5], [], [0, 3, 9]], [[]]]


def test_a_micro_batch_without_a_supported_row_has_none():
    # budget 5: s (5 tokens) and n (2) go to two micro-batches; n's has no support at all.
    batches, _ = pack(with_supports(SUPPORTED), budget=5)
    assert [b.sample_ids for b in batches] == [["s"], ["n"]]
    assert batches[0].support_offsets.tolist() == [0, 0, 0, 2, 2, 5] and batches[0].support_ids.tolist() == [1, 5, 0, 3, 9]
    n = batches[1]
    assert (n.sampling_logprobs, n.has_support, n.support_ids, n.support_offsets) == (None, None, None, None)
    (plain,), _ = pack(seqs_of(SUPPORTED), budget=16)  # no support field at all (1.0 data)
    assert plain.has_support is None and plain.support_ids is None


def test_the_masked_first_token_of_a_row_without_prompt_has_no_support():
    rows = [dict(prompt=[], response=[4, 5], logprobs=[-0.5, -0.5], mask=[1, 1], temperature=1.0, reward=1.0,
                 group=0, agent="policy", sample_id="e", version="0", sampling=[-0.1, -0.2], support=[[4], [5, 6]])]
    (b,), _ = pack(with_supports(rows), budget=8)
    assert b.loss_mask.tolist() == [0.0, 1.0]  # nothing predicts the first token
    assert b.has_support.tolist() == [False, True] and b.sampling_logprobs.tolist() == [0.0, pytest.approx(-0.2)]
    assert b.support_offsets.tolist() == [0, 0, 2] and b.support_ids.tolist() == [5, 6]


# -- the support-id budget ----------------------------------------------------------------------


def test_first_fit_decreasing_support_budget_worked_example():
    # Same lengths and token budget as the worked example above (bins [0, 2], [1, 3, 5], [4] by tokens),
    # support ids [40, 10, 30, 0, 20, 10] under a budget of 50. Rooms (tokens, ids), longest first:
    # 0 (5, 40) -> bin0 (3, 10); 1 (4, 10) -> bin1 (4, 40); 2 (3, 30): bin0 lacks ids -> bin1 (1, 10);
    # 3 (3, 0) -> bin0 (0, 10); 4 (2, 20): no token room -> bin2 (6, 30); 5 (1, 10) -> bin1 (0, 0).
    lengths, ids = np.array([5, 4, 3, 3, 2, 1]), np.array([40, 10, 30, 0, 20, 10])
    bins = first_fit_decreasing(lengths, 8, ids, 50)
    assert [b.tolist() for b in bins] == [[0, 3], [1, 2, 5], [4]]
    assert [int(ids[b].sum()) for b in bins] == [40, 50, 20]
    assert [b.tolist() for b in first_fit_decreasing(lengths, 8, ids, None)] == [[0, 2], [1, 3, 5], [4]]


def test_a_sequence_over_the_support_budget_alone_gets_a_micro_batch_of_its_own():
    # 0 has 13 ids over a budget of 12: alone, though 1 (no support) fits its tokens; by tokens one bin.
    assert [b.tolist() for b in first_fit_decreasing(np.array([2, 1]), 16, np.array([13, 0]), 12)] == [[0], [1]]
    assert [b.tolist() for b in first_fit_decreasing(np.array([2, 1]), 16)] == [[0, 1]]
    with pytest.raises(ValueError, match="support budget must be at least 1"):
        first_fit_decreasing(np.array([2, 1]), 16, np.array([13, 0]), 0)


def supported_row(sample_id: str, prompt: list[int], sizes: list[int], mask: list[int] | None = None) -> dict:
    """A row whose response token t was sampled from a support of ``sizes[t]`` ids (the token first)."""
    resp = [10 + t for t in range(len(sizes))]
    support = [[r] + [100 + j for j in range(n - 1)] for r, n in zip(resp, sizes)]
    return dict(prompt=prompt, response=resp, logprobs=[-0.5] * len(sizes), mask=mask or [1] * len(sizes),
                temperature=1.0, reward=1.0, group=0, agent="policy", sample_id=sample_id, version="0",
                sampling=[-0.25] * len(sizes), support=support)


def test_pack_splits_micro_batches_by_the_support_budget():
    rows = [supported_row(s, [1], [3, 3]) for s in "abc"]  # 3 tokens, 6 support ids each
    rows += [supported_row("d", [1], [13]),  # 2 tokens, 13 ids: over the support budget of 12
             dict(prompt=[1], response=[2], logprobs=[-0.5], mask=[1], temperature=1.0, reward=0.0, group=0,
                  agent="policy", sample_id="e", version="0")]  # 2 tokens, no support
    # tokens alone (budget 16): one micro-batch of 13 tokens.
    assert [b.sample_ids for b in pack(with_supports(rows), 16, 10**6)[0]] == [["a", "b", "c", "d", "e"]]
    # ids <= 12 as well, longest first: a, b -> bin0 (12 ids), c -> bin1, d alone -> bin2, e -> bin0 (0 ids).
    batches, eff = pack(with_supports(rows), 16, 12)
    assert [b.sample_ids for b in batches] == [["a", "b", "e"], ["c"], ["d"]]
    assert [len(b.support_ids) for b in batches] == [12, 6, 13]
    assert [b.num_tokens for b in batches] == [8, 3, 2]
    assert eff == pytest.approx(13 / 48)  # tokens / (3 x 16): the definition stays in tokens
    assert batches[0].support_offsets.tolist() == [0, 0, 3, 6, 6, 9, 12, 12, 12]
    back = {r["sample_id"]: r for b in batches for r in unpack(b)}
    assert back["d"]["sampling_support"] == [[10] + list(range(100, 112))]


def test_support_counts_are_the_ids_the_micro_batch_carries():
    # s: sizes [2, 0, 3] under mask [1, 0, 1] -> 5; n: no support -> 0; e: no prompt, so its first
    # token is not trained and its support (1 id) is dropped -> 2 of 3.
    rows = SUPPORTED + [supported_row("e", [], [1, 2])]
    seqs = with_supports(rows)
    assert seqs.support_counts().tolist() == [5, 0, 2]
    # 7 ids fit s and e together exactly (counting e's dropped id too would make 8 and split them).
    (b,), _ = pack(with_supports(rows), 16, 7)
    assert b.sample_ids == ["s", "n", "e"] and len(b.support_ids) == 7
    assert [b.sample_ids for b in pack(with_supports(rows), 16, 6)[0]] == [["s", "n"], ["e"]]


def test_support_free_data_packs_as_by_tokens_alone():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 300, 200)
    by_tokens = [b.tolist() for b in first_fit_decreasing(lengths, 256)]
    zeros = np.zeros(200, np.int64)
    assert [b.tolist() for b in first_fit_decreasing(lengths, 256, zeros, 1)] == by_tokens
    rows = [dict(prompt=[1] * int(n // 2), response=[2] * int(n - n // 2), logprobs=[-0.5] * int(n - n // 2),
                 mask=[1] * int(n - n // 2), temperature=1.0, reward=0.0, group=0, agent="policy",
                 sample_id=str(i), version="0") for i, n in enumerate(lengths)]
    batches, eff = pack(seqs_of(rows), 256, 1)  # 1.0 data: even a support budget of 1 changes nothing
    assert [sorted(int(s) for s in b.sample_ids) for b in batches] == by_tokens
    assert eff == packing_efficiency([int(lengths[b].sum()) for b in by_tokens], 256)


def test_the_default_support_budget_never_binds_up_to_top_k_64():
    # Every response token trained with a support of 64 ids, the default budget 64 x tokens: bins by tokens.
    rng = np.random.default_rng(2)
    rows = [supported_row(str(i), [1] * int(rng.integers(0, 40)), [64] * int(rng.integers(1, 200))) for i in range(60)]
    seqs = with_supports(rows)
    by_tokens = [b.tolist() for b in first_fit_decreasing(seqs.lengths(), 256)]
    assert [sorted(int(s) for s in b.sample_ids) for b in pack(seqs, 256)[0]] == by_tokens
    # Two rows of 1 + 199 and 1 + 55 tokens fill 256: at 64 ids a token 254 x 64 = 16256 <= 64 x 256 = 16384
    # ids, one micro-batch; at 65, 254 x 65 = 16510 ids, two.
    for k, bins in ((64, [["a", "b"]]), (65, [["a"], ["b"]])):
        seqs = with_supports([supported_row("a", [1], [k] * 199), supported_row("b", [1], [k] * 55)])
        assert [b.sample_ids for b in pack(seqs, 256)[0]] == bins


def test_positions_and_temperatures_from_cu_seqlens_worked_example():
    # Sequences of 3, 0 (empty: nothing of it in the stream), 1 and 2 tokens: T = 6.
    cu = torch.tensor([0, 3, 3, 4, 6], dtype=torch.int32)
    assert positions_from_cu_seqlens(cu, 6).tolist() == [0, 1, 2, 0, 0, 1]
    assert positions_from_cu_seqlens(cu, 6).dtype == torch.int64
    temps = torch.tensor([0.7, 0.5, 0.0, 1.0])  # [S]
    assert token_temperatures(temps, cu, 6).tolist() == [np.float32(0.7)] * 3 + [0.0] + [1.0] * 2
    empty = torch.tensor([0], dtype=torch.int32)  # no sequence at all
    assert positions_from_cu_seqlens(empty, 0).tolist() == [] and token_temperatures(temps[:0], empty, 0).numel() == 0


def test_derived_layout_equals_the_per_token_arrays_it_replaces():
    # The [T] arrays pack wrote before, built here as it built them (a concatenation of aranges, and a fill of each
    # sequence's slice with its temperature): the derived ones are equal, element for element and dtype.
    rng = np.random.default_rng(3)
    rows = []
    for i in range(40):
        p, r = int(rng.integers(0, 5)), int(rng.integers(0, 9))
        rows.append(dict(prompt=rng.integers(0, 50, p).tolist(), response=rng.integers(0, 50, r).tolist(),
                         logprobs=[-0.5] * r, mask=[1] * r, reward=float(i % 3), group=i // 4, agent="policy",
                         sample_id=f"s{i}", version="0",
                         temperature=[0.7, float("nan"), 0.0, 1.3][i % 4]))
    batches, _ = pack(seqs_of(rows), budget=16)
    assert len(batches) > 3
    for b in batches:
        cu = b.cu_seqlens.tolist()
        old_positions = torch.from_numpy(np.concatenate([np.arange(e - s, dtype=np.int64) for s, e in
                                                          zip(cu[:-1], cu[1:])]))
        old_temperature = torch.empty(b.num_tokens, dtype=torch.float32)
        for k, t in enumerate(b.temperatures.tolist()):
            old_temperature[cu[k] : cu[k + 1]] = t
        assert torch.equal(positions_from_cu_seqlens(b.cu_seqlens, b.num_tokens), old_positions)
        assert torch.equal(token_temperatures(b.temperatures, b.cu_seqlens, b.num_tokens), old_temperature)
