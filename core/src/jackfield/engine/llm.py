"""`jackfield.LLM`: config -> backends -> model -> KV cache -> generate."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from jackfield.attention.kv_cache import allocate_kv_cache, cache_dtype, cache_shape
from jackfield.config import ConfigError, JackfieldConfig, load_config
from jackfield.contracts.attention import AttentionLayerSpec
from jackfield.contracts.sampler import Sampler, SamplingParams
from jackfield.engine.block_manager import BlockManager, max_request_blocks
from jackfield.engine.cuda_graphs import DecodeGraphs
from jackfield.engine.piecewise_graphs import PiecewiseGraphs, is_piecewise
from jackfield.engine.kv_groups import plan_kv_cache_groups
from jackfield.engine.model_runner import ModelRunner
from jackfield.engine.outputs import RequestOutput, RequestTimings
from jackfield.engine.scheduler import ScheduledChunk, Scheduler
from jackfield.engine.sequence import Sequence
from jackfield.engine.tokenizer import load_tokenizer
from jackfield.models import load_model
from jackfield.models.attention import AttentionBackends
from jackfield.models.default_model import default_model_dir
from jackfield.models.embedding import pool, pooling_of
from jackfield.plugins import get_registry
from jackfield.requirements import attention_requirements, read_config_json, resolve_device, resolve_dtype
from jackfield.sampling.processors import check_named_tokens
from jackfield.selection import BackendChoice, resolve_attention
from jackfield.specs import resolve_factory

Prompt = str | Seq[int]


def _dotted(overrides: dict[str, object]) -> dict[str, object]:
    """`block_size=64` -> {"engine.block_size": 64}: a plain key must name one config field."""
    defaults = JackfieldConfig()
    fields = {s.name: {f.name for f in dataclasses.fields(getattr(defaults, s.name))}
              for s in dataclasses.fields(defaults)}
    dotted: dict[str, object] = {}
    for key, value in overrides.items():
        if "." in key:
            dotted[key] = value
            continue
        owners = [section for section, names in fields.items() if key in names]
        if len(owners) != 1:
            where = "several sections: " + ", ".join(owners) if owners else "no config section"
            raise ConfigError([f"override {key!r} matches {where}; use 'section.{key}'"])
        dotted[f"{owners[0]}.{key}"] = value
    return dotted


def unsupported_features(config: JackfieldConfig) -> list[str]:
    """Config features this engine does not run yet: fail before anything loads (doctor says so too)."""
    problems = []
    if config.speculative.method is not None:
        problems.append("speculative decoding (speculative.method) is not run by this engine yet")
    if config.kv_connector.name is not None:
        problems.append("KV connectors (kv_connector.name) are not run by this engine yet")
    if config.parallel.dcp_size != 1:
        problems.append("decode context parallel (parallel.dcp_size > 1) is not run by this engine yet")
    return problems


class LLM:
    """LLM(model=None, config=None, **overrides). `model`: a local HF directory (None: the config's
    model.path, else the embedded default). `config`: a JackfieldConfig or a TOML path. Overrides
    are dotted ("engine.block_size") or plain field names (block_size) and win over the config."""

    def __init__(self, model: str | Path | None = None, config: JackfieldConfig | str | Path | None = None,
                 *, progress: Callable[[str], None] | None = None, **overrides: object) -> None:
        dotted = _dotted(overrides)
        if model is not None:
            dotted["model.path"] = str(model)
        if isinstance(config, JackfieldConfig):  # validated like a file: a hand-built config may be wrong
            base = {f"{s.name}.{k}": v for s in dataclasses.fields(config)
                    for k, v in dataclasses.asdict(getattr(config, s.name)).items()}
            config = load_config(None, {**base, **dotted})
        else:
            config = load_config(config, dotted)
        problems = unsupported_features(config)
        if problems:
            raise ConfigError(problems)
        self.config = config
        sampler = self._sampler()  # a config naming a missing sampler fails before any loading
        say = progress or (lambda _: None)
        self.device = torch.device(resolve_device(config))
        self.dtype = resolve_dtype(config, self.device.type)
        if config.model.path is None:
            say("creating the embedded default model")
        self.model_dir = Path(config.model.path) if config.model.path else default_model_dir()
        config_json = read_config_json(self.model_dir)  # read once: requirements, eos, pooling
        requirements = attention_requirements(config_json, config)
        self.backend_choices: dict[str, BackendChoice] = resolve_attention(config, requirements)
        backends = AttentionBackends(prefill=self.backend_choices["prefill"].backend,
                                     decode=self.backend_choices["decode"].backend)
        say(f"loading {self.model_dir}")
        self.model = load_model(self.model_dir, backends, self.dtype, self.device, config.attention.kv_cache_dtype)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = self._eos_ids(config_json)
        self.pooling = pooling_of(config_json)
        engine = config.engine
        if engine.max_model_len is not None and engine.max_model_len > self.model.max_model_len:
            raise ConfigError([f"engine.max_model_len {engine.max_model_len} exceeds the model's "
                               f"max_position_embeddings {self.model.max_model_len}"])
        self.max_model_len = engine.max_model_len or self.model.max_model_len
        layers = self.model.kv_cache_layers
        self.kv_groups = plan_kv_cache_groups(layers)
        self.num_blocks = self._num_blocks()
        tensors = {t: allocate_kv_cache(layer, self.num_blocks, engine.block_size, self.dtype, self.device)
                   for t, layer in self._layer_of_tensor().items()}
        kv_caches = [tensors[t] for t in self.kv_groups.layer_tensor]
        self.block_manager = BlockManager(self.num_blocks, engine.block_size, engine.enable_prefix_caching,
                                          self.kv_groups.windows)
        self.scheduler = Scheduler(self.block_manager, engine.max_num_seqs, engine.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, backends, sampler, kv_caches, engine.block_size,
                                  self.device, self.kv_groups)
        self.cuda_graphs_off = self._cuda_graphs_off_reason(backends)
        if self.cuda_graphs_off is None:
            self.runner.graphs = DecodeGraphs(self.model, kv_caches, self.runner.builders[0][0], backends.split,
                                              self.num_blocks, engine.block_size, self.max_model_len,
                                              engine.max_num_seqs, self.device)
            try:
                self.runner.graphs.capture(say)
            except RuntimeError as exc:  # e.g. a host sync in a backend's decode path
                raise RuntimeError(f"recording decode CUDA graphs with attention backend {backends.decode.name} "
                                   f"failed ({exc}); set engine.cuda_graphs = false to decode eagerly") from exc
        self.prefill_graphs_off = self._prefill_graphs_off_reason()
        if self.prefill_graphs_off is None:
            max_tokens = min(engine.max_num_batched_tokens, engine.prefill_graph_max_tokens)
            self.runner.pieces = PiecewiseGraphs(self.model, max_tokens, self.device)
            try:
                self.runner.pieces.capture(say)
            except RuntimeError as exc:  # a failed body makes capture_end raise its own error: name the first
                cause = exc.__context__ or exc
                raise RuntimeError(f"recording prefill CUDA graphs of {type(self.model).__name__} up to {max_tokens} "
                                   f"tokens failed ({cause}); lower engine.prefill_graph_max_tokens (or "
                                   "engine.gpu_memory_fraction) if memory ran out, or set it to 0 to run "
                                   "prefill steps eagerly") from exc
        self._seeds = random.Random(config.sampler.seed)
        self._next_id = 0
        if self.device.type == "cuda" and not getattr(self.model, "non_causal", False):
            say("warming up")
            self._warm_up()

    def _warm_up(self) -> None:
        """One short sampled request through prefill and decode, so kernel compiles (Triton) and
        library plan builds happen at start-up, not in the first request's time to first token.
        It leaves nothing behind: it never fills a block (so the prefix cache keeps nothing), its
        blocks are freed and request ids start at 0 again."""
        length = min(self.config.engine.block_size, self.max_model_len) - 2
        if length < 1:
            return
        self.generate([[0] * length], SamplingParams(temperature=1.0, seed=0, max_tokens=2, ignore_eos=True))
        self._next_id = 0

    def _cuda_graphs_off_reason(self, backends: AttentionBackends) -> str | None:
        """Why decode steps run eagerly (None: they are replayed from CUDA graphs)."""
        decode = backends.decode
        reason = self._graphs_off_reason()
        if reason is None and decode.capabilities.cuda_graph == "never":
            return f"decode backend {decode.name} declares cuda_graph = never"
        return reason

    def _prefill_graphs_off_reason(self) -> str | None:
        """Why prefill and mixed steps run eagerly (None: their pieces between attention calls
        are replayed from CUDA graphs; attention itself always runs eagerly)."""
        reason = self._graphs_off_reason()
        if reason is not None:
            return reason
        if self.config.engine.prefill_graph_max_tokens == 0:
            return "engine.prefill_graph_max_tokens = 0"
        if not is_piecewise(self.model):
            return f"{type(self.model).__name__} does not declare its forward in pieces"
        return None

    def _graphs_off_reason(self) -> str | None:
        """What rules out every CUDA graph of the model's forward."""
        if self.device.type != "cuda":
            return f"the device is {self.device.type}"
        if not self.config.engine.cuda_graphs:
            return "engine.cuda_graphs = false"
        if getattr(self.model, "non_causal", False):
            return "the model is bidirectional (no decode steps)"
        if not getattr(self.model, "cuda_graph_safe", False):
            return (f"{type(self.model).__name__} cannot be recorded here (a host sync in its forward, "
                    "e.g. MoE experts without bf16 grouped matmuls on compute capability >= 9.0)")
        if self.kv_groups.hybrid:
            return "the model has several KV cache groups (sliding-window layers)"
        return None

    def _sampler(self) -> Sampler:
        try:
            entry = get_registry().lookup("sampler", self.config.sampler.name)
        except KeyError as exc:
            raise ConfigError([f"sampler.name: {exc.args[0]}"]) from None
        return resolve_factory(entry.spec.factory)()  # type: ignore[operator,return-value]

    def _eos_ids(self, config_json: dict[str, object]) -> set[int]:
        eos = config_json.get("eos_token_id")
        ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return {int(i) for i in ids}

    def _layer_of_tensor(self) -> dict[int, AttentionLayerSpec]:
        """Per cache tensor, a layer it serves (the layers sharing one have one layout)."""
        layers = self.model.kv_cache_layers
        return {t: layer for layer, t in zip(layers, self.kv_groups.layer_tensor, strict=True)}

    def _num_blocks(self) -> int:
        """Blocks the budget pays for, capped at what max_num_seqs full-length requests can use.
        A block id holds one block in each cache tensor (with KV cache groups, fewer than layers)."""
        engine = self.config.engine
        per_block = sum(
            torch.Size(cache_shape(layer, 1, engine.block_size)).numel()
            * cache_dtype(layer.kv_cache_dtype, self.dtype).itemsize
            for layer in self._layer_of_tensor().values()
        )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * engine.gpu_memory_fraction
            where = f"{engine.gpu_memory_fraction} of the free GPU memory"
        else:
            budget = engine.cpu_kv_cache_gib * 2**30
            where = f"engine.cpu_kv_cache_gib = {engine.cpu_kv_cache_gib}"
        windows = self.kv_groups.windows
        useful = engine.max_num_seqs * max_request_blocks(
            windows, engine.block_size, self.max_model_len, engine.max_num_batched_tokens
        ) + any(w is not None for w in windows)  # the null block
        num_blocks = min(int(budget // per_block), useful)
        if num_blocks < 1:
            raise ConfigError([f"the KV cache budget ({where}) does not fit one block of {per_block} bytes"])
        return num_blocks

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer: give prompts as lists of token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        ids = [int(t) for t in prompt]
        vocab = self.model.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        return ids

    def _request(self, prompt: Prompt, params: SamplingParams) -> Sequence:
        ids = self._encode(prompt)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room under max_model_len {self.max_model_len}")
        engine = self.config.engine
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        needed = max_request_blocks(self.kv_groups.windows, engine.block_size, total, engine.max_num_batched_tokens)
        if needed > self.block_manager.num_usable:
            raise ValueError(f"a request of {len(ids)} + {params.max_tokens} tokens needs {needed} KV blocks; "
                             f"the cache has {self.block_manager.num_usable} (raise the KV budget)")
        check_named_tokens(params, self.model.arch.vocab_size)
        seed = params.seed if params.seed is not None else self._seeds.randrange(2**63)
        seq = Sequence(self._next_id, len(ids), ids, params, seed)
        self._next_id += 1
        return seq

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, progress: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs come back in prompt order.
        `progress(done, total)` is called as requests finish."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if getattr(self.model, "non_causal", False):
            raise ValueError(f"{self.model_dir} is a bidirectional (is_causal=false) model: use LLM.embed, not generate")
        seqs = [self._request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        for seq in seqs:
            self.scheduler.add(seq)
        done = 0
        while self.scheduler.has_work():
            done += self._step()
            if progress:
                progress(done, len(seqs))
        return [self._output(seq) for seq in seqs]

    def embed(self, inputs: Prompt | Seq[Prompt]) -> torch.Tensor:
        """One pooled vector per prompt, [B, hidden] float32 (config.json's `pooling`: mean, last
        or cls). Each prompt runs whole in one step (bidirectional attention needs all of its
        tokens at once), never through the prefix cache; its blocks are handed back after."""
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # type: ignore[list-item]
        seqs = [self._request(p, SamplingParams(max_tokens=1)) for p in inputs]  # type: ignore[union-attr]
        budget = self.config.engine.max_num_batched_tokens
        pooled: list[torch.Tensor] = []
        i = 0
        while i < len(seqs):
            batch: list[Sequence] = []
            tokens = 0
            while i < len(seqs) and tokens + seqs[i].num_tokens <= budget and self.block_manager.can_grow(
                seqs[i], seqs[i].num_tokens
            ):
                self.block_manager.grow(seqs[i], seqs[i].num_tokens)
                batch.append(seqs[i])
                tokens += seqs[i].num_tokens
                i += 1
            if not batch:
                raise ValueError(f"a prompt of {seqs[i].num_tokens} tokens exceeds engine.max_num_batched_tokens "
                                 f"({budget}): embedding runs each prompt whole in one step")
            try:
                hidden, common = self.runner.forward([ScheduledChunk(seq, seq.num_tokens) for seq in batch])
            finally:
                for seq in batch:
                    self.block_manager.release(seq)
            pooled.append(pool(hidden, common.query_start_loc_cpu.tolist(), self.pooling))
        return torch.cat(pooled)

    def _step(self) -> int:
        chunks = self.scheduler.schedule()
        if not chunks:
            raise RuntimeError("scheduler made no progress (a request cannot fit the KV cache)")
        result = self.runner.step(chunks)
        now = time.perf_counter()
        finished = 0
        sampled = iter(zip(result.token_ids, result.logprobs, strict=True))
        for chunk in chunks:
            seq = chunk.seq
            samples = chunk.samples
            seq.num_computed += chunk.num_tokens
            self.block_manager.commit(seq)
            if not samples:
                continue
            token, logprobs = next(sampled)
            seq.token_ids.append(token)
            if logprobs is not None:
                seq.logprobs.append(logprobs)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._stop_reason(seq, token)
            if reason:
                seq.finish_time = now
                self.scheduler.finish(seq, reason)
                finished += 1
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids or token in p.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        assert seq.first_token_time is not None and seq.finish_time is not None and seq.finish_reason
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True) if self.tokenizer else None
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[: seq.prompt_len],
            token_ids=seq.output_ids,
            text=text,
            finish_reason=seq.finish_reason,
            seed=seq.seed,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            timings=RequestTimings(seq.first_token_time - seq.arrival_time, seq.finish_time - seq.arrival_time),
            num_cached_tokens=seq.num_cached_prefix,
            num_preemptions=seq.num_preemptions,
        )
