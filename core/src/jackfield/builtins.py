"""Core's own implementations, registered through the same hooks as any third-party plugin."""

from __future__ import annotations

import torch

from jackfield.contracts.attention import AttentionCapabilities
from jackfield.hookspecs import hookimpl
from jackfield.specs import AttentionBackendSpec, ModelSpec, SamplerSpec

JACKFIELD_API = ">=1.0,<2"

TORCH_REF_CAPABILITIES = AttentionCapabilities(
    kinds=("mla", "mha"),
    activation_dtypes=(torch.float32, torch.bfloat16, torch.float16),
    kv_cache_dtypes=("auto", "bfloat16", "fp8_e4m3"),
    head_sizes=None,
    block_size_multiple=1,
    devices=("cpu", "cuda"),
    sliding_window=True,
    sinks=True,
    sparse_topk=True,
    non_causal=True,
    dcp=True,
    max_decode_query_len=1 << 16,
    cuda_graph="never",
)


@hookimpl
def register_attention_backends() -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="torch_ref",
            factory="jackfield.attention.torch_ref:TorchRefBackend",
            capabilities=TORCH_REF_CAPABILITIES,
            priority=0,  # the fallback: any faster backend that validates wins `auto`
            description="plain PyTorch reference (the oracle); runs anywhere, float32 accumulation",
        )
    ]


@hookimpl
def register_samplers() -> list[SamplerSpec]:
    return [
        SamplerSpec(
            name="murmur3",
            factory="jackfield.sampling.samplers:Murmur3Sampler",
            description="seeded Gumbel-max with Murmur3 noise; same tokens on every device and batch",
        ),
        SamplerSpec(
            name="torch_ref",
            factory="jackfield.sampling.samplers:TorchRefSampler",
            description="reference sampler: softmax + torch.multinomial with a per-request generator",
        ),
    ]


GRANITE_FAMILY = (
    "LlamaForCausalLM",
    "GraniteForCausalLM",
    "GraniteSWAForCausalLM",
    "GraniteMoeForCausalLM",
    "GraniteMoeSharedForCausalLM",
    "GraniteMoeSWAForCausalLM",
)


@hookimpl
def register_models() -> list[ModelSpec]:
    deepseek = [
        ModelSpec(
            name=arch,
            factory="jackfield.models.deepseek:DeepseekForCausalLM",
            description="DeepSeek MLA + MoE (V2/V3); with is_causal=false a bidirectional embedding model",
        )
        for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
    ]
    granite = [
        ModelSpec(
            name=arch,
            factory="jackfield.models.granite:GraniteForCausalLM",
            description="GQA decoder: Llama, Granite (SWA: per-layer sliding windows + sinks; MoE)",
        )
        for arch in GRANITE_FAMILY
    ]
    v32 = ModelSpec(
        name="DeepseekV32ForCausalLM",
        factory="jackfield.models.deepseek_v32:DeepseekV32ForCausalLM",
        description="DeepSeek-V3.2: lightning indexer + sparse MLA",
    )
    hybrid = [
        ModelSpec(
            name="Qwen3NextForCausalLM",
            factory="jackfield.models.qwen3_next:Qwen3NextForCausalLM",
            description="Qwen3-Next: Gated DeltaNet layers beside gated full attention, MoE",
        ),
        ModelSpec(
            name="GraniteMoeHybridForCausalLM",
            factory="jackfield.models.granite_hybrid:GraniteMoeHybridForCausalLM",
            description="Granite 4.0 hybrid: Mamba2 layers beside GQA attention (MoE or dense)",
        ),
    ]
    return [*deepseek, v32, *granite, *hybrid]
