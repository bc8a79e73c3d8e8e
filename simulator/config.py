"""Configuration of simulated engines: hardware and model profiles, one engine, the section.

Hardware figures are public peak numbers (dense BF16/FP16 FLOPS, HBM bandwidth and size)
with assumed utilisations; they make relative timings plausible, not exact.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HardwareProfile(_Frozen):
    name: str
    peak_tflops: float = Field(gt=0, description="dense BF16/FP16 TFLOPS of one device")
    hbm_tb_s: float = Field(gt=0, description="HBM bandwidth, TB/s")
    hbm_gb: float = Field(gt=0)
    mfu: float = Field(default=0.45, gt=0, le=1, description="achieved fraction of peak FLOPS")
    mbu: float = Field(default=0.75, gt=0, le=1, description="achieved fraction of HBM bandwidth")
    step_overhead_ms: float = Field(default=2.0, ge=0, description="scheduler + launch cost per step")
    kv_link_gb_s: float = Field(default=25.0, gt=0, description="KV transfer bandwidth between engines (PD)")
    kv_link_latency_ms: float = Field(default=1.0, ge=0)


class ModelProfile(_Frozen):
    name: str
    params_b: float = Field(gt=0, description="parameters, billions")
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    dtype_bytes: int = Field(default=2, gt=0)
    vocab_size: int = Field(default=32_000, gt=32)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.dtype_bytes


HARDWARE: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile(name="h100", peak_tflops=989, hbm_tb_s=3.35, hbm_gb=80, step_overhead_ms=2.0,
                        kv_link_gb_s=50.0),
        HardwareProfile(name="a100", peak_tflops=312, hbm_tb_s=2.0, hbm_gb=80, step_overhead_ms=2.5,
                        kv_link_gb_s=25.0),
        HardwareProfile(name="ascend-910b3", peak_tflops=313, hbm_tb_s=1.6, hbm_gb=64, mfu=0.4,
                        step_overhead_ms=4.0, kv_link_gb_s=25.0),
        HardwareProfile(name="ascend-910b4", peak_tflops=280, hbm_tb_s=0.8, hbm_gb=32, mfu=0.4,
                        step_overhead_ms=4.0, kv_link_gb_s=25.0),
    )
}

MODELS: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        ModelProfile(name="tiny-1b", params_b=1.2, num_layers=16, hidden_size=2048, num_kv_heads=8,
                     head_dim=64),
        ModelProfile(name="llama-3.1-8b", params_b=8.03, num_layers=32, hidden_size=4096, num_kv_heads=8,
                     head_dim=128),
        ModelProfile(name="qwen2.5-7b", params_b=7.6, num_layers=28, hidden_size=3584, num_kv_heads=4,
                     head_dim=128),
        ModelProfile(name="qwen2.5-32b", params_b=32.8, num_layers=64, hidden_size=5120, num_kv_heads=8,
                     head_dim=128),
        ModelProfile(name="llama-3.1-70b", params_b=70.6, num_layers=80, hidden_size=8192, num_kv_heads=8,
                     head_dim=128),
    )
}

Role = Literal["aggregated", "kv_producer", "kv_consumer", "kv_both"]
ROLE_ALIASES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both", "aggregated": "aggregated"}


def resolve_role(value: str) -> str:
    role = ROLE_ALIASES.get(value, value)
    if role not in ("aggregated", "kv_producer", "kv_consumer", "kv_both"):
        raise ValueError(f"unknown role {value!r}: use aggregated, prefill (kv_producer), decode (kv_consumer) "
                         "or kv_both")
    return role


class FaultConfig(_Frozen):
    """Faults of one engine (also settable at run time through ``POST /admin/faults``)."""

    refuse_connections: bool = False
    die_after_tokens: int | None = Field(default=None, ge=0, description="close streams after N tokens")
    slow_factor: float = Field(default=1.0, ge=1.0, description="multiplies every step's duration")
    error_rate: float = Field(default=0.0, ge=0, le=1, description="fraction of requests answered 500")
    recompute_after_tokens: int | None = Field(
        default=None, ge=0, description="a KV consumer ends remote-prefilled requests after N tokens with "
                                        "stop_reason 'recomputed' (vllm-ascend: the decode node lost the KV)")
    fail_generation_after_tokens: int | None = Field(
        default=None, ge=0, description="a generation fails after N tokens, as vLLM answers an output with "
        "finish_reason 'error': a stream ends with an error event (InternalServerError, 500) and [DONE], a whole "
        "answer is a 500 error")
    seed: int = 0


class EngineConfig(_Frozen):
    """One simulated engine."""

    engine_id: str = "engine-0"
    served_model_name: str = "sim-model"
    model_profile: str = "llama-3.1-8b"
    hardware: str = "h100"
    tensor_parallel_size: int = Field(default=1, ge=1)
    block_size: int = Field(default=16, gt=0)
    num_gpu_blocks: int | None = Field(default=None, gt=0, description="default: from HBM size")
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    max_num_seqs: int = Field(default=256, gt=0)
    max_num_batched_tokens: int = Field(default=8192, gt=0)
    max_model_len: int = Field(default=32_768, gt=0)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = "sha256"
    hash_seed: str | None = Field(default=None, description="vLLM's PYTHONHASHSEED; None: 'vllm-none-hash'")
    tokenizer: str | None = Field(default=None, description="None/'simple' or a local tokenizer.json path")
    vocab_size: int | None = Field(default=None, gt=32, description="simple tokenizer vocabulary (default: model's)")
    role: Role = "aggregated"
    kv_transfer_timeout_s: float = Field(default=480.0, gt=0, description="producer keeps blocks this long")
    kv_connector: Literal["nixl", "mooncake", "mooncake_ascend"] = Field(
        default="nixl", description="the KV connector whose PD request fields this engine requires: vLLM's "
        "NixlConnector/P2P flow, upstream vLLM's MooncakeConnector, or vllm-ascend's MooncakeConnectorV1")
    kv_link_gbps: float | None = Field(default=None, gt=0, description="KV transfer bandwidth (GB/s) between "
                                       "engines; None: the hardware profile's interconnect")
    enable_prompt_tokens_details: bool = Field(
        default=True, description="vLLM's --enable-prompt-tokens-details: usage carries prompt_tokens_details "
        "(cached_tokens). vLLM's default is off; the simulator's is on, as the deploy guide asks of real engines "
        "(the router's records and the SLA hit rate read it)")
    emit_kv_events: bool = True
    kv_events_format: Literal["0.33", "0.22", "0.11"] = Field(
        default="0.33", description="the vLLM release whose KV-event wire format and replay protocol to speak")
    faults: FaultConfig = Field(default_factory=FaultConfig)

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data):  # noqa: ANN001
        if isinstance(data, dict) and isinstance(data.get("role"), str):
            data = {**data, "role": resolve_role(data["role"])}
        return data

    @model_validator(mode="after")
    def _known(self) -> "EngineConfig":
        if self.hardware not in HARDWARE:
            raise ValueError(f"unknown hardware profile {self.hardware!r}; known: {', '.join(HARDWARE)}")
        if self.model_profile not in MODELS:
            raise ValueError(f"unknown model profile {self.model_profile!r}; known: {', '.join(MODELS)}")
        return self

    @property
    def hw(self) -> HardwareProfile:
        return HARDWARE[self.hardware]

    @property
    def model(self) -> ModelProfile:
        return MODELS[self.model_profile]

    def resolved_num_gpu_blocks(self) -> int:
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        free = self.hw.hbm_gb * 1e9 * self.tensor_parallel_size * self.gpu_memory_utilization - self.model.weight_bytes
        blocks = int(free // (self.model.kv_bytes_per_token * self.block_size))
        if blocks <= 0:
            raise ValueError(f"{self.model_profile} does not fit on {self.tensor_parallel_size}x {self.hardware}")
        return blocks


class SimSettings(_Frozen):
    """The ``sim`` section of the settings (defaults of ``infernex sim``)."""

    host: str = "127.0.0.1"
    base_port: int = Field(default=8100, ge=0, le=65535)
    kv_events_port_base: int | None = Field(default=None, ge=0, le=65535, description="None: random ports")
    time_scale: float = Field(default=1.0, gt=0, description="virtual seconds per real second")
    engine: EngineConfig = Field(default_factory=EngineConfig)
