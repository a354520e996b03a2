"""GPU/model profiles for the simulated engine, with the published figures they come from.

A :class:`Profile` holds everything :class:`loadtest.sim.engine.Engine` needs: the
paged-KV geometry, the scheduler limits, and the step-cost coefficients of the step
formula (documented in ``engine.py``)::

    step_s = step_overhead_s
           + prefill_s_per_token          * prefill_tokens
           + prefill_attn_s_per_token_pair * prefill_attention_pairs
           + decode_s_per_seq             * decode_seqs
           + kv_read_s_per_token          * kv_context_tokens_read

How the coefficients are set (roofline, one efficiency figure per regime):

* ``step_overhead_s``: one forward pass reads all weights once, so the batch-1 decode
  step is ``weight_bytes / (HBM bandwidth * MEM_EFFICIENCY)``. MEM_EFFICIENCY = 0.77 is
  measured: Llama-3.1-8B BF16 on one A100-40GB under vLLM decodes a single stream at
  ~75 tok/s, "roughly 77% of the GPU's memory-bandwidth ceiling"
  (https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on).
* ``prefill_s_per_token``: ``2 * params`` FLOPs per token through the GEMMs at
  ``PREFILL_MFU`` of the dense BF16 tensor peak. PREFILL_MFU = 0.5 is an ASSUMPTION
  (prefill is compute-bound: Sarathi-Serve, OSDI'24, https://arxiv.org/abs/2403.02310;
  50% MFU is a round, conservative figure for large-M GEMMs), not a measurement.
* ``prefill_attn_s_per_token_pair``: attention FLOPs of one (query, key) pair,
  ``4 * n_layers * n_heads * head_dim`` (QK^T and PV), at the same PREFILL_MFU; this
  makes long prompts super-linear.
* ``decode_s_per_seq``: the GEMM FLOPs of one decode token, ``2 * params``, at
  ``DECODE_MFU`` (ASSUMPTION, same 0.5): the slope of step time in running sequences.
* ``kv_read_s_per_token``: each scheduled sequence reads its KV cache once per step:
  ``kv_bytes_per_token / (HBM bandwidth * MEM_EFFICIENCY)``.
* ``num_gpu_blocks``: ``(HBM * gpu_memory_utilization - weights - activation reserve)
  / (kv_bytes_per_token * block_size)``, as vLLM sizes its KV cache after profiling;
  gpu_memory_utilization = 0.9 is vLLM's default; the activation reserve is an
  ASSUMPTION (2 GiB on 80 GB cards, 1.5 GiB on 24 GB cards).
* Scheduler limits are vLLM V1's defaults for the OpenAI server: GPUs with >= 70 GiB
  (not A100) get max_num_batched_tokens=8192, max_num_seqs=1024; others 2048 / 256
  (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults,
  https://github.com/vllm-project/vllm/blob/main/vllm/engine/arg_utils.py).
  block_size = 16 is vLLM's default for CUDA.

Profiles: ``h100-llama3-8b``, ``a10g-llama3-8b``, ``a100-llama3-8b`` (calibration
reference), ``h100-llama3-8b-prefill``
(prefill-optimized), ``h200-llama3-8b-decode`` (decode-optimized), ``demo`` (fast,
uncalibrated). Look one up with :func:`get_profile`; derive new ones with
:func:`derive_profile` or ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class Hardware:
    """One accelerator. Units: bytes, bytes/s, FLOP/s."""

    name: str
    hbm_bytes: float
    hbm_bandwidth_bytes_per_s: float
    bf16_dense_flops: float


@dataclass(frozen=True)
class ModelSpec:
    """Decoder-only transformer shape, enough to size weights and the KV cache."""

    name: str
    params: float
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    bytes_per_param: int = 2  # BF16 weights
    kv_bytes_per_elem: int = 2  # BF16 KV cache (vLLM kv_cache_dtype=auto)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, per layer, per KV head, per head dim element.
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.kv_bytes_per_elem


# --- Published figures -------------------------------------------------------------

H100_SXM = Hardware(
    name="H100-SXM5-80GB",
    # 80 GB HBM3 (nvidia-smi shows ~79.6 GiB; we use 80 GiB).
    # https://glennklockwood.com/garden/processors/h100 : "80 GB HBM3 (5 stacks)"
    hbm_bytes=80 * GiB,
    # https://glennklockwood.com/garden/processors/h100 : "3.35 TB/s (max)"
    hbm_bandwidth_bytes_per_s=3.35e12,
    # https://glennklockwood.com/garden/processors/h100 : BF16 Matrix 989.4 TFLOPS (dense)
    bf16_dense_flops=989.4e12,
)

H200_SXM = Hardware(
    name="H200-SXM5-141GB",
    # https://openmetal.io/resources/blog/how-the-h200-is-built-for-memory-bound-ai-workloads/ :
    # "141GB of HBM3e and 4.8 TB/s of memory bandwidth"; same GH100 die as H100, so the
    # same dense BF16 peak (989.4 TFLOPS, glennklockwood link above).
    hbm_bytes=141e9,
    hbm_bandwidth_bytes_per_s=4.8e12,
    bf16_dense_flops=989.4e12,
)

A10G = Hardware(
    name="A10G-24GB",
    # https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/ :
    # "24 gigabytes of GDDR6 VRAM with a memory bandwidth of 600 gigabytes per second"
    hbm_bytes=24 * GiB,
    hbm_bandwidth_bytes_per_s=600e9,
    # Same Baseten page: the A10G has less tensor compute than the A10 (125 TFLOPS FP16
    # tensor, https://www.nucleusbox.com/choose-gpu-for-llms-t4-a10-a100); we use 70 TFLOPS
    # dense FP16/BF16 tensor for the A10G (Baseten's spec table).
    bf16_dense_flops=70e12,
)

A100_SXM_40GB = Hardware(
    name="A100-SXM4-40GB",
    # NVIDIA A100 datasheet: 40 GB HBM2, 1,555 GB/s, BF16 tensor 312 TFLOPS (dense).
    # The card the MEM_EFFICIENCY measurement below was taken on.
    hbm_bytes=40e9,
    hbm_bandwidth_bytes_per_s=1.555e12,
    bf16_dense_flops=312e12,
)

LLAMA3_8B = ModelSpec(
    name="meta-llama/Meta-Llama-3-8B-Instruct",
    # Llama 3 / 3.1 8B: 8.03e9 parameters, 32 layers, hidden 4096, 32 attention heads,
    # 8 KV heads (GQA), head_dim 128 (meta-llama/Meta-Llama-3-8B config.json;
    # https://www.fitmygpu.com/models/llama-3.1-8b : "Layers 32, Hidden size 4,096,
    # Attention heads 32, KV heads 8").
    params=8.03e9,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
)
# => kv_bytes_per_token = 2 * 32 * 8 * 128 * 2 = 131,072 B (128 KiB) per token.

MEM_EFFICIENCY = 0.77
"""Achieved / peak HBM bandwidth for decode. Measured: 75 tok/s single-stream
Llama-3.1-8B on A100-40GB = "roughly 77% of the GPU's memory-bandwidth ceiling"
(https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on)."""

PREFILL_MFU = 0.5
"""ASSUMPTION: model-FLOPs utilization of prefill (compute-bound large-M GEMMs)."""

DECODE_MFU = 0.5
"""ASSUMPTION: FLOPs utilization of the per-sequence GEMM work during decode."""

GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default --gpu-memory-utilization."""

IB_NDR_BYTES_PER_S = 50e9
"""KV-transfer link: one 400 Gb/s InfiniBand NDR port = 50 GB/s
(https://regantih.github.io/reports-lab/tokens-to-embodied-minds/chapters/13-h100-b200-drills.tsv :
"cross-node InfiniBand (~400 Gb/s)")."""

ETHERNET_100G_BYTES_PER_S = 12.5e9
"""KV-transfer link for cloud instances without RDMA: 100 Gb/s Ethernet = 12.5 GB/s
(nominal line rate)."""


@dataclass(frozen=True)
class Profile:
    """Everything the engine needs to emulate one GPU/model/config.

    Units: tokens, blocks, seconds (of emulated GPU time, before the speed factor),
    bytes, bytes/s. ``source`` says where the numbers come from.
    """

    name: str
    gpu: str
    model: str
    role: str  # suggested pool role: "mixed" | "prefill" | "decode"
    block_size: int  # tokens per KV block
    num_gpu_blocks: int  # KV cache capacity in blocks
    max_num_seqs: int  # max running sequences per step
    max_num_batched_tokens: int  # token budget per step (chunked prefill)
    max_model_len: int  # max prompt + output tokens per request
    step_overhead_s: float  # fixed cost of any forward pass (weights read once)
    prefill_s_per_token: float  # GEMM cost of one prefill token
    prefill_attn_s_per_token_pair: float  # attention cost of one (query, key) pair in prefill
    decode_s_per_seq: float  # GEMM cost of one decode token (slope in running sequences)
    kv_read_s_per_token: float  # cost of reading one context token's KV in a step
    kv_bytes_per_token: int  # KV cache bytes per token (all layers)
    link_bandwidth_bytes_per_s: float  # KV transfer link for disaggregated prefill/decode
    source: str = ""

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def kv_transfer_s(self, num_tokens: int) -> float:
        """Seconds to move ``num_tokens`` of KV over the link: bytes / bandwidth."""
        return num_tokens * self.kv_bytes_per_token / self.link_bandwidth_bytes_per_s


def derive_profile(
    name: str,
    hw: Hardware,
    model: ModelSpec,
    *,
    role: str = "mixed",
    block_size: int = 16,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int = 8192,
    activation_reserve_bytes: float = 2 * GiB,
    link_bandwidth_bytes_per_s: float = IB_NDR_BYTES_PER_S,
    mem_efficiency: float = MEM_EFFICIENCY,
    prefill_mfu: float = PREFILL_MFU,
    decode_mfu: float = DECODE_MFU,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    source: str = "",
) -> Profile:
    """Build a :class:`Profile` from hardware and model figures (formulas in the module doc)."""
    eff_bw = hw.hbm_bandwidth_bytes_per_s * mem_efficiency
    kv_tok = model.kv_bytes_per_token
    kv_bytes = hw.hbm_bytes * gpu_memory_utilization - model.weight_bytes - activation_reserve_bytes
    if kv_bytes <= 0:
        raise ValueError(f"{model.name} does not fit on {hw.name}")
    return Profile(
        name=name,
        gpu=hw.name,
        model=model.name,
        role=role,
        block_size=block_size,
        num_gpu_blocks=int(kv_bytes // (kv_tok * block_size)),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        step_overhead_s=model.weight_bytes / eff_bw,
        prefill_s_per_token=2 * model.params / (hw.bf16_dense_flops * prefill_mfu),
        prefill_attn_s_per_token_pair=(4 * model.n_layers * model.n_heads * model.head_dim)
        / (hw.bf16_dense_flops * prefill_mfu),
        decode_s_per_seq=2 * model.params / (hw.bf16_dense_flops * decode_mfu),
        kv_read_s_per_token=kv_tok / eff_bw,
        kv_bytes_per_token=kv_tok,
        link_bandwidth_bytes_per_s=link_bandwidth_bytes_per_s,
        source=source,
    )


# Derived values are given in comments for the README table (rounded):
PROFILES: dict[str, Profile] = {}


def _register(p: Profile) -> Profile:
    PROFILES[p.name] = p
    return p


# H100 + Llama-3-8B, vLLM OpenAI-server defaults for >= 70 GiB GPUs (8192 / 1024).
# step_overhead 6.2 ms (~161 tok/s single stream), prefill 32.5 us/token (~31k tok/s),
# decode slope 32.5 us/seq, KV read 50.8 ns/token, ~28.2k blocks (~451k KV tokens).
H100_LLAMA3_8B = _register(
    derive_profile(
        "h100-llama3-8b",
        H100_SXM,
        LLAMA3_8B,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        source="roofline from H100 SXM spec + measured 77% HBM efficiency; see module doc",
    )
)

# A10G (AWS g5) + Llama-3-8B, vLLM defaults for < 70 GiB GPUs (2048 / 256).
# step_overhead 34.8 ms (~29 tok/s single stream), prefill 459 us/token (~2.2k tok/s),
# ~2.6k blocks (~42k KV tokens); 100 GbE link (g5 has no EFA on most sizes).
A10G_LLAMA3_8B = _register(
    derive_profile(
        "a10g-llama3-8b",
        A10G,
        LLAMA3_8B,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        activation_reserve_bytes=1.5 * GiB,
        link_bandwidth_bytes_per_s=ETHERNET_100G_BYTES_PER_S,
        source="roofline from A10G spec (Baseten) + measured 77% HBM efficiency; see module doc",
    )
)

# A100-40GB + Llama-3.1-8B: the configuration of the published sweep MEM_EFFICIENCY
# comes from (johnmusgrave.com, vLLM 0.23, 1024 in / 128 out, --ignore-eos), kept as a
# calibration reference (docs/results/calibration.md). vLLM defaults for < 70 GiB
# (2048 / 256). step_overhead 13.4 ms (~75 tok/s single stream), prefill 103 us/token.
A100_LLAMA3_8B = _register(
    derive_profile(
        "a100-llama3-8b",
        A100_SXM_40GB,
        LLAMA3_8B,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        activation_reserve_bytes=1.5 * GiB,
        source="roofline from A100 datasheet + measured 77% HBM efficiency (same run); see module doc",
    )
)

# Prefill-optimized (DistServe-style prefill instance, https://arxiv.org/abs/2401.09670):
# the same H100, configured for throughput of long prompts: vLLM's offline (LLM class)
# token budget 16384 so big prompts finish in fewer, fuller steps, and few concurrent
# sequences since it emits one token per request and hands decode off.
H100_LLAMA3_8B_PREFILL = _register(
    derive_profile(
        "h100-llama3-8b-prefill",
        H100_SXM,
        LLAMA3_8B,
        role="prefill",
        max_num_seqs=128,
        max_num_batched_tokens=16384,
        max_model_len=32768,
        source="h100-llama3-8b hardware; LLM_CLASS token budget 16384 (vLLM arg_utils)",
    )
)

# Decode-optimized: H200 (43% more bandwidth, 76% more memory than H100, same compute)
# with a small token budget (512) so prefill chunks barely disturb inter-token latency,
# and many sequences. step_overhead 4.35 ms, ~51.8k blocks (~829k KV tokens).
H200_LLAMA3_8B_DECODE = _register(
    derive_profile(
        "h200-llama3-8b-decode",
        H200_SXM,
        LLAMA3_8B,
        role="decode",
        max_num_seqs=1024,
        max_num_batched_tokens=512,
        max_model_len=32768,
        source="roofline from H200 spec + measured 77% HBM efficiency; small budget for ITL",
    )
)

# Demo: NOT calibrated. Chosen so a laptop shows queueing, prefix hits, eviction and
# preemption within seconds: 12 ms steps (few steps/s to keep Python cheap, ~80 tok/s
# per stream), 40 us per prefill token, a small KV cache (8192 tokens) that fills up.
DEMO = _register(
    Profile(
        name="demo",
        gpu="none",
        model="demo-8b",
        role="mixed",
        block_size=16,
        num_gpu_blocks=512,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        step_overhead_s=0.012,
        prefill_s_per_token=40e-6,
        prefill_attn_s_per_token_pair=1e-11,
        decode_s_per_seq=100e-6,
        kv_read_s_per_token=50e-9,
        kv_bytes_per_token=LLAMA3_8B.kv_bytes_per_token,
        link_bandwidth_bytes_per_s=IB_NDR_BYTES_PER_S,
        source="hand-set for demos; not calibrated",
    )
)


def get_profile(name: str, **overrides) -> Profile:
    """The registered profile ``name``, with optional field overrides.

    Raises KeyError (listing the known names) for an unknown profile.
    """
    try:
        p = PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {sorted(PROFILES)}") from None
    return dataclasses.replace(p, **overrides) if overrides else p
