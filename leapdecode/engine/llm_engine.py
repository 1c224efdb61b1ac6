"""The engine loop, one way per step: the speculator's draft limits (plain data) -> the scheduler decides the batch
-> the speculator drafts from a snapshot (``Draft`` values) -> one forward -> verification (a ``Verdict``) or
sampling -> commit, stop, free (output_assembly.py turns tokens into text and outputs)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from leapdecode import huge_pages, parallel, threads
from leapdecode.config import EngineConfig, SpeculativeConfig
from leapdecode.engine import cuda_graphs, gpu_memory
from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.drafting import Draft, Drafting, DraftingFactory, DraftSlot, EngineView, StepSnapshot
from leapdecode.engine.executor import Executor, start_tensor_parallel
from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.kv_calibration import calibrate_int8_keys, calibration_token_lists
from leapdecode.engine.model_runner import ForwardItem, ForwardResult, ModelRunner
from leapdecode.engine.output_assembly import EngineStats, OutputAssembler
from leapdecode.engine.sampling import sample_rows, stack_rows
from leapdecode.engine.scheduler import ScheduledSeq, Scheduler
from leapdecode.engine.sequence import Sequence
from leapdecode.engine.swap import HostKVPool
from leapdecode.engine.worker import AbortRequest, AddRequest, SetSpeculative
from leapdecode.layers import small_gemm
from leapdecode.layers.kv_quant import resolve_kv_dtype
from leapdecode.models import kernel_plan
from leapdecode.models.loader import load_model, resolve_model, resolve_tokenizer
from leapdecode.models.stops import template_end_ids, unique
from leapdecode.models.tokenizer import load_tokenizer
from leapdecode.outputs import PositionLogprobs, RequestOutput
from leapdecode.sampling_params import SamplingParams
from leapdecode.structured import CompiledGrammar, StructuredOutputBackend, make_backend

# the ids of a request's n > 1 sequences: "<request id><SEP><index>" (a separator no client id is expected to use)
SEQ_ID_SEP = "\x1f"


class KVCapacityError(ValueError):
    """A request needs more KV blocks than the whole cache holds: it could never run, even alone, so it is refused
    when added (rather than admitted to be preempted and recomputed forever)."""


class RequestFailedError(RuntimeError):
    """Processing this request raised inside a step: the engine aborted it (its blocks freed) and went on with the
    others. ``__cause__`` is the original error."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"request {request_id!r} failed in an engine step ({type(cause).__name__}: {cause})")
        self.request_id = request_id


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None, model_path=None,
                 drafting: DraftingFactory | None = None) -> None:
        self.config = config
        # speculative decoding's factory (``Speculator``), given by whoever builds the engine (engine/drafting.py)
        self.drafting = drafting
        # tensor parallelism: rank 0 starts the other ranks here (engine/executor.py); each builds this same engine
        self.executor: Executor | None = None
        if config.tensor_parallel_size > 1:
            if model is not None:
                raise ValueError("tensor_parallel_size > 1: every rank loads its own shard, so pass the model by "
                                 "path, not as a loaded module")
            self.executor = start_tensor_parallel(config, functools.partial(type(self), drafting=drafting))
        # a one-rank engine in a process that is also rank 0 of a tensor-parallel group stays out of that group
        self.solo = config.tensor_parallel_size == 1 and parallel.group_size() > 1
        try:
            with self.scope():
                self._setup(config, model, tokenizer, model_path)
        except RuntimeError as e:
            if self.executor is None:
                raise
            err = self.executor.error(e)  # a worker that failed to build its shard: its own error, not gloo's
            self.shutdown()
            raise err from e
        except BaseException:
            self.shutdown()
            raise

    def _setup(self, config: EngineConfig, model, tokenizer, model_path) -> None:
        self.device = torch.device(config.device)
        # the CPUs this process was granted (affinity, cgroup quota), or what the caller asked for
        self.num_threads = threads.configure(config.num_threads)
        # the thread count follows what the machine gives this process, step by step, unless the caller chose one
        self.thread_tuner = None
        if config.num_threads is None and self.num_threads > 1 and self.device.type == "cpu" \
                and parallel.group_size() == 1:  # ranks step in lockstep: each keeps its share of the cores
            self.thread_tuner = threads.ThreadTuner(self.num_threads, small_gemm.MAX_ROWS)
        if model is None:
            self.model_path = resolve_model(config.model)
            keep_blocks = None if config.linear_kernel in ("auto", "packed", "packed-int8act") else False
            model, _ = load_model(self.model_path, config.torch_dtype, self.device, keep_blocks)
            tokenizer = load_tokenizer(resolve_tokenizer(config.tokenizer) if config.tokenizer else self.model_path)
        else:
            self.model_path = model_path
        self.model = model
        self.num_packed_linears = self.pack_linears(model)
        self.model_config = mcfg = model.config
        self.tokenizer = tokenizer
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        # the checkpoint's end-of-sequence/turn ids, the tokenizer's and its chat template's end of turn
        self.eos_token_ids = unique([*mcfg.eos_token_ids, *template_end_ids(tokenizer)])
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, config.torch_dtype)  # int8: quantized KV cache
        num_blocks = self._num_kv_blocks(kv_dtype)
        use_graphs = cuda_graphs.wanted(self.device, config.enforce_eager, config.kv_device_layers,
                                        bool(mcfg.attention_windows()))
        # with CUDA graphs, one more block that no sequence owns takes the padding rows' K/V writes
        pool_blocks = num_blocks + (cuda_graphs.SCRATCH_BLOCKS if use_graphs else 0)
        self.kv_cache = KVCache(mcfg, pool_blocks, config.block_size, kv_dtype, self.device, config.kv_device_layers)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.swap = None
        if config.swap_space_gb > 0:
            per_block = self.kv_cache.nbytes // pool_blocks
            # every rank's scheduler must swap alike: one block count (a rank with fewer KV heads fits more), and
            # each rank its own file (its own KV heads)
            swap_blocks = parallel.min_over_ranks(int(config.swap_space_gb * (1 << 30)) // per_block)
            self.swap = HostKVPool(self.kv_cache, swap_blocks, parallel.rank_path(config.swap_path))
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, swap=self.swap
        )
        self.runner = ModelRunner(model, self.kv_cache, config.block_size, self.device)
        if kv_dtype == torch.int8 and config.kv_calibration:
            calibrate_int8_keys(self.runner, self.kv_cache, self.block_manager,
                                calibration_token_lists(self.tokenizer),
                                min(self.max_model_len, config.max_num_batched_tokens))
        self.graphs: cuda_graphs.StepGraphs | None = None
        if use_graphs:  # after calibration, which must see every step's keys
            self.graphs = cuda_graphs.StepGraphs(model, self.kv_cache, config.block_size, self.device,
                                                 self.max_model_len, config.max_num_seqs, scratch_block=num_blocks)
            self.runner.graph_step = self.graphs.execute
        self.generator = torch.Generator().manual_seed(config.seed)
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its n sequences
        self.failed: dict[str, RequestFailedError] = {}  # requests a step aborted, until take_failed() reads them
        self.failed_forwards = 0  # steps in a row whose forward failed for every sequence in them (health)
        self._structured: StructuredOutputBackend | None = None  # made on the first structured request
        self._structured_lock = threading.Lock()
        self._ids = itertools.count()
        self.stats = EngineStats()
        self.assembler = OutputAssembler(tokenizer, self.eos_token_ids, self.max_model_len, self.stats)
        self.speculator: Drafting | None = None
        if config.speculative_config is not None:
            self._warn_rounding()
            with parallel.replicated():  # drafters are whole on every rank (docs/tensor_parallel.md)
                self.speculator = self._drafting()(self.drafting_view(), config.speculative_config)

    def _warn_rounding(self) -> None:
        """Drafts are verified as extra rows of one pass, and on a CPU only the float32 kernels give a row the same
        bits however many rows the pass carries; a half-precision model there runs torch's matmuls."""
        if self.device.type == "cpu" and self.config.torch_dtype != torch.float32:
            warnings.warn(f"dtype={self.config.dtype!r} on a CPU runs torch's matmuls, whose rounding depends on how "
                          "many rows a step carries: speculative decoding (like batching) can change greedy tokens "
                          "by rounding; dtype='float32' (the CPU default) keeps them identical to plain decoding",
                          stacklevel=3)

    def _num_kv_blocks(self, kv_dtype: torch.dtype) -> int:
        """The KV blocks the scheduler plans over: the configured count, or what the memory affords; the same on
        every tensor-parallel rank (the smallest)."""
        config, mcfg = self.config, self.model_config
        if config.kv_cache_blocks:
            num_blocks = config.kv_cache_blocks
        elif self.device.type == "cuda":  # a share of the whole GPU, after profiling the largest step
            num_blocks = gpu_memory.num_blocks_for_utilization(
                self.model, mcfg, config.block_size, kv_dtype, self.device, config.gpu_memory_utilization,
                config.max_num_seqs, self.max_model_len, config.max_num_batched_tokens, config.kv_device_layers,
            )
        else:  # the ranks of a CPU group share this machine's memory: each takes its part of the fraction
            num_blocks = KVCache.auto_num_blocks(
                mcfg, config.block_size, kv_dtype, self.device, config.max_num_seqs, self.max_model_len,
                config.kv_cache_memory_fraction / parallel.group_size(), config.kv_device_layers,
            )
        return parallel.min_over_ranks(num_blocks)  # every rank's scheduler plans over the same blocks

    def pack_linears(self, model, linear_kernel: str | None = None, quantize_q8: bool = False) -> int:
        """Give ``model`` (the target, or a draft model) the few-row linear kernel where the configuration allows
        it (models/kernel_plan.py): ``linear_kernel`` (default: this engine's setting) picks the format;
        ``quantize_q8`` (a trained drafter's own float layers) quantizes them to Q8_0 with int8 activations
        instead (``kernel_plan.use_int8_drafting``) where this CPU has a fast int8 kernel, float32 panels
        elsewhere. Returns how many layers use it."""
        cfg = self.config
        kernel = linear_kernel or cfg.linear_kernel
        if kernel == "torch" or self.device.type != "cpu" or cfg.torch_dtype != torch.float32:
            if kernel.startswith("packed") and linear_kernel is not None:
                raise ValueError(f"linear_kernel={kernel!r} is for CPU float32 models")
            return 0
        n = kernel_plan.use_int8_drafting(model) if quantize_q8 else 0
        # (0 layers packed for Q8_0: no fast int8 kernel on this CPU, so float32 panels, as draft_precision
        # "float32")
        if not n:
            n = kernel_plan.use_kernels(
                model, required=kernel.startswith("packed"), use_blocks=kernel != "packed-float32",
                int8_activations=kernel == "packed-int8act",
            )
        if n:  # what every step streams, on 2 MB pages (huge_pages.py)
            huge_pages.gather_module(model)
        return n

    # ------------------------------------------------------------------------------------------- requests
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> str:
        """Queue a request. ``grammar``: its structured output already compiled (the server compiles off the
        engine thread and passes it here); without it the grammar is compiled now, on the caller's thread."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            if ids and max(ids) >= vocab:  # (min_tokens masks the stop ids: out of range would fail the step)
                raise ValueError(f"{name} token ids must be in [0, {vocab}), got {max(ids)}")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but the model's context is {self.max_model_len}; "
                "shorten the prompt (at least one token must remain for generation)"
            )
        bm = self.block_manager
        need = self.blocks_for(n, params.max_tokens, params.n)
        if need > bm.num_blocks:
            samples = f" for each of n={params.n} samples" if params.n > 1 else ""
            raise KVCapacityError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}){samples} needs {need} KV blocks but the "
                f"cache has {bm.num_blocks}; raise kv_cache_blocks or lower max_tokens"
                + (" or n" if params.n > 1 else "")
            )
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        so = params.structured_outputs
        if so is not None and grammar is None:
            grammar = self.structured_backend().compile(so)
        seqs: list[Sequence] = []
        for i in range(params.n):
            sid = request_id if params.n == 1 else f"{request_id}{SEQ_ID_SEP}{i}"
            seq = Sequence(sid, prompt_token_ids, params, prompt, self.eos_token_ids, group_id=request_id, index=i)
            if so is not None:
                seq.grammar = self.structured_backend().matcher(so, grammar)
            if i > 0 and self.config.enable_prefix_caching:
                seq.prefix_leader = seqs[0]  # share the prompt's blocks through the prefix cache
            seq.group = seqs
            seqs.append(seq)
        if self.executor is not None:  # only a request rank 0 accepted (a grammar that does not compile raises above)
            # the workers get the compiled grammar, never compiling it inside a step's collectives
            wire = self.structured_backend().to_wire(grammar) if grammar is not None else None
            self.executor.queue(AddRequest(prompt_token_ids, params, request_id, prompt, wire))
        self.requests[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        self.stats.num_prompt_tokens += n
        return request_id

    def blocks_for(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
        """KV blocks a request needs at its longest: ``n`` sequences, sharing the prompt's full blocks when
        prefix caching is on (each writes its own output blocks)."""
        bm = self.block_manager
        per_seq = bm.blocks_needed(min(num_prompt_tokens + max_tokens, self.max_model_len))
        shared = num_prompt_tokens // bm.block_size if self.config.enable_prefix_caching else 0
        return shared + n * (per_seq - shared)

    def max_tokens_fitting(self, num_prompt_tokens: int, n: int = 1) -> int:
        """The largest ``max_tokens`` (at least 1) whose ``n`` sequences fit the whole KV cache (see
        :meth:`blocks_for`), within the context."""
        bm = self.block_manager
        shared = num_prompt_tokens // bm.block_size if self.config.enable_prefix_caching else 0
        per_seq = shared + (bm.num_blocks - shared) // n
        return max(1, min(self.max_model_len, per_seq * bm.block_size) - num_prompt_tokens)

    def structured_backend(self) -> StructuredOutputBackend:
        """The grammar engine, made (tokenizer compiled) on the first request that asks for structured output."""
        if self._structured is None:
            with self._structured_lock:  # the server's worker threads may ask at once (they compile ahead)
                if self._structured is None:
                    self._structured = make_backend(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return self._structured

    def abort_request(self, request_id: str) -> None:
        seqs = self.requests.pop(request_id, [])
        if seqs and self.executor is not None:
            self.executor.queue(AbortRequest(request_id))
        for seq in seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def take_failed(self, request_ids: Iterable[str] | None = None) -> dict[str, RequestFailedError]:
        """The requests steps aborted because processing them raised (request id -> error), not taken before;
        only those of ``request_ids`` when given."""
        if request_ids is None:
            failed, self.failed = self.failed, {}
            return failed
        return {rid: self.failed.pop(rid) for rid in request_ids if rid in self.failed}

    def _fail_request(self, request_id: str, cause: BaseException) -> None:
        """Contain an error to the request it came from: abort it (all its sequences) and record why."""
        if request_id not in self.requests:
            return
        err = RequestFailedError(request_id, cause)
        err.__cause__ = cause
        self.failed[request_id] = err
        self.abort_request(request_id)

    # ----------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that produced tokens or finished. Under tensor
        parallelism the workers step with it; a dead worker raises ``executor.WorkerDiedError``."""
        ex = self.executor
        if ex is None:
            if not self.solo:  # the usual case: nothing around the step
                return self._step()
            with parallel.solo():
                return self._step()
        ex.start_step()
        try:
            outputs = self._step()
        except RuntimeError as e:  # a collective failed: say which rank went and why
            raise ex.error(e) from e
        except BaseException as e:  # the ranks may now be in different collectives: the group cannot go on
            ex.fail(f"rank 0 stopped in the middle of a step ({type(e).__name__}: {e})")
            raise
        ex.finish_step(outputs)
        return outputs

    def set_speculative_config(self, cfg: SpeculativeConfig | dict | None) -> None:
        """Switch speculative decoding (another method or drafter, or None: plain decoding) without reloading the
        target; only between requests. Every tensor-parallel rank switches with rank 0."""
        if self.has_unfinished_requests():
            raise ValueError("set_speculative_config needs an idle engine: finish or abort the running requests")
        cfg = self._drafting().parse(cfg) if cfg is not None else None
        ex = self.executor
        if ex is None:
            with self.scope():
                self._set_speculator(cfg)
            return
        ex.apply_now(SetSpeculative(cfg))
        try:
            self._set_speculator(cfg)
        except BaseException as e:  # the workers may be waiting in a collective rank 0 will not enter
            ex.fail(f"rank 0 could not switch speculative decoding ({type(e).__name__}: {e})")
            raise

    def _set_speculator(self, cfg: SpeculativeConfig | None) -> None:
        if self.speculator is not None:
            self.speculator.close()  # e.g. self_spec stops capturing the target's hidden states
        self.config.speculative_config, self.speculator = cfg, None
        # cached prefixes would hold K/V the old drafters saw only partly (no captured hidden states for them), and
        # the new speculator's timing steps write scratch K/V: start from an empty prefix cache
        self.block_manager.reset_prefix_cache()
        if cfg is not None:
            self._warn_rounding()
            with parallel.replicated():
                self.speculator = self._drafting()(self.drafting_view(), cfg)

    def drafting_view(self) -> EngineView:
        """What speculative decoding may see of this engine (engine/drafting.py)."""
        return EngineView(self.model, self.model_path, self.tokenizer, self.runner, self.kv_cache, self.block_manager,
                          self.config.block_size, self.config.torch_dtype, self.device, self.max_model_len,
                          self.generator, self.num_packed_linears, self.pack_linears)

    def _drafting(self) -> DraftingFactory:
        if self.drafting is None:
            raise ValueError("this engine was built without speculative decoding: build it through LLM(...), or "
                             "pass drafting=Speculator (leapdecode.speculative.speculator)")
        return self.drafting

    def scope(self) -> contextlib.AbstractContextManager:
        """The parallel context this engine runs in: ``parallel.solo()`` for a one-rank engine beside a group."""
        return parallel.solo() if self.solo else contextlib.nullcontext()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the group (nothing to do on one rank). Idempotent."""
        if getattr(self, "executor", None) is not None:
            self.executor.shutdown()

    def _step(self) -> list[RequestOutput]:
        """One step, in one direction: the speculator's limits (plain data) -> the scheduler decides the batch ->
        the speculator drafts from a snapshot of it (values) -> one forward -> verification or sampling -> the
        tokens are committed and reported. An error while processing one request (drafting for it, its forward,
        sampling, its grammar, its log-probabilities, detokenizing) fails that request alone (``take_failed``)."""
        spec, sched_ = self.speculator, self.scheduler
        limits = spec.draft_limits(sched_.decoding(), len(sched_.running)) if spec else None
        sched = sched_.schedule(limits)
        if not sched.scheduled:
            if sched_.has_unfinished() and not sched_.running:
                raise RuntimeError("no request can be scheduled: the KV cache is too small for the oldest request")
            return []
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(sched.preempted)
        drafts: dict[str, Draft] = {}
        if spec:
            for seq in sched.preempted:
                spec.preempt(seq)
            slots = tuple(DraftSlot(s.seq, s.spec_budget) for s in sched.scheduled if s.spec_budget > 0)
            if slots:
                drafts = self._propose(StepSnapshot(slots, len(sched_.running)))
        scheduled = [s for s in sched.scheduled if not s.seq.is_finished]  # (a failed request is aborted)
        items, num_prompt_rows = self._forward_items(scheduled, drafts)
        results = self._execute_contained(scheduled, items)
        touched: dict[str, list[Sequence]] = {}  # requests with news this step, in schedule order
        sample_seqs, sample_logits, sample_res = [], [], []
        for s, res, pr in zip(scheduled, results, num_prompt_rows):
            draft = drafts.get(s.seq.request_id) if drafts else None
            if res is not None and self._alone(s.seq, lambda s=s, res=res, pr=pr, d=draft: self._settle(
                    s, res, pr, d, touched)):
                sample_seqs.append(s.seq)
                sample_logits.append(res.logits[-1])
                sample_res.append(res)
        if sample_seqs:
            self._sample_and_emit(sample_seqs, sample_logits, sample_res, touched)
        # (a request that failed this step was aborted: the caller hears of it through take_failed)
        return [self.make_output(g) for g in touched.values() if all(q.finish_reason != "abort" for q in g)]

    def _forward_items(self, scheduled: list[ScheduledSeq],
                       drafts: dict[str, Draft]) -> tuple[list[ForwardItem], list[int]]:
        """The forward's items (each sequence's new tokens, then its drafts) and how many prompt rows each scores
        for prompt log-probabilities."""
        items: list[ForwardItem] = []
        num_prompt_rows: list[int] = []
        for s in scheduled:
            seq = s.seq
            start, n = seq.num_computed_tokens, s.num_new_tokens
            reaches_end = start + n == seq.num_tokens
            draft = drafts.get(seq.request_id) if drafts and reaches_end else None
            tail = list(draft.tokens) if draft is not None else []
            # a request scoring its prompt also needs the logits of the prompt positions this chunk computes
            pr = max(min(n, seq.num_prompt_tokens - 1 - start), 0) if seq.prompt_logprobs is not None else 0
            num_prompt_rows.append(pr)
            rows = list(range(n - 1, n + len(tail))) if reaches_end else []
            item = ForwardItem(seq.block_table, start, seq.token_ids[start : start + n] + tail,
                               list(range(pr)) + rows if pr else rows)
            if draft is not None:
                self.speculator.shape_item(draft, item, n)  # type: ignore[union-attr]  # trees: depths + mask
            items.append(item)
        return items, num_prompt_rows

    def _alone(self, seq: Sequence, fn: Callable[[], Any]) -> Any:
        """``fn()``, one sequence's share of the step; when it raises, that sequence's request fails alone (None).
        None too when the request already failed (another of its sequences)."""
        if seq.is_finished:
            return None
        try:
            return fn()
        except Exception as e:
            self._fail_request(seq.group_id, e)
            return None

    def _propose(self, snapshot: StepSnapshot) -> dict[str, Draft]:
        """The speculator's drafts; when the batch raises, each sequence is drafted alone and only the requests whose
        own drafting raises fail (drafts are proposals: whatever they are, the output stays lossless)."""
        spec = self.speculator
        assert spec is not None
        try:
            return spec.propose(snapshot)
        except Exception:
            drafts: dict[str, Draft] = {}
            for slot in snapshot.slots:
                one = self._alone(slot.seq, lambda slot=slot: spec.propose(StepSnapshot((slot,), snapshot.num_running)))
                drafts.update(one or {})
            return drafts

    def _execute_contained(self, scheduled: list, items: list[ForwardItem]) -> list[ForwardResult | None]:
        """The step's forward; when the batch raises, each sequence runs alone and those whose own forward raises
        fail (None in their place). A tensor-parallel group cannot rerun part of a step: there the error stops it."""
        try:
            results: list[ForwardResult | None] = list(self._execute(items))
        except Exception:
            if self.executor is not None:
                raise
            results = [self._alone(s.seq, lambda it=it: self._execute([it])[0]) for s, it in zip(scheduled, items)]
        self.failed_forwards = self.failed_forwards + 1 if all(r is None for r in results) else 0
        return results

    def _settle(self, s: ScheduledSeq, res: ForwardResult, pr: int, draft: Draft | None,
                touched: dict[str, list[Sequence]]) -> bool:
        """One scheduled sequence after the forward: prompt log-probabilities, chunked prefill, verification of
        its drafts. True when it still needs a token sampled from its last row."""
        seq, spec = s.seq, self.speculator
        if pr:
            self.assembler.record_prompt_logprobs(seq, seq.num_computed_tokens, res.logits[:pr])
            res = ForwardResult(res.logits[pr:], res.hidden[pr:])
        seq.num_computed_tokens += s.num_new_tokens
        if seq.num_computed_tokens < seq.num_tokens:  # chunked prefill continues next step
            self.block_manager.commit_full_blocks(seq)
            return False
        if seq.params.max_tokens == 0:  # prompt scoring: the prompt's log-probabilities were all it asked
            seq.finish_reason = "length"
            self._finish(seq)
            touched[seq.group_id] = seq.group
            return False
        if draft is None:
            return True
        assert spec is not None
        verdict = spec.verify(seq, draft, res)
        seq.num_computed_tokens += verdict.num_accepted  # the accepted drafts' K/V are already in the cache
        self._commit(seq, verdict.committed, self.assembler.logprobs_of(seq, verdict.drawn, verdict.committed),
                     touched)
        spec.observe(seq, res, draft, verdict)  # drafters reading hidden states (Medusa) get the last emitted row's
        return False

    def _sample_and_emit(self, seqs: list[Sequence], logits: list[torch.Tensor], results: list[ForwardResult],
                         touched: dict[str, list[Sequence]]) -> None:
        """Sample one token per sequence (one batch; each alone when the batch raises, failing the requests whose
        own sampling raises) and append it."""
        try:
            drawn = list(zip(*self.sample(seqs, stack_rows(logits))))
        except Exception:
            drawn = [self._alone(q, lambda q=q, row=row: [x[0] for x in self.sample([q], row.unsqueeze(0))])
                     for q, row in zip(seqs, logits)]
        for seq, one in zip(seqs, drawn):
            if one is not None:
                self._alone(seq, lambda seq=seq, one=one: self._commit(seq, [one[0]], one[1], touched))
        spec = self.speculator
        if spec is not None:  # the drafters see the step's sampled rows (each sequence alone when that raises)
            live = [(q, r) for q, r in zip(seqs, results) if not q.is_finished]
            try:
                spec.observe_sampled([q for q, _ in live], [r for _, r in live])
            except Exception:
                for q, r in live:
                    self._alone(q, lambda q=q, r=r: spec.observe_sampled([q], [r]))

    def sample(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[int], list[list[PositionLogprobs] | None]]:
        """One token per sequence from its last logits row, and its log-probability entry (engine/sampling.py)."""
        return sample_rows(seqs, logits, self.generator, self.assembler.decode_token)

    def _execute(self, items: list[ForwardItem]):
        """The target's forward pass for one step, with the thread count the tuner picks for it."""
        tuner = self.thread_tuner
        rows = sum(len(it.tokens) for it in items)
        if tuner is None:
            if torch.get_num_threads() != self.num_threads:  # another engine in this process may have changed it
                torch.set_num_threads(self.num_threads)
        else:
            n = tuner.threads_for(rows)
        t0 = time.perf_counter()
        results = self.runner.execute(items)
        dt = time.perf_counter() - t0
        if tuner is not None:
            tuner.observe(rows, n, dt)
        if self.speculator is not None:  # the cost model its draft lengths are sized by learns from live steps
            self.speculator.observe_step(rows, dt)
        return results

    def _commit(self, seq: Sequence, new_tokens: list[int], logprobs: list[PositionLogprobs] | None,
                touched: dict[str, list[Sequence]]) -> None:
        """Append a step's tokens to ``seq`` (output_assembly.py: text, stop conditions, log-probabilities), give
        back the slots reserved for rejected drafts and finish it when a stop condition held; ``touched`` collects
        the requests to report this step."""
        self.assembler.append(seq, new_tokens, logprobs)
        # the cache holds num_computed_tokens positions; give back slots reserved for rejected drafts
        self.block_manager.trim(seq, seq.num_computed_tokens)
        self.block_manager.commit_full_blocks(seq)
        if seq.finish_reason:
            self._finish(seq)
        touched[seq.group_id] = seq.group

    def decode(self, token_ids: list[int]) -> str:
        return self.assembler.decode(token_ids)

    def _finish(self, seq: Sequence) -> None:
        seq.metrics.e2e_s = time.perf_counter() - seq.arrival_time
        self.scheduler.finish(seq)
        if all(s.is_finished for s in seq.group):
            self.requests.pop(seq.group_id, None)
        if self.speculator:
            self.speculator.release(seq)
        self.stats.num_draft_tokens += seq.metrics.num_draft_tokens
        self.stats.num_accepted_tokens += seq.metrics.num_accepted_tokens

    def make_output(self, group: list[Sequence]) -> RequestOutput:
        """The request's state: one completion per sequence of ``group`` (its n samples), by index."""
        return self.assembler.make_output(group)
