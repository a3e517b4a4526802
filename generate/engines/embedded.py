"""The embedded engine: a transformers causal LM in this process (CPU or one GPU), batched with a KV cache.

Requests from any number of coroutines go to one background thread that runs the
model. The thread batches continuously: between two decode steps it prefills the
requests that arrived (left-padded), merges their KV cache into the running batch
and drops the rows that finished, so a long generation never holds back new
requests. Positions are tracked per row, so left padding changes no logit. This module
is the scheduler and the requests' life; the running batch is :mod:`.batch`, its KV
cache (preallocated columns a decode step writes in place) :mod:`.kv_cache`, the
sampling :mod:`.sampler`.

Logprobs follow SGLang's definition (:mod:`.base`): log softmax(logits / T) of the
sampled token, from fp32 logits, before top-k/top-p truncation; greedy (T < 1e-6) takes
the argmax and reports log softmax(logits). Top-k and top-p decide the kept tokens
exactly as SGLang's torch sampler does (:mod:`.sampler`).

Sampling support (``SamplingParams.return_sampling_mask``, SGLang's ``return_sampling_mask``): each output
token's kept ids (descending probability) and its logprob under the kept, renormalized distribution, in
``GenerateResult.sampling_support`` / ``sampling_logprobs``; greedy tokens report ``[token]`` and 0.0. A
request asking for it must truncate (top_k >= 1 or top_p < 1) or be greedy: an untruncated row's support
is the vocabulary, refused. Unlike SGLang, a top-p without a top-k is accepted here (the serve API refuses
it, as SGLang does); its supports can be long.

``SamplingParams.ignore_eos`` is SGLang's (``Req._check_token_based_finish`` in 0.5.23): neither an eos
nor a ``stop_token_ids`` id ends the request, a stop string or ``max_new_tokens`` does. Like SGLang it
changes only when a request finishes, not what is sampled: no logit is masked (SGLang masks stop ids
only below ``min_new_tokens``, which is neutral here), so an eos drawn mid-response stays in it with its
logprob, and the logprobs are the trainer's log softmax(logits / T) as without it.

Each request draws its random numbers from its own generator, seeded by
``sampling_seed`` or, when absent, by the engine seed and the request's arrival
order, and the sampler draws in vocabulary order, so a seeded request's tokens do not
depend on what else is in the batch: a lost row is regenerated token for token. The
exception is a draw that lands within float rounding (~1e-7) of a CDF interval or a
top-k/top-p boundary, where the batched forward's rounding can decide: about 1e-7 per
token measured on the tiny models (:mod:`.sampler` gives the figures).

Speed (measured on SmolLM2-135M, fp32, two cores; ``tests/bench/bench_decode.py``). A decode step is about a
thousand operators (211 of them matrix products), and torch's intra-op threads meet at a barrier after each:
where other processes take the cores, each barrier waits for a descheduled thread, and a step at two threads
took 0.13-2.4 s against a steady 0.18-0.27 s at one (batch 32-64, a shared machine). The worker therefore runs
with ``threads`` torch threads, by default :func:`default_threads` (torch's count less one: one on two cores),
set when it starts and restored when it ends. torch has one setting per process (MKL's is global), so the
process's other threads run their torch work at that count meanwhile. Rows decoded together
(``max_batch_size``): 64 by default; one thread's fp32 matrix products of this model ran at 1.3-1.5x the
FLOP/s of batch 32 there (decode reads every weight once a step, whatever the batch). The n samples of one
prompt that arrive together are prefilled once (one row of the forward, its cache and last logits copied to
each), so a GRPO group pays one prompt's prefill; each sample still draws from its own generator. The tokens
every prompt of a prefill starts with (a chat template's system turn: 27 of the 54 tokens of SmolLM2's arithmetic
prompts) run once, as one row whose cache every prompt then attends to, when that saves at least
:data:`MIN_SHARED_TOKENS` prompt tokens (``rollshard-generate eval`` of 32 held-out problems: 1.16x, the same
answers; ``bench_decode.py --parts eval``).

Weight updates (:meth:`EmbeddedEngine.load_weights`) behave like SGLang's
``/update_weights_from_disk``: requests already running finish on the old weights,
new ones wait, and the swap happens when the batch is empty. Versions: a rollshard
checkpoint folder is served as the ``weight_version`` its ``trainer_state.json``
records (at start and on a weight update) unless one is given, so its rows carry the
version the trainer gave it.

Busy share (:meth:`EmbeddedEngine.utilization`, in the server's info answers): the worker adds the time of
each step that has a batch (prefill and decode) to ``busy_seconds``; with the seconds since the model was
loaded, a loop reports how much of the run the engine computed rather than waited.

Aborts (:meth:`EmbeddedEngine.abort`, ``POST /abort_request`` on the server) behave
like SGLang's: once the worker ends its current step, a queued request is answered with
no tokens and a running one with the tokens and logprobs it has; the finish
reasons are SGLang's (``"Abort in waiting queue"``; ``"Aborted"`` with
``status_code``/``err_type`` null). Requests are matched by their exact rid.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import queue
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from rollshard.generate.engines import kv_cache
from rollshard.generate.engines.base import Engine, EngineError, GenerateResult, SamplingParams
from rollshard.generate.engines.batch import Batch
from rollshard.generate.engines.routing import RoutingCapture
from rollshard.generate.engines.sampler import SamplingRows, sample_tokens  # noqa: F401 (sample_tokens: re-exported)
from rollshard.store.format.schema import GREEDY_TEMPERATURE_EPS, WeightSpan
from rollshard.store.models.tokenizer import TokenizerError, decode, eos_token_ids, load_tokenizer
from rollshard.store.models.versions import VersionError, folder_weight_version, resolve_model_path

DEFAULT_MAX_BATCH_SIZE = 64  # rows decoded together (see the module docstring: measured against 32)
MAX_PREFILL_TOKENS = 16384  # padded prompt tokens per prefill forward; bounds the activation memory
# Prompt tokens a shared prefix must save to run apart (one more forward: ~1,000 operators, at batch 1
# milliseconds of Python that ~64 tokens of prefill outweigh on a 135M model).
MIN_SHARED_TOKENS = 64
IDLE_POLL_S = 0.05  # how often an idle worker checks for a pending weight swap or close
# SGLang's finish reasons for an aborted request (tokenizer_manager / schedule_batch.FINISH_ABORT).
ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}
ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_causal_lm(path: str | Path, device: str = "cpu", dtype: str = "float32"):
    """A causal LM from a local folder on ``device`` in ``dtype`` (float32: logprobs the fp32 trainer matches to
    ~1e-6; bfloat16 and float16 trade that for speed on a GPU), in eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise EngineError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **{dtype_kw: DTYPES[dtype]})
    except (OSError, ValueError) as e:
        raise EngineError(f"cannot load a causal LM from {str(path)!r}: {e}") from e
    try:
        return model.to(device).eval()
    except (RuntimeError, AssertionError, ValueError) as e:  # no such device, or torch built without it
        raise EngineError(f"cannot put the model on device {device!r}: {' '.join(str(e).split())}") from e


@dataclasses.dataclass(eq=False)
class Request:
    """One request as the worker holds it: its prompt and sampling, and the tokens, logprobs (and supports, routed
    experts) it has produced so far."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    seed: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    start: float
    stop_ids: frozenset[int]
    max_new_tokens: int
    out_ids: list[int] = dataclasses.field(default_factory=list)
    out_lps: list[float] = dataclasses.field(default_factory=list)
    out_support: list[list[int]] = dataclasses.field(default_factory=list)  # with sampling.return_sampling_mask
    out_sampling_lps: list[float] = dataclasses.field(default_factory=list)
    routed: list[torch.Tensor] = dataclasses.field(default_factory=list)  # with sampling.return_routed_experts
    finish: dict[str, Any] | None = None
    cancelled: bool = False
    abort_requested: bool = False  # set by abort() on the event loop, acted on by the worker
    generator: torch.Generator | None = None
    weight_version: str = "0"


class EmbeddedEngine(Engine):
    """transformers causal LM served in process; see the module docstring."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        seed: int = 0,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        weight_version: str | None = None,
        threads: int | None = None,
    ) -> None:
        """``threads``: torch's intra-op threads while the worker runs (see the module docstring); default
        :func:`default_threads`."""
        if threads is not None and threads < 1:
            raise EngineError(f"threads must be >= 1 (or None for torch's own setting), got {threads}")
        self.threads = default_threads() if threads is None else threads
        self.model_path = resolve_model_path(model_path)
        try:
            self.device = torch.device(device)
        except RuntimeError as e:
            raise EngineError(f"device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from e
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.weight_version = _version_of(model_path, weight_version) or "0"
        try:
            self.tokenizer = load_tokenizer(self.model_path)
        except TokenizerError as e:
            raise EngineError(str(e)) from e
        self.eos_ids = eos_token_ids(self.tokenizer, self.model_path)
        self.model = load_causal_lm(self.model_path, device, dtype)
        self._routing = RoutingCapture(self.model)
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
        self._last_logit_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._full_attention = kv_cache.full_attention_only(self.model.config)
        self._seeds = random.Random(seed)
        self._queue: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._swap: tuple[Any, str, str, threading.Event] | None = None  # (model, path, version, done)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: set[Request] = set()  # submitted and not yet answered, for abort()
        self.num_in_flight = 0  # requests submitted and not yet answered
        self.busy_seconds = 0.0  # the worker's time on a non-empty batch (prefill and decode); written by it only
        self._ready_at = time.monotonic()

    # ---- public API -------------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None, ignore_eos: bool = False
    ) -> GenerateResult:
        """``sampling.ignore_eos`` (SGLang's): no token ends the request (neither the model's eos tokens nor
        ``stop_token_ids``); stop strings and ``max_new_tokens`` still do, and the sampler is unchanged (the eos
        can still be drawn, with its unmasked logprob). The keyword ``ignore_eos=True`` is the same as setting it
        in ``sampling``."""
        if ignore_eos and not sampling.ignore_eos:
            sampling = dataclasses.replace(sampling, ignore_eos=True)
        rid = rid or uuid.uuid4().hex
        if self._closed.is_set():
            raise EngineError(f"request {rid}: the embedded engine is closed")
        if not input_ids:
            raise EngineError(f"request {rid}: empty input_ids")
        if len(input_ids) >= self.context:
            raise EngineError(
                f"request {rid}: prompt of {len(input_ids)} tokens does not fit the model's context of {self.context}"
            )
        if len(input_ids) + sampling.max_new_tokens > self.context:
            # SGLang answers 400 here too, rather than silently shortening the response.
            raise EngineError(
                f"request {rid}: {len(input_ids)} prompt tokens + max_new_tokens {sampling.max_new_tokens} exceed "
                f"the model's context of {self.context}; lower max_new_tokens"
            )
        vocab = self.model.config.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise EngineError(f"request {rid}: input_ids must lie in [0, {vocab})")
        if sampling.max_new_tokens < 0:
            raise EngineError(f"request {rid}: max_new_tokens must be >= 0")
        if sampling.return_sampling_mask and not _truncates_or_greedy(sampling):
            # The support of an untruncated sampled row is the whole vocabulary, per token: refused, as SGLang does.
            raise EngineError(
                f"request {rid}: return_sampling_mask needs top_k >= 1 or top_p < 1 (or temperature 0); "
                f"got top_k {sampling.top_k}, top_p {sampling.top_p}, temperature {sampling.temperature}"
            )
        loop = asyncio.get_running_loop()
        seed = sampling.sampling_seed if sampling.sampling_seed is not None else self._seeds.getrandbits(62)
        try:  # here rather than in the worker, where a failure would fail the whole batch
            generator = torch.Generator().manual_seed(seed)
        except (RuntimeError, ValueError, TypeError, OverflowError) as e:
            raise EngineError(f"request {rid}: sampling_seed {seed!r} is not a 64-bit integer seed: {e}") from e
        req = Request(
            rid=rid,
            input_ids=list(input_ids),
            sampling=sampling,
            seed=seed,
            loop=loop,
            future=loop.create_future(),
            start=time.perf_counter(),
            stop_ids=frozenset() if sampling.ignore_eos else frozenset(self.eos_ids) | set(sampling.stop_token_ids or ()),
            max_new_tokens=sampling.max_new_tokens,
            generator=generator,
        )

        def _mark(fut: asyncio.Future, req: Request = req) -> None:
            req.cancelled = fut.cancelled()

        req.future.add_done_callback(_mark)
        self._ensure_thread()
        self.num_in_flight += 1
        with self._lock:
            self._live.add(req)
        try:
            self._queue.put(req)
            return await req.future
        finally:
            self.num_in_flight -= 1
            with self._lock:
                self._live.discard(req)

    def abort(self, rid: str) -> bool:
        """Abort the request(s) with this rid, queued or running; False when none is in flight.

        The request's ``generate`` returns with finish reason ``abort`` (see the module docstring)."""
        return self._abort(lambda req: req.rid == rid)

    def abort_all(self) -> bool:
        """Abort every request in flight; False when there was none."""
        return self._abort(lambda req: True)

    def _abort(self, match) -> bool:
        with self._lock:
            hits = [req for req in self._live if match(req) and not req.future.done()]
        for req in hits:
            req.abort_requested = True
        return bool(hits)

    async def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "engine": "embedded",
            "max_context_length": self.context,
            "eos_token_ids": list(self.eos_ids),
        }

    @property
    def routing_shape(self):
        """The served model's :class:`~rollshard.store.format.routing.RoutingShape` (None: a dense model, or a MoE whose
        routing is not captured: :attr:`routing_reason` says why)."""
        return self._routing.shape

    @property
    def routing_reason(self) -> str | None:
        return self._routing.reason

    async def routed_experts_width(self, sampling: SamplingParams) -> int | None:
        """Expert ids per position this engine returns for ``return_routed_experts`` (None: it returns none)."""
        return None if self._routing.shape is None else self._routing.shape.width

    def utilization(self) -> dict[str, float]:
        """``busy_seconds`` (the worker's time on a non-empty batch: prefill and decode) and ``uptime_seconds``
        (since the model was loaded): their ratio is the engine's busy share, for a run's summary."""
        return {"busy_seconds": self.busy_seconds, "uptime_seconds": time.monotonic() - self._ready_at}

    async def load_weights(self, path: str | Path, weight_version: str | None = None) -> str:
        """Load a checkpoint from disk; running requests finish on the old weights. Returns the new version:
        ``weight_version``, else the checkpoint's own (a rollshard checkpoint records it), else the current
        one plus 1 when it is a number."""
        weight_version = _version_of(path, weight_version)
        if weight_version is None and not self.weight_version.isdigit():
            # Counting up is only defined for numbers; keeping "v3" would label two policies alike.
            raise EngineError(
                f"checkpoint {str(path)!r} records no weight_version and the served one ({self.weight_version!r}) is "
                "not a number to count up from; pass the new weight_version"
            )
        path = resolve_model_path(path)
        model = await asyncio.to_thread(load_causal_lm, path, str(self.device), self.dtype)
        old, new = self.model.config.vocab_size, model.config.vocab_size
        if old != new:
            raise EngineError(
                f"checkpoint {str(path)!r} has vocab size {new}, the served model {old}; load a checkpoint of the same model"
            )
        if weight_version is None:
            weight_version = str(int(self.weight_version) + 1)
        done = threading.Event()
        with self._lock:
            self._swap = (model, str(path), str(weight_version), done)
        self._ensure_thread()
        await asyncio.to_thread(done.wait)
        return self.weight_version

    async def update_weight_version(self, new_version: str) -> None:
        self.weight_version = str(new_version)

    async def flush_cache(self) -> bool:
        """No prefix cache is kept between requests, so there is nothing to flush."""
        return True

    async def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    # ---- the worker thread ------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rollshard-embedded-engine", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            self._serve()
        finally:
            torch.set_num_threads(previous)

    def _serve(self) -> None:
        batch = Batch()
        waiting: list[Request] = []
        while True:
            if self._closed.is_set():
                for req in batch.rows + waiting + self._drain():
                    self._fail(req, EngineError(f"request {req.rid}: the embedded engine was closed"))
                with self._lock:
                    if self._swap is not None:  # release a load_weights waiter; the swap never happens
                        self._swap[3].set()
                        self._swap = None
                return
            swap_pending = self._swap is not None
            if swap_pending and not batch.rows:
                self._do_swap()
                continue
            if not swap_pending:
                waiting += self._drain(block=not batch.rows and not waiting)
            waiting = self._drop_aborted(waiting)
            room = self.max_batch_size - len(batch.rows)
            admit, waiting = (waiting[:room], waiting[room:]) if not swap_pending else ([], waiting)
            if not admit and not batch.rows:
                continue
            busy_from = time.monotonic()  # once per step, not per token: the figure costs nothing measurable
            try:
                with torch.inference_mode():
                    if admit:
                        batch = self.admit(batch, admit)
                    if batch.rows:
                        batch = self.finish_rows(batch)
                    if batch.rows:
                        self.decode_step(batch)
                        batch = self.finish_rows(batch)
            except Exception as e:  # a failed forward fails its requests, never the worker
                for req in batch.rows + admit:
                    if req.finish is None:
                        self._fail(req, EngineError(f"request {req.rid}: embedded engine error: {e!r}"))
                batch = Batch()
            self.busy_seconds += time.monotonic() - busy_from

    def _drop_aborted(self, waiting: list[Request]) -> list[Request]:
        """Answer the waiting requests that were aborted (with no tokens, as SGLang's waiting queue does)."""
        keep = []
        for req in waiting:
            if req.abort_requested:
                req.finish = dict(ABORT_WAITING)
                self._answer(req)
            else:
                keep.append(req)
        return keep

    def _drain(self, block: bool = False) -> list[Request]:
        out: list[Request] = []
        if block:
            try:
                out.append(self._queue.get(timeout=IDLE_POLL_S))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return [r for r in out if not r.cancelled]

    def _do_swap(self) -> None:
        with self._lock:
            model, path, version, done = self._swap
            self._swap = None
        self._routing.remove()
        self.model = model
        self._routing = RoutingCapture(model)
        self.model_path = path
        self.weight_version = version
        done.set()

    # -- the worker's steps: admit, decode_step, finish_rows (tests/bench/bench_decode.py runs them in its own
    # thread to profile one batch) ------------------------------------------------------------------------------

    def admit(self, batch: Batch, new: list[Request]) -> Batch:
        """Prefill ``new`` (in chunks of MAX_PREFILL_TOKENS), sample each first token, merge into ``batch``."""
        for req in new:
            req.weight_version = self.weight_version
            if req.max_new_tokens == 0:
                req.finish = {"type": "length", "length": 0}
                self._answer(req)
        chunks: list[list[Request]] = [[]]
        for req in sorted((r for r in new if r.finish is None), key=lambda r: len(r.input_ids)):
            longest = max([len(r.input_ids) for r in chunks[-1]] + [len(req.input_ids)])
            if chunks[-1] and longest * (len(chunks[-1]) + 1) > MAX_PREFILL_TOKENS:
                chunks.append([])
            chunks[-1].append(req)
        for chunk in chunks:
            if chunk:
                batch = batch.merge(self._prefill(chunk), _columns_wanted(batch.rows + chunk))
        return batch

    def _prefill(self, rows: list[Request]) -> Batch:
        """One left-padded forward over ``rows``' distinct prompts (n samples of one prompt are prefilled once, their
        cache copied); their cache, sampling state and first tokens."""
        distinct: dict[tuple[int, ...], int] = {}
        of_row = [distinct.setdefault(tuple(r.input_ids), len(distinct)) for r in rows]  # [n] -> distinct prompt
        prompts = [list(p) for p in distinct]
        routing = self._routing.shape is not None and any(r.sampling.return_routed_experts for r in rows)
        self._routing.on = routing
        # A prefix every prompt starts with (a chat template's system turn) runs once; not with routing capture,
        # whose ids are taken per forward, nor with sliding-window layers, whose masks are built per forward.
        shared = shared_prefix(prompts) if self._full_attention and not routing else 0
        out, valid = self._prompt_forward(prompts, shared)  # valid: [u, L] the cache columns holding a prompt token
        length = valid.shape[1]
        layers = kv_cache.cache_tensors(kv_cache.out_cache(out))
        logits = out.logits[:, -1, :]  # [u, V]
        if routing:  # each row's prompt positions (its left padding dropped)
            shape = self._routing.shape
            ids = self._routing.take().view(len(prompts), length, shape.layers, shape.top_k)  # [u, L, layers, top_k]
            for req, d in zip(rows, of_row):
                if req.sampling.return_routed_experts:  # a copy: a view would keep the whole forward's ids alive
                    req.routed.append(ids[d, length - len(req.input_ids) :].clone())
        if len(prompts) < len(rows):
            index = torch.tensor(of_row, device=self.device)  # [n]
            layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in layers]
            valid, logits = valid.index_select(0, index), logits.index_select(0, index)  # [n, L], [n, V]
        kv = kv_cache.from_prefill(layers, valid, layers[0][0].dtype, _columns_wanted(rows))
        sampling = SamplingRows.of(
            [r.sampling for r in rows], [r.generator for r in rows], logits.shape[-1], self.device
        )
        first = sampling.sample_first(logits)
        self.record(rows, *first)
        next_pos = torch.tensor([len(r.input_ids) for r in rows], device=self.device)  # [n]
        return Batch(list(rows), kv, sampling, next_pos, first[0])

    def _prompt_forward(self, prompts: list[list[int]], shared: int) -> tuple[Any, torch.Tensor]:
        """The prefill forward of ``prompts``, left-padded, and ``valid`` ``[u, L]`` (the columns of its cache that
        hold a prompt token). With ``shared`` > 0 their first ``shared`` tokens, the same in every prompt, run once
        as one row, its cache repeated for every prompt, and the rest of each prompt after it: the cache's columns
        are then the shared tokens, each prompt's padding, its own tokens."""
        pad = self.tokenizer.pad_token_id or 0
        tails = [p[shared:] for p in prompts]
        width = max(len(t) for t in tails)
        ids = torch.tensor([[pad] * (width - len(t)) + t for t in tails], device=self.device)  # [u, W]
        valid = torch.tensor([[False] * (width - len(t)) + [True] * len(t) for t in tails], device=self.device)
        cache = kv_cache.prefill_cache()
        if shared:
            head = torch.tensor([prompts[0][:shared]], device=self.device)  # [1, shared]
            out = self.model(input_ids=head, use_cache=True, **{self._cache_kw: cache}, **self._last_logit_kw)
            cache = kv_cache.repeated(kv_cache.out_cache(out), len(prompts))
            valid = torch.cat([valid.new_ones(len(prompts), shared), valid], dim=1)  # [u, shared + W]
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, shared:]  # [u, W] each token's position in its prompt
        out = self.model(
            input_ids=ids,
            attention_mask=valid.long(),
            position_ids=pos,
            use_cache=True,
            **{self._cache_kw: cache},
            **self._last_logit_kw,
        )
        return out, valid

    def decode_step(self, batch: Batch) -> None:
        """One token for every row of ``batch``: a forward over the column cache, written in place."""
        batch.kv = kv = kv_cache.reserve(batch.kv, 1)
        mask = kv.mask[..., : kv.n + 1]  # [B, 1, 1, n + 1] prepared: transformers builds none
        if not self._full_attention:  # sliding-window layers: transformers builds their masks from the 2-D one
            mask = (mask[:, 0, 0] == 0).long()  # [B, n + 1]
        asked = [r.sampling.return_routed_experts for r in batch.rows]
        routing = self._routing.shape is not None and any(asked)
        self._routing.on = routing
        out = self.model(
            input_ids=batch.last[:, None],  # [B, 1]
            attention_mask=mask,
            position_ids=batch.pos[:, None],  # [B, 1]
            use_cache=True,
            **{self._cache_kw: kv_cache.column_cache(kv)},
        )
        batch.pos = batch.pos + 1
        if routing:  # the position of each row's fed token
            ids = self._routing.take()  # [B, layers, top_k]
            for i, req in enumerate(batch.rows):
                if asked[i]:
                    req.routed.append(ids[i : i + 1].clone())
        step = batch.sampling.sample(out.logits[:, -1, :])
        self.record(batch.rows, *step)
        batch.last = step[0]

    def record(self, rows: list[Request], tokens: torch.Tensor, logprobs: torch.Tensor, supports) -> None:
        """Append each row's token and logprob (and support, when it asked), and apply its stop rules."""
        supports = supports or [None] * len(rows)
        for req, tok, lp, support in zip(rows, tokens.tolist(), logprobs.tolist(), supports):
            req.out_ids.append(tok)
            req.out_lps.append(lp)
            if support is not None:
                req.out_support.append(support[0])
                req.out_sampling_lps.append(support[1])
            self._check_stop(req, tok)

    def _check_stop(self, req: Request, tok: int) -> None:
        if tok in req.stop_ids:
            req.finish = {"type": "stop", "matched": tok}
            return
        for stop in req.sampling.stop or ():
            # A stop string of n characters spans at most 4n byte-level tokens plus one partial token.
            tail = self.tokenizer.decode(req.out_ids[-(4 * len(stop) + 2) :], skip_special_tokens=False)
            if stop and stop in tail:
                req.finish = {"type": "stop", "matched": stop}
                return
        if len(req.out_ids) >= req.max_new_tokens:
            req.finish = {"type": "length", "length": len(req.out_ids)}

    def finish_rows(self, batch: Batch) -> Batch:
        """``batch`` without its rows that finished (answered), were aborted (answered) or were cancelled."""
        keep = []
        for i, req in enumerate(batch.rows):
            if req.abort_requested and req.finish is None:
                req.finish = dict(ABORT_RUNNING)
            if req.finish is not None:
                self._answer(req)
            elif not req.cancelled:
                keep.append(i)
        return batch.select(keep)

    # ---- answers ----------------------------------------------------------------------------

    def _answer(self, req: Request) -> None:
        _deliver(req, _set_result, self._result(req))

    def _fail(self, req: Request, err: Exception) -> None:
        _deliver(req, _set_exception, err)

    def _result(self, req: Request) -> GenerateResult:
        sp, finish = req.sampling, dict(req.finish or {})
        ids = req.out_ids
        trim_ids = (
            ids[:-1]
            if finish.get("type") == "stop" and isinstance(finish.get("matched"), int) and not sp.no_stop_trim
            else ids
        )
        text = decode(self.tokenizer, trim_ids, skip_special_tokens=sp.skip_special_tokens)
        matched = finish.get("matched")
        if isinstance(matched, str) and not sp.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        n = len(ids)
        asked = sp.return_sampling_mask
        return GenerateResult(
            output_ids=list(ids),
            logprobs=list(req.out_lps),
            text=text,
            finish_reason=finish.get("type", "abort"),
            finish_detail={k: v for k, v in finish.items() if k != "type"},
            weight_version=req.weight_version,
            weight_versions=[WeightSpan(version=req.weight_version, start=0, end=n)],
            prompt_tokens=len(req.input_ids),
            completion_tokens=n,
            meta={"id": req.rid, "cached_tokens": 0, "e2e_latency": time.perf_counter() - req.start},
            sampling_logprobs=list(req.out_sampling_lps) if asked else None,
            sampling_support=[list(x) for x in req.out_support] if asked else None,
            # Prompt positions from the prefill, one more per decode step: len(input) + n - 1 (none when the
            # request was answered before any forward).
            routed_experts=torch.cat(req.routed).numpy() if req.routed else None,
        )


def default_threads() -> int:
    """torch's own thread count (the physical cores) less one, at least 1: the event loop, the tokenizer and the
    writer of the engine's own process need a core (see the module docstring)."""
    return max(1, torch.get_num_threads() - 1)


def shared_prefix(prompts: list[list[int]]) -> int:
    """The tokens every prompt starts with, when running them once pays (0 when it does not): at least
    :data:`MIN_SHARED_TOKENS` prompt tokens saved, and each prompt keeps one token of its own (its last position's
    logits are the first token's)."""
    if len(prompts) < 2:
        return 0
    first, limit = prompts[0], min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n if n * (len(prompts) - 1) >= MIN_SHARED_TOKENS else 0


def _columns_wanted(rows: list[Request]) -> int:
    """Cache columns to reserve beyond the used ones: the most tokens a row may still generate, up to one growth."""
    return min(max((r.max_new_tokens - len(r.out_ids) for r in rows), default=0), kv_cache.GROW_COLUMNS)


def _truncates_or_greedy(sp: SamplingParams) -> bool:
    """Whether a request's sampling support is bounded: greedy (one token), a top-k, or a top-p below 1."""
    return sp.temperature < GREEDY_TEMPERATURE_EPS or sp.top_k >= 1 or sp.top_p < 1.0


def _version_of(path: str | Path, given: str | None) -> str | None:
    """The version to serve ``path`` as: the one given, else the checkpoint folder's own, else None."""
    if given is not None:
        return str(given)
    try:
        return folder_weight_version(path)
    except VersionError as e:
        raise EngineError(str(e)) from e


def _deliver(req: Request, setter, value: Any) -> None:
    try:
        req.loop.call_soon_threadsafe(setter, req.future, value)
    except RuntimeError:  # the caller's event loop is gone: nobody is waiting for this answer
        pass


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, err: Exception) -> None:
    if not fut.done():
        fut.set_exception(err)
