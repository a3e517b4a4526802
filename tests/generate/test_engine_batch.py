"""The embedded engine's running batch: column KV buffers (merge, select, growth) and the per-row uniform windows."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from rollshard.generate.engines import SamplingParams
from rollshard.generate.engines import kv_cache
from rollshard.generate.engines.embedded import EmbeddedEngine, load_causal_lm
from rollshard.generate.engines.sampler import UNIFORM_WINDOW, SamplingRows

from .gated_engine import GatedEngine, until

TOL = 1e-5  # fp32 batched-with-cache vs unpadded full forward; measured ~1e-6
MIN = torch.finfo(torch.float32).min


def run(coro):
    return asyncio.run(coro)


def _kv(rows: int, n: int, cap: int, valid: list[list[bool]], base: float) -> kv_cache.KV:
    """One layer, one head, head dim 1: key at (row r, column c) = base + 10 r + c on the valid columns."""
    prefill = torch.tensor([[base + 10 * r + c for c in range(n)] for r in range(rows)])[:, None, :, None]
    mask = torch.tensor(valid)
    return kv_cache.from_prefill([(prefill, -prefill)], mask, torch.float32, cap - n)


def test_merge_right_aligns_rows_and_select_cuts_shared_padding():
    a = _kv(2, 3, 5, [[True, True, True], [False, True, True]], base=0.0)  # 3 columns used of 5
    b = _kv(1, 1, 1, [[True]], base=100.0)  # 1 column
    assert a.keys[0][1, 0, :, 0].tolist() == [0.0, 11.0, 12.0, 0.0, 0.0]  # padding slot zeroed
    m = kv_cache.merge(a, b, reserve_columns=1)
    # b's one column lands on a's last used column (2); columns 0-1 of b's row are new left padding.
    assert m.n == 3 and m.capacity == 3 + 2  # keeps a's 2 spare columns (more than the 1 asked)
    assert m.keys[0][:, 0, :3, 0].tolist() == [[0.0, 1.0, 2.0], [0.0, 11.0, 12.0], [0.0, 0.0, 100.0]]
    assert m.values[0][2, 0, 2, 0].item() == -100.0
    assert (m.mask[:, 0, 0, :3] == 0).tolist() == [[True, True, True], [False, True, True], [False, False, True]]
    assert (m.mask[:, 0, 0, 3:] == 0).all()  # unused columns are attended once written
    # Rows 1 and 2 kept: column 0 is padding in both and is cut off, column 1 is not (row 1 holds 11 there).
    s = kv_cache.select(m, torch.tensor([1, 2]))
    assert s.n == 2 and s.keys[0][:, 0, :2, 0].tolist() == [[11.0, 12.0], [0.0, 100.0]]
    assert s.mask[:, 0, 0, :2].tolist() == [[0.0, 0.0], [MIN, 0.0]]
    assert s.keys[0].is_contiguous()


def test_reserve_grows_and_keeps_the_used_columns():
    a = _kv(1, 2, 2, [[False, True]], base=5.0)
    assert kv_cache.reserve(a, 0) is a
    g = kv_cache.reserve(a, 1)
    assert g.n == 2 and g.capacity == 2 + kv_cache.GROW_COLUMNS
    assert g.keys[0][0, 0, :2, 0].tolist() == [0.0, 6.0] and g.mask[0, 0, 0, :3].tolist() == [MIN, 0.0, 0.0]


def test_sampling_rows_draw_each_generator_in_order_whatever_the_window_phase():
    # A row joining a batch 10 steps into its window draws its k-th uniform at its k-th token, as alone.
    def gen(seed):
        return torch.Generator().manual_seed(seed)

    want = torch.rand(1 + 2 * UNIFORM_WINDOW, generator=gen(7), dtype=torch.float64)  # [prefill + decode draws]
    logits = torch.zeros(1, 1000)  # uniform over 1000 tokens: the token is floor(1000 u)
    params = [SamplingParams()]  # temperature 1, no top-k or top-p
    running = SamplingRows.of(params, [gen(1)], 1000, "cpu")
    running.sample_first(logits)
    for _ in range(10):
        running.sample(logits)
    joining = SamplingRows.of(params, [gen(7)], 1000, "cpu")
    first, _, _ = joining.sample_first(logits)
    batch = running.merge(joining)
    tokens = [int(first[0])] + [int(batch.sample(logits.repeat(2, 1))[0][1]) for _ in range(2 * UNIFORM_WINDOW)]
    assert tokens == [int(1000 * u) for u in want.tolist()]
    assert batch.select([1], torch.tensor([1])).generators[0] is batch.generators[1]


def test_a_row_joining_mid_window_and_outgrowing_the_buffers_matches_alone(tiny_qwen3, teacher_forced):
    # 300 tokens: more than GROW_COLUMNS, so the buffers grow while both rows decode; the second request
    # joins at decode step 40 (inside the first uniform window) and crosses two window boundaries.
    new_tokens = kv_cache.GROW_COLUMNS + 44
    reference = load_causal_lm(tiny_qwen3)
    sp = SamplingParams(temperature=0.8, max_new_tokens=new_tokens, sampling_seed=11)
    long_prompt, prompt = list(range(100, 160)), [1, 5, 6, 7]

    async def go():
        async with GatedEngine(tiny_qwen3) as eng:
            alone = await eng.generate(prompt, sp, ignore_eos=True)
            eng.block_at_step(40)
            first = asyncio.ensure_future(
                eng.generate(long_prompt, SamplingParams(max_new_tokens=new_tokens, sampling_seed=3), ignore_eos=True)
            )
            await eng.wait_blocked()
            joined = asyncio.ensure_future(eng.generate(prompt, sp, ignore_eos=True))
            await until(lambda: eng.num_in_flight == 2)
            eng.release.set()
            return alone, await joined, await first, eng.batch_sizes

    alone, joined, first, sizes = run(go())
    assert 2 in sizes  # the two requests decoded together
    assert joined.output_ids == alone.output_ids and len(joined.output_ids) == new_tokens
    for p, res in ((prompt, joined), (long_prompt, first)):
        want = teacher_forced(reference, p, res.output_ids, 0.8 if p is prompt else 1.0)
        assert max(abs(a - b) for a, b in zip(res.logprobs, want)) <= TOL


def test_sliding_window_layers_keep_their_window(tiny_qwen3, tmp_path, teacher_forced):
    # Layer 1 of 2 attends to the last 8 positions only; 40 tokens run far past the window. The prefill's own
    # cache would keep only that layer's window (which failed every request), and the prepared full-attention
    # mask would let it see everything (logprobs 0.14 off the teacher-forced ones).
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sliding"
    shutil.copytree(tiny_qwen3, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None)
    (folder / "config.json").write_text(json.dumps(cfg))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert reference.config.layer_types == ["full_attention", "sliding_attention"]
    prompts = [[1, 5, 6, 7], list(range(100, 130))]

    async def go():
        async with GatedEngine(folder, seed=2) as eng:
            return await asyncio.gather(
                *(eng.generate(p, SamplingParams(max_new_tokens=40), ignore_eos=True) for p in prompts)
            )

    for prompt, res in zip(prompts, run(go())):
        want = teacher_forced(reference, prompt, res.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(res.logprobs, want)) <= TOL


def batched_and_alone(model, requests: list[tuple[list[int], int]]):
    """``requests`` ((prompt, seed) each, 12 new tokens) submitted together and drained by the worker at once, and
    each alone: (the input shape of every prefill forward of the batched run, its results, the lone results)."""
    forwards: list[tuple[int, int]] = []

    class Counting(GatedEngine):
        def _prefill(self, rows):
            forward = self.model.forward

            def counted(*args, **kwargs):
                forwards.append(tuple(kwargs["input_ids"].shape))
                return forward(*args, **kwargs)

            self.model.forward = counted
            try:
                return super()._prefill(rows)
            finally:
                del self.model.forward  # the instance attribute: the class's forward again

    def sp(seed):
        return SamplingParams(max_new_tokens=12, sampling_seed=seed)

    async def together():
        async with Counting(model) as eng:
            eng.block_at_step(1)  # the requests wait in the queue until the worker drains them at once
            first = asyncio.ensure_future(eng.generate([3, 4], SamplingParams(max_new_tokens=2), ignore_eos=True))
            await eng.wait_blocked()
            forwards.clear()
            futs = [asyncio.ensure_future(eng.generate(p, sp(s), ignore_eos=True)) for p, s in requests]
            await until(lambda: eng.num_in_flight == len(requests) + 1)
            eng.release.set()
            await first
            return await asyncio.gather(*futs)

    async def alone():
        async with EmbeddedEngine(model, max_batch_size=1) as eng:
            return [await eng.generate(p, sp(s), ignore_eos=True) for p, s in requests]

    return forwards, run(together()), run(alone())


def assert_as_alone(model, requests, batched, singles, teacher_forced) -> None:
    """Every batched request is the one it was alone: the same seeded tokens, logprobs the teacher-forced ones."""
    reference = load_causal_lm(model)
    for (prompt, _), res, single in zip(requests, batched, singles):
        assert res.output_ids == single.output_ids and len(res.output_ids) == 12
        want = teacher_forced(reference, prompt, res.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(res.logprobs, want)) <= TOL


def test_n_samples_of_one_prompt_are_prefilled_once(tiny_qwen3, teacher_forced):
    # 4 samples of one prompt and 1 of another arrive together: the prefill forward runs 2 rows, and every sample
    # is the one it would be alone (same seeded tokens, logprobs equal to the teacher-forced ones).
    shared, other = [1, 5, 6, 7, 8], list(range(100, 120))
    requests = [(shared, 10 + i) for i in range(4)] + [(other, 20)]
    forwards, batched, singles = batched_and_alone(tiny_qwen3, requests)
    assert [rows for rows, _ in forwards] == [2]
    assert_as_alone(tiny_qwen3, requests, batched, singles, teacher_forced)
    assert len({tuple(r.output_ids) for r in batched[:4]}) == 4  # the samples differ: their own seeds, not a copy


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_gpt2"])  # rotary positions, and learned absolute ones
def test_a_prefix_every_prompt_starts_with_runs_once(model, request, teacher_forced):
    # Four prompts (one of them sampled twice) start with the same 40 tokens, as a chat template's system turn
    # does: the prefill runs those 40 once, as one row, then the four tails (1 to 9 tokens) after them. Every
    # request is the one it would be alone: the same seeded tokens, logprobs equal to the teacher-forced ones.
    tiny = request.getfixturevalue(model)
    head = list(range(200, 240))
    tails = [[5], [6, 7, 8], list(range(300, 309)), [9, 10]]
    requests = [(head + t, 30 + i) for i, t in enumerate(tails)] + [(head + tails[1], 40)]
    forwards, batched, singles = batched_and_alone(tiny, requests)
    assert forwards == [(1, 40), (4, 9)]  # the shared 40 once, then 4 distinct tails padded to the longest
    assert_as_alone(tiny, requests, batched, singles, teacher_forced)
    assert batched[1].output_ids != batched[4].output_ids  # one prompt, two seeds


def test_shared_prefix_runs_apart_only_where_it_saves_tokens():
    from rollshard.generate.engines.embedded import MIN_SHARED_TOKENS, shared_prefix

    head = list(range(MIN_SHARED_TOKENS))
    assert shared_prefix([head + [1], head + [2]]) == MIN_SHARED_TOKENS  # saves 64 x 1 tokens
    assert shared_prefix([head[:-1] + [1], head[:-1] + [2]]) == 0  # 63 saved: one more forward does not pay
    assert shared_prefix([head[:22] + [1]] * 4) == 22  # 3 x 22 = 66 saved; the last token stays each prompt's own
    assert shared_prefix([head + [1]]) == 0  # one prompt: nothing to share
    assert shared_prefix([head, [7] + head]) == 0  # nothing in common


def test_threads_sets_the_workers_torch_threads(tiny_gpt2):
    seen: list[int] = []

    class Recording(GatedEngine):
        def decode_step(self, batch) -> None:
            seen.append(torch.get_num_threads())
            super().decode_step(batch)

    async def go():
        async with Recording(tiny_gpt2, threads=1) as eng:
            await eng.generate([1, 2, 3], SamplingParams(max_new_tokens=3), ignore_eos=True)

    def fresh_thread_count() -> int:  # what a new thread starts with: the process's setting
        out = []
        t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
        t.start()
        t.join()
        return out[0]

    before = fresh_thread_count()
    run(go())
    assert seen and set(seen) == {1}
    assert fresh_thread_count() == before  # restored when the worker ended
