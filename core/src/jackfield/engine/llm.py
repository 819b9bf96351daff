"""`jackfield.LLM`: the offline face of the engine (prompts in, outputs back in prompt order)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from tqdm import tqdm

from jackfield.config import JackfieldConfig, resolve_config
from jackfield.contracts.sampler import SamplingParams
from jackfield.engine.engine import Engine
from jackfield.engine.outputs import CompletionOutput, RequestOutput, RequestTimings
from jackfield.engine.sequence import Sequence
from jackfield.engine.tokenizer import chat_prompt_ids

# text, token ids, or vLLM's dict form ({"prompt": text} or {"prompt_token_ids": ids})
Prompt = str | Seq[int] | Mapping[str, object]


class LLM:
    """LLM(model=None, config=None, **overrides). `model`: a local HF directory (None: the config's
    model.path, else the embedded default). `config`: a JackfieldConfig or a TOML path. Overrides
    are dotted ("engine.block_size") or plain field names (block_size) and win over the config."""

    def __init__(self, model: str | Path | None = None, config: JackfieldConfig | str | Path | None = None,
                 *, progress: Callable[[str], None] | None = None, **overrides: object) -> None:
        self.engine = Engine(resolve_config(config, model, overrides), progress or (lambda _: None))
        self.config = self.engine.config  # as the engine runs it (engine.block_size resolved)
        self.tokenizer = self.engine.tokenizer
        self._lock = threading.Lock()  # one call steps the engine at a time (calls from threads queue)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, use_tqdm: bool = True,
                 progress: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs come back in prompt order, each
        with `n` samples. A progress bar runs on stderr (use_tqdm, as vLLM); `progress(done,
        total)` is called as requests finish."""
        prompts = _as_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        not_params = [type(p).__name__ for p in params if not isinstance(p, SamplingParams)]
        if not_params:
            raise ValueError(f"sampling params must be a SamplingParams, got {not_params[0]}")
        encoded = [self._encode(p) for p in prompts]
        requests = [(ids, one) for ids, sp in zip(encoded, params, strict=True) for one in sp.per_sample()]
        seqs = iter(self._run(requests, None, use_tqdm, progress))
        return [self._output([next(seqs) for _ in range(sp.n)]) for sp in params]

    def chat(self, messages: Seq[Mapping[str, object]] | Seq[Seq[Mapping[str, object]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             *, use_tqdm: bool = True,
             progress: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        """`generate` for one conversation ([{role, content}, ...]) or a list of them, each rendered
        by the model's chat template with the assistant's turn opened (vLLM's `LLM.chat`)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [chat_prompt_ids(self.tokenizer, self.engine.model_dir, c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, progress=progress)

    def embed(self, inputs: Prompt | Seq[Prompt]) -> torch.Tensor:
        """One pooled vector per prompt, [B, hidden] float32 (config.json's `pooling`: mean, last
        or cls). Each prompt runs whole in one step (bidirectional attention needs all of its
        tokens at once), never through the prefix cache."""
        seqs = self._run([(self._encode(p), SamplingParams(max_tokens=1)) for p in _as_list(inputs)],
                         self.engine.pooling, False, None)
        return torch.stack([seq.embedding for seq in seqs])  # type: ignore[misc]

    def _run(self, requests: list[tuple[list[int], SamplingParams]], pooling: str | None, use_tqdm: bool,
             progress: Callable[[int, int], None] | None) -> list[Sequence]:
        """Every request validated before any is queued (a bad one leaves the engine untouched),
        then steps until all finish. If a step fails, this call's requests are aborted (their
        blocks freed) before the error propagates, so the engine serves the next call."""
        engine = self.engine
        with self._lock:
            seqs = engine.add_requests(requests, pooling)
            done = 0
            bar = tqdm(total=len(seqs), desc="Processed requests", unit="req", disable=not use_tqdm,
                       dynamic_ncols=True)
            try:
                while engine.scheduler.has_work():
                    finished = engine.step()
                    done += len(finished)
                    bar.update(len(finished))
                    if progress:
                        progress(done, len(seqs))
            except BaseException:
                for seq in seqs:
                    engine.abort(seq)
                raise
            finally:
                bar.close()
        return seqs

    def _encode(self, prompt: Prompt) -> list[int]:
        """Text through the tokenizer; token ids as given (Engine.check_request checks them); a
        vLLM-style dict holds one of them ({"prompt": text} or {"prompt_token_ids": ids})."""
        if isinstance(prompt, Mapping):
            keys = set(prompt) & {"prompt", "prompt_token_ids"}
            if len(keys) != 1 or set(prompt) - keys:
                raise ValueError(f"a dict prompt holds exactly one of 'prompt' or 'prompt_token_ids', "
                                 f"got keys {sorted(map(str, prompt))}")
            inner = prompt[keys.pop()]
            if isinstance(inner, Mapping):
                raise ValueError("a dict prompt's value is a string or a list of token ids")
            return self._encode(inner)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.engine.model_dir} has no tokenizer: "
                                 "give prompts as lists of token ids")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # lone surrogates: bytes that were not UTF-8 (argv, files)
                raise ValueError(f"prompt {prompt[:40]!r} is not valid UTF-8 text "
                                 f"(at character {exc.start})") from None
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, bytes) or not isinstance(prompt, Iterable):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def _output(self, samples: list[Sequence]) -> RequestOutput:
        """One prompt's output from its samples' sequences (in sample order)."""
        first = samples[0]
        completions = []
        for index, seq in enumerate(samples):
            assert seq.finish_time is not None and seq.finish_reason
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True) if self.tokenizer else None
            if text is not None and seq.text_end is not None:  # a stop string is not part of the output
                text = text[: seq.text_end]
            completions.append(CompletionOutput(
                index=index,
                token_ids=seq.output_ids,
                text=text,
                finish_reason=seq.finish_reason,
                seed=seq.seed,
                logprobs=seq.logprobs if seq.params.logprobs is not None else None,
                speculative=seq.speculative if self.engine.drafter is not None else None,
            ))
        first_token = min(s.first_token_time for s in samples if s.first_token_time is not None)
        return RequestOutput(
            request_id=first.request_id,
            prompt_token_ids=first.token_ids[: first.prompt_len],
            outputs=completions,
            prompt_logprobs=first.prompt_logprobs,
            timings=RequestTimings(first_token - first.arrival_time,
                                   max(s.finish_time or 0.0 for s in samples) - first.arrival_time),
            num_cached_tokens=first.num_cached_prefix,
            num_preemptions=sum(s.num_preemptions for s in samples),
        )


def _as_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """One prompt (a string, a list of token ids or a dict) or a list of prompts -> a list."""
    if isinstance(prompts, str | Mapping) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
