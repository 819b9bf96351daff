"""DeepSeek's multi-token-prediction layers against a float64 reference of their equations, the
decoder layer being transformers' own (layer L of a transformers model of L + 1 layers):

    h' = eh_proj(cat(enorm(embed(t_{p+1}) * [p != 0]), hnorm(h_p)))    (h_p: the target's final hidden state)
    x  = decoder_layer(h')   (causal over the MTP layer's own rows)    logits = head(shared_head.norm(x))

and a draft step continues from its own x (before the norm) with the token it drafted, one
position on. Run the way the engine runs it: paged caches with scattered blocks, the verified
pass in chunks over a batch of two requests, then batched one-row draft steps. Deliberately
broken readings of the equations (cat order swapped, position 0 not zeroed, the target's hidden
state before its final norm) are shown to differ from what the model gives."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from jackfield.models import load_model
from jackfield.testing.checkpoints import write_deepseek_mtp
from jackfield.testing.paged import TORCH_REF, PagedRun
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

BROKEN = ("cat_swapped", "position_0_kept", "hidden_before_norm")


class Reference:
    """The equations in float64 over whole sequences (no cache), from transformers' modules and
    the checkpoint's MTP tensors."""

    def __init__(self, target: PreTrainedModel, extended: PreTrainedModel,
                 tensors: dict[str, torch.Tensor]) -> None:
        self.target = copy.deepcopy(target).double()
        self.extended = copy.deepcopy(extended).double()
        for model in (self.target, self.extended):
            model.config._experts_implementation = "eager"  # the per-expert loop: grouped_mm has no float64
        layer = target.config.num_hidden_layers
        self.block = self.extended.model.layers[layer]
        self.eps = target.config.rms_norm_eps
        self.w = {name: tensors[f"model.layers.{layer}.{name}.weight"].double()
                  for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")}

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def target_hidden(self, prompt: list[int], before_norm: bool = False) -> torch.Tensor:
        """The target's final hidden states [P, H] (before_norm: its final norm's input)."""
        seen: list[torch.Tensor] = []
        hook = self.target.model.norm.register_forward_hook(lambda _, args, out: seen.append(args[0]))
        with torch.no_grad():
            out = self.target.model(torch.tensor([prompt])).last_hidden_state
        hook.remove()
        return (seen[0] if before_norm else out)[0]

    def mtp(self, next_tokens: list[int], hidden: torch.Tensor, broken: str | None = None) -> torch.Tensor:
        """Outputs x [T, H] of the MTP layer over rows 0..T-1 (row p: the token at p + 1, h_p)."""
        t = len(next_tokens)
        embedded = self.target.model.embed_tokens.weight[torch.tensor(next_tokens)]
        if broken != "position_0_kept":
            embedded = torch.cat((torch.zeros_like(embedded[:1]), embedded[1:]))
        parts = (self.rms(embedded, self.w["enorm"]), self.rms(hidden, self.w["hnorm"]))
        h = torch.cat(parts[::-1] if broken == "cat_swapped" else parts, dim=-1) @ self.w["eh_proj"].T
        positions = torch.arange(t).unsqueeze(0)
        mask = torch.full((t, t), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
        with torch.no_grad():
            rope = self.extended.model.rotary_emb(h[None], positions)
            out = self.block(h[None], attention_mask=mask, position_ids=positions, position_embeddings=rope)
            return out[0]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.rms(x, self.w["shared_head.norm"]) @ self.w["shared_head.head"].T


@pytest.fixture(scope="module", params=["v3", "v3-no-qlora-yarn"])
def mtp_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                   ) -> tuple[Path, Reference]:
    directory = tmp_path_factory.mktemp(f"mtp-{request.param}")
    return directory, Reference(*write_deepseek_mtp(request.param, directory))


def test_mtp_layer_matches_the_float64_reference(mtp_checkpoint: tuple[Path, Reference],
                                                 rng_seed: int) -> None:
    directory, ref = mtp_checkpoint
    model = load_model(directory, TORCH_REF, torch.float32, "cpu")
    model.load_mtp_layers(directory)
    vocab = model.capabilities.vocab_size
    gen = torch.Generator().manual_seed(rng_seed)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 10)]
    run = PagedRun(model, block_size=4, num_blocks=24)
    reqs = [run.add() for _ in prompts]
    hidden = run.step(list(zip(reqs, prompts, strict=True)))  # the target's forward (final hidden states)
    # Each request's sequence: the prompt, then the token the target drafts after it.
    sequences = [p + [int(torch.randint(0, vocab, (1,), generator=gen))] for p in prompts]
    targets = torch.split(hidden, [len(p) for p in prompts])
    # The verified pass in two chunks: rows [0, 4), then the rest of each prompt.
    outputs: list[list[torch.Tensor]] = [[], []]
    for first, last in ((0, 4), (4, None)):
        spans = [(r, first, len(p[first:last])) for r, p in zip(reqs, prompts, strict=True)]
        rows = [(r, p) for r, (_, start, count) in enumerate(spans) for p in range(start, start + count)]
        x = model.mtp_forward(0, run.context(spans), torch.tensor([sequences[r][p + 1] for r, p in rows]),
                              torch.tensor([p for _, p in rows]),
                              torch.stack([targets[r][p] for r, p in rows]))
        for r, chunk in enumerate(torch.split(x, [count for _, _, count in spans])):
            outputs[r].append(chunk)
    for r, prompt in enumerate(prompts):
        got = torch.cat(outputs[r])
        want = ref.mtp(sequences[r][1:], ref.target_hidden(prompt))
        torch.testing.assert_close(model.mtp_logits(0, got).double(), ref.logits(want), atol=1e-4, rtol=1e-4)
        for broken in BROKEN:
            hidden_in = ref.target_hidden(prompt, before_norm=broken == "hidden_before_norm")
            wrong = ref.logits(ref.mtp(sequences[r][1:], hidden_in, broken))
            assert (model.mtp_logits(0, got).double() - wrong).abs().max() > 1e-2, broken
    # Draft steps: one row per request, continuing from its last output with the token it drafted.
    last = torch.stack([torch.cat(o)[-1] for o in outputs])
    states = [(ref.target_hidden(p), s[1:]) for p, s in zip(prompts, sequences, strict=True)]
    for step in range(3):
        drafted = ref.logits(last.double()).argmax(dim=-1).tolist()
        positions = [len(p) + step for p in prompts]
        context = run.context([(r, pos, 1) for r, pos in zip(reqs, positions, strict=True)], num_decodes=2)
        last = model.mtp_forward(0, context, torch.tensor(drafted), torch.tensor(positions), last)
        for r in range(len(prompts)):
            # The reference's rows: every earlier row, then this one (its hidden: the previous x).
            hidden_rows, tokens = states[r]
            previous = ref.mtp(tokens, hidden_rows)[-1:]
            states[r] = (torch.cat((hidden_rows, previous)), tokens + [drafted[r]])
            want = ref.mtp(states[r][1], states[r][0])[-1]
            # Each step reads the previous step's output: float32's error compounds over the three
            # (2.9e-4 at step 3 for seed 2007031295); a broken equation errs by > 1e-2.
            torch.testing.assert_close(model.mtp_logits(0, last[r : r + 1]).double()[0], ref.logits(want),
                                       atol=1e-4 * 4**step, rtol=1e-4 * 4**step)


def test_loading_is_refused_where_there_is_nothing_to_load(mtp_checkpoint: tuple[Path, Reference]) -> None:
    directory, _ = mtp_checkpoint
    model = load_model(directory, TORCH_REF, torch.float32, "cpu")
    with pytest.raises(ValueError, match="MTP layer 0 of 0 loaded"):
        model.mtp_logits(0, torch.zeros(1, model.capabilities.hidden_size))
    model.load_mtp_layers(directory)
    assert len(model.kv_cache_layers) == model.capabilities.num_layers + 1
    with pytest.raises(ValueError, match="loaded already"):
        model.load_mtp_layers(directory)


def test_the_checkpoint_s_copies_of_the_shared_embedding_must_be_the_target_s(
        mtp_checkpoint: tuple[Path, Reference], tmp_path: Path) -> None:
    directory, _ = mtp_checkpoint
    copy_dir = tmp_path / "changed"
    shutil.copytree(directory, copy_dir)
    tensors = load_file(str(copy_dir / "mtp.safetensors"))
    name = next(n for n in tensors if n.endswith(".embed_tokens.weight"))
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, str(copy_dir / "mtp.safetensors"))
    model = load_model(copy_dir, TORCH_REF, torch.float32, "cpu")
    with pytest.raises(ValueError, match=rf"{name} differ from the target's embedding and head"):
        model.load_mtp_layers(copy_dir)
    assert len(model.kv_cache_layers) == model.capabilities.num_layers  # nothing loaded half-way
