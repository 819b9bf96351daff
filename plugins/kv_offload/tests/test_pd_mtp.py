"""pd beside DeepSeek's MTP drafter (a model drafter with its own KV cache layers, written after
the target's forward, and a KV lookahead of k draft positions):

- two engines give one engine's greedy tokens, and the decode engine holds the prompt's KV as one
  engine computed it, the MTP layer's included (saved before the drafter wrote it, it would be
  stale);
- a producer that decodes with drafts, its KV slots past the verified tokens poisoned (NaN)
  after every step, exports no block holding a poisoned value, the MTP layer's included;
- a connector that does not declare `model_drafters` is still refused beside it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from jackfield import LLM, SamplingParams
from jackfield.commands.pd import PDLLM
from jackfield.config import ConfigError
from jackfield.engine.block_manager import block_hash
from jackfield.testing.checkpoints import write_deepseek_mtp
from jackfield_kv_offload import pd as pd_module
from jackfield_kv_offload.channel import Channel, Kind

BASE = {"engine.device": "cpu", "attention.backend": "torch_ref", "model.dtype": "float32",
        "engine.block_size": 16, "engine.max_num_seqs": 4}
MTP = {"speculative.method": "mtp", "speculative.num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pd_mtp") / "mtp"
    write_deepseek_mtp("v3", directory)
    return directory


def prompts(seed: int) -> list[list[int]]:
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 16, 67, 33, 5)]


def prompt_blocks(engine, prompt: list[int]) -> list[list[torch.Tensor]]:  # noqa: ANN001
    """Per full block of `prompt`, every KV cache's rows there, found through the engine's prefix
    cache (block hashes chained from the seed, as the block manager does; freed blocks keep theirs)."""
    bs, parent, out = engine.config.engine.block_size, engine.config.engine.prefix_hash_seed, []
    for i in range(len(prompt) // bs):
        parent = block_hash(parent, prompt[i * bs : (i + 1) * bs])
        block = engine.block_manager.cached[(0, parent)]
        out.append([cache[block].clone() for cache in engine.runner.kv_caches])
    return out


def test_greedy_tokens_and_the_prompts_kv_of_one_engine(mtp_dir: Path) -> None:
    batch = prompts(31)
    single = LLM(mtp_dir, **BASE, **MTP)
    expected = single.generate(batch, GREEDY, use_tqdm=False)
    with PDLLM(mtp_dir, **BASE, **MTP, **{"kv_connector.options": {"timeout_s": 10.0}}) as llm:
        got = llm.generate(batch, GREEDY, use_tqdm=False)
        decode, prefill = llm.engine.kv_connector_stats(), llm.producer_stats()
        landed = [prompt_blocks(llm.engine, p) for p in batch]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert all(o.speculative is not None and o.speculative.drafts > 0 for o in got)
    for mine, theirs in zip(landed, [prompt_blocks(single.engine, p) for p in batch], strict=True):
        for block_mine, block_theirs in zip(mine, theirs, strict=True):  # the MTP layer's cache is last
            for layer, (a, b) in enumerate(zip(block_mine, block_theirs, strict=True)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"KV cache {layer}")
    blocks = sum(len(p) // 16 for p in batch)  # one full-attention group: the MLA latent and MTP caches
    assert decode is not None and prefill is not None
    assert prefill["exported_blocks"] == decode["received_chunks"] == decode["loaded_chunks"] == blocks


class Capture(Channel):
    """A channel to nowhere that keeps what the producer sends."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def send(self, tensor: torch.Tensor) -> None:
        self.sent.append(tensor.clone())

    def recv(self, tensor: torch.Tensor) -> None:
        raise RuntimeError("nothing comes back")


def layer_messages(sent: list[torch.Tensor], planes: int) -> list[tuple[int, list[torch.Tensor]]]:
    """(layer, rows per plane) of every LAYER message in the stream."""
    out, i = [], 0
    while i < len(sent):
        kind, _, _, layer = sent[i].tolist()
        i += 1
        if kind == Kind.BEGIN:
            i += 1
        elif kind == Kind.LAYER:
            out.append((layer, sent[i : i + planes]))
            i += planes
    return out


def test_no_exported_block_holds_a_draft_written_slot(mtp_dir: Path, monkeypatch) -> None:
    capture = Capture()
    monkeypatch.setattr(pd_module, "GlooChannel", lambda *args: capture)
    monkeypatch.setattr(pd_module, "handshake", lambda *args: None)
    options = {"role": "producer", "address": "127.0.0.1:1", "timeout_s": 30.0}
    llm = LLM(mtp_dir, **BASE, **MTP, **{"kv_connector.name": "pd", "kv_connector.options": options})
    engine = llm.engine
    batch = prompts(33)
    want = [o.token_ids for o in LLM(mtp_dir, **BASE).generate(batch, GREEDY, use_tqdm=False)]
    seqs = engine.add_requests([(p, GREEDY) for p in batch])
    caches, bs = engine.runner.kv_caches, engine.config.engine.block_size
    poisoned = 0
    while engine.scheduler.has_work():
        engine.step()
        for seq in engine.scheduler.running:  # every slot past the verified tokens: draft-written
            for position in range(seq.num_computed, len(seq.block_tables[0]) * bs):
                block, offset = seq.block_tables[0][position // bs], position % bs
                for cache in caches:  # MLA [blocks, block_size, width]: one group, every layer
                    cache[block, offset] = math.nan
                poisoned += 1
    assert [s.output_ids for s in seqs] == want  # the poison touched nothing a verified step reads
    assert poisoned > 0 and sum(s.speculative.drafts for s in seqs) > 0
    worker = engine.runner.connector
    assert worker is not None
    worker.sender.close()  # everything queued is sent
    rows = layer_messages(capture.sent, planes=1)
    num_layers = engine.capabilities.num_layers
    assert {layer for layer, _ in rows} >= {num_layers}  # the MTP layer's cache was exported too
    for layer, planes in rows:
        for plane in planes:
            assert not plane.view(torch.float32).isnan().any(), f"layer {layer} exported a poisoned slot"
    stats = engine.kv_connector_stats()
    assert stats is not None and stats["exported_blocks"] > sum(len(p) // bs for p in batch)  # decodes too


def test_a_connector_without_model_drafters_is_refused(mtp_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"'cpu_offload' with speculative.method 'mtp' is not run yet"):
        LLM(mtp_dir, **BASE, **MTP, **{"kv_connector.name": "cpu_offload"})
