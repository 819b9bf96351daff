"""The engine: backends chosen, model loaded, and the step loop over token ids.

One step (docs/architecture.md, "The step loop"): the scheduler picks this step's chunks
(decodes, prefill chunks, whole embedding prompts) -> the runner stages them, builds the
attention metadata once, runs the forward, and samples (or pools) -> the engine appends tokens,
commits full blocks to the prefix cache and finishes requests. Speculative verification, KV
connector loads/saves and tensor parallelism enter at those points, nowhere else: a KV
connector's report is read at the start of a step (and right after a step with in-step loads),
its metadata built once after scheduling.

Async scheduling (`engine.async_scheduling`, vLLM's --async-scheduling) pipelines decode steps:
schedule N+1 -> launch N+1 -> finish N. The host schedules and stages step N+1 while the device
runs step N; step N's sampled tokens stay on the device and feed step N+1's inputs there; the
host reads them back (stops, per-request update) after N+1 is queued. `_pipelines` says which
steps qualify; any other step first drains the pipeline (finishes the launched step), then runs
as above. A stop is seen a step late: a request that stopped at N was already launched at N+1,
whose token is dropped.
"""

from __future__ import annotations

import dataclasses
import numbers
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from jackfield.config import ConfigError, JackfieldConfig
from jackfield.contracts.attention import AttentionBackends, AttentionLayerSpec
from jackfield.contracts.drafter import (
    Drafter,
    DrafterOptions,
    ModelDrafter,
    TokenDrafter,
    combined_lookahead,
)
from jackfield.contracts.kv_connector import (
    KVConnectorContext,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVCoverageSpec,
)
from jackfield.contracts.sampler import Sampler, SamplingParams
from jackfield.distributed.cp_common import init_parallel
from jackfield.engine.block_manager import BlockManager, max_request_blocks
from jackfield.engine.cpu_threads import ROUNDS
from jackfield.engine.model_runner import LaunchedStep, ModelRunner
from jackfield.engine.scheduler import ScheduledChunk, Scheduler
from jackfield.engine.sequence import Sequence, Status
from jackfield.engine.tokenizer import load_tokenizer
from jackfield.gguf_files import checkpoint_dir
from jackfield.models import load_model
from jackfield.models.default_model import default_model_dir
from jackfield.models.embedding import pooling_of
from jackfield.plugins import get_registry
from jackfield.preflight import preflight
from jackfield.requirements import read_config_json, resolve_device, resolve_dtype
from jackfield.sampling.processors import check_named_tokens
from jackfield.selection import BackendChoice
from jackfield.specs import resolve_factory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Engine:
    def __init__(self, config: JackfieldConfig, say: Callable[[str], None]) -> None:
        # Under torchrun: join the ranks first (a GPU rank takes its own device before anything
        # touches one). Every rank then runs this same engine on the same requests: the
        # scheduler's decisions depend on nothing a rank holds alone (docs/architecture.md).
        self.parallel = init_parallel(config.parallel, resolve_device(config).split(":")[0])
        checked = preflight(config)  # everything `jackfield doctor` checks, before any loading
        if checked.problems:
            raise ConfigError(checked.problems)
        assert checked.attention is not None and checked.block_size is not None  # selection succeeded
        # From here on the block size is a number: the config's, or the chosen backends' pick.
        engine_config = dataclasses.replace(config.engine, block_size=checked.block_size)
        config = dataclasses.replace(config, engine=engine_config)
        self.config = config
        sampler = _sampler(config)  # a config naming a missing sampler fails before any loading
        self.drafter, runs_mtp_layers = _drafter(config)
        self.device = torch.device(resolve_device(config))
        if self.parallel.tp_size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", self.parallel.local_rank)
        if config.model.path is None:
            say("creating the embedded default model")
        # A GGUF file was converted (and cached) by preflight; this finds that folder.
        self.model_dir = checkpoint_dir(config.model.path) if config.model.path else default_model_dir()
        config_json = read_config_json(self.model_dir)  # read once: requirements, eos, pooling
        self.backend_choices: dict[str, BackendChoice] = checked.attention
        backends = AttentionBackends(prefill=self.backend_choices["prefill"].backend,
                                     decode=self.backend_choices["decode"].backend)
        say(f"loading {self.model_dir}")
        dtype = resolve_dtype(config, self.device.type)
        self.model = load_model(self.model_dir, backends, dtype, self.device, config.attention.kv_cache_dtype)
        if runs_mtp_layers:  # preflight checked the checkpoint has them
            self.model.load_mtp_layers(self.model_dir)
        if self.model.recurrent_state_layers and (config.kv_connector.name
                                                  or isinstance(self.drafter, ModelDrafter)
                                                  or config.attention.kv_cache_dtype == "fp8_e4m3"):
            # preflight names the built-in hybrid families; this covers any family with recurrent layers
            raise ConfigError([f"{type(self.model).__name__} has recurrent layers: KV connectors, fp8 KV "
                               "caches and model drafters (MTP, EAGLE-3) are not run beside them yet"])
        self.capabilities = self.model.capabilities
        if self.parallel.tp_size > 1 and not self.capabilities.tensor_parallel:
            raise ConfigError([f"{type(self.model).__name__} does not split itself over tensor-parallel "
                               "ranks: run it with parallel.tensor_parallel_size = 1"])
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = _eos_ids(config_json, self.tokenizer)
        self.pooling = pooling_of(config_json)
        engine = config.engine
        # preflight checked config.json's max_position_embeddings; a family may declare a lower limit.
        if engine.max_model_len is not None and engine.max_model_len > self.capabilities.max_model_len:
            raise ConfigError([f"engine.max_model_len {engine.max_model_len} exceeds the model's "
                               f"max_model_len {self.capabilities.max_model_len}"])
        self.max_model_len = engine.max_model_len or self.capabilities.max_model_len
        model_drafter = self.drafter if isinstance(self.drafter, ModelDrafter) else None
        drafter_kv_layers: list[AttentionLayerSpec] = []
        if model_drafter is not None:  # its own layers, if any (a draft checkpoint's)
            try:
                drafter_kv_layers = model_drafter.load(self.model, backends, config.attention.kv_cache_dtype,
                                                       len(self.model.kv_cache_layers))
            except (ValueError, FileNotFoundError) as exc:
                raise ConfigError([f"speculative.method {config.speculative.method!r}: {exc}"]) from None
        self.kv_scales = checked.kv_scales
        self.runner = ModelRunner(self.model, backends, sampler, engine, self.max_model_len, self.device, say,
                                  model_drafter, self.capabilities.num_mtp_layers if runs_mtp_layers else 0,
                                  self.kv_scales, tuple(drafter_kv_layers),
                                  self.drafter.num_speculative_tokens if self.drafter else 0)
        kv = self.runner.kv
        # A bidirectional model's KV depends on later tokens: no prefix of it can be reused. Nor can a
        # recurrent layer's state, which is kept per request, not per block.
        recurrent = self.model.recurrent_state_layers
        prefix_caching = engine.enable_prefix_caching and self.capabilities.causal and not recurrent
        if recurrent and engine.enable_prefix_caching:
            say(f"prefix caching is off: {type(self.model).__name__} has recurrent layers, whose state is "
                "kept per request, not at block boundaries")
        # A block id covers block_size tokens on each DCP rank: dcp_size * block_size of a request.
        self.tokens_per_block = engine.block_size * self.parallel.dcp_size
        self.block_manager = BlockManager(kv.num_blocks, self.tokens_per_block, prefix_caching,
                                          kv.groups.windows,
                                          engine.prefix_hash_seed,
                                          drop_last_hit_block=model_drafter is not None,
                                          num_state_slots=engine.max_num_seqs if recurrent else 0,
                                          table_rows=self.runner.block_tables)
        drafters = [self.drafter] if self.drafter else []
        connector = _kv_connector(config, self.runner, drafters)
        if connector is not None:
            self.runner.connector = connector[1]
        self.scheduler = Scheduler(self.block_manager, engine.max_num_seqs, engine.max_num_batched_tokens,
                                   connector[0] if connector else None, combined_lookahead(drafters),
                                   self.max_model_len)
        self._seeds = random.Random(config.sampler.seed)
        self._next_id = 0
        # nothing to overlap on the CPU: the host computes the step itself
        self.async_scheduling = (engine.async_scheduling if engine.async_scheduling is not None
                                 else self.device.type == "cuda")
        self._launched: LaunchedStep | None = None  # a pipelined step, its tokens not read back yet
        threads = self.runner.cpu_threads
        measure = threads is not None and threads.needs_measuring and self.capabilities.causal
        if (self.device.type == "cuda" or measure) and self.capabilities.causal:
            say("warming up" + (", timing decode steps at each CPU thread count" if measure else ""))
            self._warm_up(measure)
        # Calibrated fp8 scales come from the first request's prefill, not the warm-up's zeros.
        self.runner.calibrate_at_next_step = self.kv_scales is not None and self.kv_scales.layers is None

    def kv_cache_summary(self) -> dict[str, object]:
        """The KV cache's dtype and, for fp8, where its scales come from and their values, one
        list per fp8 cache in layer order ([record] MLA, [key, value] MHA; None until the first
        prefill calibrated them). One host sync."""
        summary: dict[str, object] = {"dtype": str(self.runner.kv_caches[0].dtype).removeprefix("torch.")}
        if self.kv_scales is None:
            return summary
        scales = [scale.tolist() for scale in self.runner.kv_scales if scale is not None]
        return {**summary, "scale_source": self.kv_scales.source, "scale_detail": self.kv_scales.detail,
                "scales": None if self.runner.calibrate_at_next_step else scales}

    def kv_connector_stats(self) -> dict[str, object] | None:
        """The KV connector's name and counters (None: no connector)."""
        if self.scheduler.connector is None:
            return None
        return {"name": self.config.kv_connector.name, **self.scheduler.connector.stats()}

    def _warm_up(self, measure_threads: bool = False) -> None:
        """Short sampled requests through prefill and decode, so kernel compiles (Triton) and
        library plan builds happen at start-up, not in the first request's time to first token.
        `measure_threads`: their decode steps are also timed at each CPU thread count, in rounds
        (one untimed, then cpu_threads.ROUNDS timed), and the fastest count is kept for every
        later step (engine/cpu_threads.py). They leave nothing behind: no request fills a block
        (so the prefix cache keeps nothing), their blocks are freed and request ids start at 0 again."""
        threads = self.runner.cpu_threads
        counts: list[int | None] = [None]  # per decode step: its thread count (None: as configured)
        if measure_threads:
            assert threads is not None
            counts = [c for _ in range(1 + ROUNDS) for c in threads.candidates]
        first_timed = len(counts) // (1 + ROUNDS)  # the first round is not timed (one-time set-up)
        block = min(self.config.engine.block_size, self.max_model_len)
        done = 0
        while 0 < (steps := min(len(counts) - done, block - 2)):  # >= 1 prompt token, the block unfilled
            params = SamplingParams(temperature=1.0, seed=0, max_tokens=1 + steps, ignore_eos=True)
            seq = self.add_request([0] * (block - 1 - steps), params)
            while self.scheduler.has_work():
                # the prompt's steps come first; with async scheduling one step more reads the
                # last token back, untimed
                decode = bool(seq.output_ids) and done < len(counts)
                count = counts[done] if decode else None
                if count is not None:
                    assert threads is not None
                    threads.threads = count
                start = time.perf_counter()
                self.step()
                if count is not None and done >= first_timed:
                    threads.record(count, time.perf_counter() - start)  # type: ignore[union-attr]
                done += decode
        if measure_threads:
            assert threads is not None
            threads.choose()
        self._next_id = 0

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, seq: Sequence) -> None:
        """Finish `seq` as aborted and free its blocks (a no-op once it finished). A token it has
        in flight is dropped when its step is read back; the blocks that step still writes are
        reused only by steps queued after it."""
        self.scheduler.abort(seq)
        self._settle()

    def add_request(self, token_ids: list[int], params: SamplingParams,
                    pooling: str | None = None) -> Sequence:
        """Queue a request (pooling: an embedding request, run whole in one step)."""
        return self.add_requests([(token_ids, params)], pooling)[0]

    def add_requests(self, requests: list[tuple[list[int], SamplingParams]],
                     pooling: str | None = None) -> list[Sequence]:
        """Queue requests all or none: every one is checked before any is queued."""
        for token_ids, params in requests:
            self.check_request(token_ids, params, pooling)
        seqs = []
        for token_ids, params in requests:
            seed = params.seed if params.seed is not None else self._seeds.randrange(2**63)
            seq = Sequence(self._next_id, len(token_ids), list(token_ids), params, seed, pooling=pooling)
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None] * len(token_ids)
            self._next_id += 1
            self.scheduler.add(seq)
            seqs.append(seq)
        return seqs

    def check_request(self, token_ids: list[int], params: SamplingParams, pooling: str | None = None) -> None:
        """Every reason a request cannot run, raised before it touches the engine's state."""
        vocab, engine = self.capabilities.vocab_size, self.config.engine
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"one request is one sample, got n={params.n}: submit "
                             "SamplingParams.per_sample() (LLM.generate and the server do)")
        if not token_ids:
            raise ValueError("empty prompt")
        not_ints = [t for t in token_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if not_ints:
            raise ValueError(f"prompt token ids must be integers, got {not_ints[:8]!r}")
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens leaves no room under max_model_len "
                             f"{self.max_model_len}")
        if pooling is None and not self.capabilities.causal:
            raise ValueError(f"{self.model_dir} is a bidirectional (is_causal=false) model: use LLM.embed, "
                             "not generate")
        if pooling is not None and len(token_ids) > engine.max_num_batched_tokens:
            raise ValueError(f"a prompt of {len(token_ids)} tokens exceeds engine.max_num_batched_tokens "
                             f"({engine.max_num_batched_tokens}): embedding runs each prompt whole in one "
                             "step")
        total = min(len(token_ids) + params.max_tokens, self.max_model_len)
        needed = max_request_blocks(self.runner.kv.groups.windows, self.tokens_per_block, total,
                                    engine.max_num_batched_tokens)
        if needed > self.block_manager.num_usable:
            raise ValueError(f"a request of {len(token_ids)} + {params.max_tokens} tokens needs {needed} "
                             f"KV blocks; the cache has {self.block_manager.num_usable} "
                             "(raise the KV budget)")
        check_named_tokens(params, vocab)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer, and {self.model_dir} has none: "
                             "use stop_token_ids")

    def step(self) -> list[Sequence]:
        """One engine step; returns the requests it finished (under async scheduling, those the
        previous step finished)."""
        connector = self.scheduler.connector
        if connector is not None:
            self.scheduler.update_from_connector(self.runner.connector_finished())
        chunks = self.scheduler.schedule()
        launched = self._launched
        if chunks and self._pipelines(chunks):
            # a launch that raises leaves the previous step the one to read back (or drop)
            self._launched = self.runner.launch(chunks, launched)
            for chunk in chunks:  # their KV is being written; their tokens come back next step
                chunk.seq.num_computed += 1
                chunk.seq.num_in_flight += 1
            finished = self._finish_launched(launched) if launched is not None else []
            self._settle()
            return finished
        # Drain: this step is built from the host's tokens. Requests that stopped at the drained
        # step were scheduled again (their blocks are freed now): their chunks go. They are
        # returned with those this step finishes.
        self._launched = None
        finished = self._finish_launched(launched) if launched is not None else []
        chunks = [c for c in chunks if c.seq.status == Status.RUNNING]
        metadata = (connector.build_connector_meta(self.scheduler.scheduled_requests(chunks))
                    if connector is not None else None)
        if not chunks:
            if launched is not None:  # the scheduled requests waited for their last tokens
                return finished
            if metadata is None or not (self.scheduler.loading or self.scheduler.held):
                raise RuntimeError("scheduler made no progress (a request cannot fit the KV cache)")
            self.runner.transfer(metadata)  # only loads in flight: they finish in a later step
            return []
        result = self.runner.step(chunks, metadata)
        # An in-step load's failure is known once its step ran: that request's output is dropped.
        dropped = (self.scheduler.update_from_connector(self.runner.connector_finished())
                   if self.scheduler.loaded_in_step else set())
        now = time.perf_counter()
        for seq, first, entries in result.prompt_logprobs:  # by position: a recomputed prefill rewrites
            assert seq.prompt_logprobs is not None
            seq.prompt_logprobs[first + 1 : first + 1 + len(entries)] = entries
        sampled = iter(zip(result.token_ids, result.logprobs, strict=True))
        drafted = iter(result.drafts) if result.drafts is not None else None
        pooled = iter(result.embeddings)
        for chunk in chunks:
            seq = chunk.seq
            seq.draft_ids, seq.draft_probs = [], None
            if seq.request_id in dropped:  # it read blocks whose load failed: it computes again
                if chunk.samples:
                    next(sampled)
                    if drafted is not None:
                        next(drafted)
                continue
            if not chunk.samples:
                seq.num_computed += chunk.num_tokens
                self.block_manager.commit(seq)
                continue
            new_tokens, logprobs = next(sampled) if seq.pooling is None else ([], None)
            if chunk.num_drafts:
                seq.speculative.record(chunk.num_drafts, len(new_tokens) - 1)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason: str | None = None
            if seq.pooling is not None:
                seq.embedding = next(pooled)
                reason = "pooled"
            for j, token in enumerate(new_tokens):  # up to the first that ends the request
                seq.token_ids.append(token)
                if logprobs is not None:
                    seq.logprobs.append(logprobs[j])
                reason = self._stop_reason(seq, token)
                if reason:
                    break
            # Every token but the newest has its KV now: the chunk's known rows and its accepted
            # drafts (a rejected draft's slot is overwritten when that position is computed again).
            seq.num_computed = seq.num_tokens - (seq.pooling is None)
            self.block_manager.commit(seq)
            drafts = next(drafted) if drafted is not None and seq.pooling is None else None
            if reason:
                seq.finish_time = now
                self.scheduler.finish(seq, reason)
                finished.append(seq)
            elif drafts is not None:  # a model drafter drafted in the step (within its room)
                seq.draft_ids, seq.draft_probs = drafts
        if isinstance(self.drafter, TokenDrafter):
            self._propose([c.seq for c in chunks if c.seq in self.scheduler.running])
        return finished

    def _pipelines(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether this step is pipelined (async scheduling): launched now, its tokens read back
        during the next step, whose inputs take them on the device. That needs a step whose every
        row is a plain decode, and nothing that needs a step's tokens on the host before the next
        step is built. Ruled out, so run synchronously after a drain:
        - engine.async_scheduling off (the default on the CPU);
        - a drafter (a verify step's accepted count moves positions; proposals read the tokens),
          a KV connector (per-step reports, exportable tokens), recurrent layers (their eager
          step and verify rollback), several ranks, a pending fp8 scale calibration;
        - a step with a prefill chunk or an embedding request (a new request is admitted through
          a drain and one synchronous step), penalties and logprobs (they read the tokens).
        A request preempted with a token in flight needs no drain: its token is appended when
        read back and recomputed with the rest (Scheduler.finish takes it from the queue if that
        token stopped it)."""
        if (not self.async_scheduling or self.drafter is not None or self.scheduler.connector is not None
                or self.model.recurrent_state_layers or self.parallel.tp_size > 1
                or self.runner.calibrate_at_next_step):
            return False
        return all(c.num_tokens == 1 and c.samples and c.seq.pooling is None and not c.seq.params.penalized
                   and c.seq.params.logprobs is None for c in chunks)

    def _finish_launched(self, launched: LaunchedStep) -> list[Sequence]:
        """Read a pipelined step's tokens back and apply them; returns the requests they
        finished. A request finished since the launch (stopped by the step before, or aborted)
        drops its token."""
        tokens = self.runner.finish(launched)
        now = time.perf_counter()
        finished = []
        for chunk, token in zip(launched.chunks, tokens, strict=True):
            seq = chunk.seq
            seq.num_in_flight -= 1
            if seq.status == Status.FINISHED:
                continue
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._stop_reason(seq, token)
            if seq.status == Status.RUNNING:
                # The tokens before the newest, as a synchronous step commits: the next step (in
                # flight) is computing the newest token's KV, committed once that step is read back.
                self.block_manager.commit(seq, seq.num_tokens - 1)
            if reason:
                seq.finish_time = now
                self.scheduler.finish(seq, reason)
                finished.append(seq)
        return finished

    def _settle(self) -> None:
        """Drop the launched step when none of its requests runs any more (they stopped a step
        late or were aborted): its tokens would all be dropped, and callers step only while the
        scheduler has work. Its device work needs no wait: blocks it writes are reused only by
        steps queued after it."""
        launched = self._launched
        if launched is None or any(c.seq.status == Status.RUNNING for c in launched.chunks):
            return
        self._launched = None
        for chunk in launched.chunks:
            chunk.seq.num_in_flight -= 1

    def _propose(self, seqs: list[Sequence]) -> None:
        """Drafts for the requests that decode next step, no more than their remaining tokens and
        max_model_len leave room for (a verify step emits up to drafts + 1 tokens)."""
        assert isinstance(self.drafter, TokenDrafter)
        decoding = [s for s in seqs if s.num_uncomputed == 1 and s.pooling is None]
        if not decoding:
            return
        proposal = self.drafter.propose([s.token_ids for s in decoding])
        for seq, drafts in zip(decoding, proposal.token_ids, strict=True):
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            seq.draft_ids = list(drafts[: max(room, 0)])

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids or token in p.stop_token_ids:
            return "stop"
        if p.stop and self._stop_string_end(seq) is not None:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None


    def _stop_string_end(self, seq: Sequence) -> int | None:
        """Where the first stop string begins in the output text, if one has appeared; kept in
        `seq.text_end`. The whole output is decoded each time: a token may complete a character
        or a stop string that began in earlier tokens."""
        assert self.tokenizer is not None  # check_request refuses stop strings without one
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        found = [at for at in (text.find(s) for s in seq.params.stop) if at >= 0]
        seq.text_end = min(found) if found else None
        return seq.text_end


def _sampler(config: JackfieldConfig) -> Sampler:
    try:
        entry = get_registry().lookup("sampler", config.sampler.name)
    except KeyError as exc:
        raise ConfigError([f"sampler.name: {exc.args[0]}"]) from None
    return resolve_factory(entry.spec.factory)()  # type: ignore[operator,return-value]


def _drafter(config: JackfieldConfig) -> tuple[Drafter | None, bool]:
    """The drafter [speculative] names, built from its options (None: no speculative decoding), and
    whether it runs the checkpoint's multi-token-prediction layers."""
    spec = config.speculative
    if spec.method is None:
        return None, False
    entry = get_registry().lookup("drafter", spec.method)  # preflight named a missing one
    options = DrafterOptions(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                             spec.model)
    try:
        drafter = resolve_factory(entry.spec.factory)(options)  # type: ignore[operator]
    except ValueError as exc:  # the drafter refuses its options
        raise ConfigError([f"speculative.method {spec.method!r}: {exc}"]) from None
    if not isinstance(drafter, TokenDrafter | ModelDrafter):
        raise ConfigError([f"speculative.method {spec.method!r}: {entry.spec.factory} built a "
                           f"{type(drafter).__name__}, not a TokenDrafter or ModelDrafter"])
    return drafter, entry.spec.mtp_layers


def _kv_connector(config: JackfieldConfig, runner: ModelRunner, drafters: list[Drafter],
                 ) -> tuple[KVConnectorScheduler, KVConnectorWorker] | None:
    """The connector [kv_connector] names, built over the runner's KV cache (None: no connector).
    preflight named a missing one and ran its check_options; what needs the model (a budget
    against one chunk's size) is the factory's to refuse, with a ValueError naming the option."""
    name = config.kv_connector.name
    if name is None:
        return None
    entry = get_registry().lookup("kv_connector", name)
    kv, block_size = runner.kv, runner.block_size
    context = KVConnectorContext(
        options=config.kv_connector.options, block_size=block_size,
        coverage=tuple(KVCoverageSpec(block_size, window) for window in kv.groups.windows),
        lookahead_tokens=combined_lookahead(drafters), layers=tuple(runner.kv_layers),
        layer_group=kv.groups.layer_group, kv_caches=tuple(kv.layer_caches), device=runner.device)
    try:
        parts = resolve_factory(entry.spec.factory)(context)  # type: ignore[operator]
    except ValueError as exc:
        raise ConfigError([f"kv_connector {name!r}: {exc}"]) from None
    scheduler, worker = parts
    if not isinstance(scheduler, KVConnectorScheduler) or not isinstance(worker, KVConnectorWorker):
        raise ConfigError([f"kv_connector {name!r}: {entry.spec.factory} must return a "
                           "(KVConnectorScheduler, KVConnectorWorker) pair"])
    return scheduler, worker


def _eos_ids(config_json: dict[str, object], tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    eos = config_json.get("eos_token_id")
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return {int(i) for i in ids}
