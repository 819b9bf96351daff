"""The model contract from the outside: the example plugin's Qwen2 family (examples/
third_party_plugin), installed as a distribution with an entry point, generates what
transformers' own Qwen2 generates, and its layer taps are transformers' hidden states."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.contracts.model import LayerTaps, ModelCapabilities
from jackfield.engine.scheduler import ScheduledChunk
from jackfield.engine.sequence import Sequence
from jackfield.plugins import reset_registry
from transformers import Qwen2Config, Qwen2ForCausalLM

EXAMPLE_SRC = Path(__file__).resolve().parents[3] / "examples/third_party_plugin/src"
SEED = 20261201


@pytest.fixture
def example_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The example package on sys.path with a dist-info, as `pip install -e` leaves it."""
    site = tmp_path / "site"
    info = site / "jackfield_example_plugin-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: jackfield-example-plugin\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[jackfield]\nexample = jackfield_example_plugin\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    reset_registry()
    yield
    reset_registry()


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen2ForCausalLM]:
    torch.manual_seed(SEED)
    config = Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, rope_theta=10000.0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # q/k/v biases start at zero: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    return path, model


def test_example_family_generates_what_transformers_generates(example_plugin, qwen2_dir) -> None:  # type: ignore[no-untyped-def]
    path, reference = qwen2_dir
    print(f"seed {SEED}")
    gen = torch.Generator().manual_seed(SEED)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (7, 23, 40)]
    llm = LLM(path, backend="torch_ref", block_size=16, device="cpu", dtype="float32",
              max_num_batched_tokens=32)  # the 40-token prompt runs in two chunks
    assert type(llm.engine.model).__module__ == "jackfield_example_plugin.qwen2"
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        with torch.no_grad():
            ids = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            logits = reference(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        assert out.token_ids == ids
        want = logits.log_softmax(-1)
        for step, got in enumerate(out.logprobs):
            for token, value in got.items():
                assert abs(value - want[step, token].item()) < 1e-4


def test_layer_taps_are_transformers_hidden_states(example_plugin, qwen2_dir) -> None:  # type: ignore[no-untyped-def]
    path, reference = qwen2_dir
    llm = LLM(path, backend="torch_ref", block_size=16, device="cpu", dtype="float32")
    model, runner = llm.engine.model, llm.engine.runner
    caps = model.capabilities
    assert isinstance(caps, ModelCapabilities) and caps.num_layers == 6 and caps.vocab_size == 320
    assert caps.eagle3_tap_layers == (2, 3)  # (2, L // 2, L - 3) for L = 6
    gen = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, 320, (19,), generator=gen).tolist()
    seq = Sequence(0, len(tokens), tokens, SamplingParams(), 0)
    llm.engine.block_manager.grow(seq, len(tokens))
    chunks = [ScheduledChunk(seq, len(tokens))]
    per_group, input_ids, positions = runner._metadata(chunks)
    taps = LayerTaps((0, 2, 5), caps.num_layers)
    with torch.no_grad():
        step = runner.contexts.build(runner.kv_caches, per_group)
        hidden = model(torch.tensor(input_ids), positions, step, None, taps)
        want = reference(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    for layer, state in zip(taps.layers, taps.states, strict=True):
        assert state is not None and (state - want[layer][0]).abs().max().item() < 1e-4
    # the final hidden states are the normed output of the last layer
    assert (hidden - want[-1][0]).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="tap layers"):
        LayerTaps((6,), caps.num_layers)
