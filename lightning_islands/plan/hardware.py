"""Accelerator figures for plans, with their sources, and the step time a FLOP budget gives.

The figures are vendors' public specifications (dense, i.e. without 2:4 sparsity) and this project's
own measurements; each entry says which. Achieved FLOP/s is peak times the model FLOP utilization
(MFU); :data:`DEFAULT_MFU` is what large dense runs report. A higher MFU is the conservative choice
for a link question: faster steps leave less compute to hide a round behind.
"""

from __future__ import annotations

from dataclasses import dataclass

# Llama 3 (arXiv 2407.21783, Table 4): 38-43% BF16 MFU for the 405B model on 8-16K H100s.
DEFAULT_MFU = 0.4
# One 400 Gbit/s InfiniBand NIC (ConnectX-7 NDR) per GPU: what a leader receives at when its island's
# ranks sit on other hosts.
IB_NDR_BYTES_PER_S = 50e9


@dataclass(frozen=True)
class Accelerator:
    """One kind of device: dense BF16 FLOP/s (``None`` where it does not apply), what its leader
    receives over the island's fastest path (NVLink per direction), its codec throughput per fp32
    pass, its memory, and the sources."""

    name: str
    bf16_flops: float | None
    intra_bytes_per_s: float
    leader_bytes_per_s: float
    memory_bytes: float
    source: str


_CODEC = "codec: int4 encode 399 GB/s, decode 457 GB/s on an H200 (docs/BENCHMARKS.md), taken as 300 GB/s a pass"

ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator("H100 SXM", 989e12, 450e9, 300e9, 80e9,
                        "NVIDIA H100 datasheet: 989 TFLOP/s dense BF16 (1,979 with sparsity), NVLink 900 GB/s "
                        f"both directions; {_CODEC}"),
    "h200": Accelerator("H200 SXM", 989e12, 450e9, 300e9, 141e9,
                        f"NVIDIA H200 datasheet: the H100's compute, 141 GB HBM3e, NVLink 900 GB/s; {_CODEC}"),
    "b200": Accelerator("B200 (HGX B200, NVL8)", 2.25e15, 900e9, 300e9, 180e9,
                        "NVIDIA HGX B200: 36 PFLOP/s FP16/BF16 with sparsity for 8 GPUs (2.25 dense per GPU), "
                        f"1.44 TB HBM3e, NVLink 5 1.8 TB/s both directions; {_CODEC} (not yet timed on Blackwell)"),
    "gb200": Accelerator("GB200 (NVL72)", 2.5e15, 900e9, 300e9, 186e9,
                         "NVIDIA GB200 NVL72: 360 PFLOP/s FP16/BF16 with sparsity for 72 GPUs (2.5 dense per GPU), "
                         f"13.4 TB HBM3e, NVLink 5 1.8 TB/s both directions per GPU; {_CODEC} (not yet timed on "
                         "Blackwell)"),
    "cpu": Accelerator("CPU (the 2-core test VM)", None, 1e9, 1.5e9, 8e9,
                       "rough: the codecs' torch path runs 1.3-2.5 GB/s on one thread (docs/BENCHMARKS.md); gloo "
                       "point-to-point inside an island taken as 1 GB/s; measure both before relying on a plan"),
}


def accelerator(name: str) -> Accelerator:
    """The figures of ``name`` (a key of :data:`ACCELERATORS`), or a ValueError listing the known ones."""
    key = name.strip().lower()
    if key not in ACCELERATORS:
        raise ValueError(f"unknown hardware {name!r}: one of {sorted(ACCELERATORS)}, or give the figures "
                         "(--flops, --intra-gbps, --leader-gbps) yourself")
    return ACCELERATORS[key]


def step_seconds(active_params: float, tokens_per_step: float, flops_per_s: float) -> float:
    """Seconds of one inner step: ``6 * active_params * tokens_per_step / flops_per_s`` (forward and
    backward of a transformer; ``flops_per_s`` is what the whole island achieves)."""
    for name, value in (("active parameters", active_params), ("tokens per step", tokens_per_step),
                        ("achieved FLOP/s", flops_per_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 to derive a step time, got {value!r}")
    return 6.0 * active_params * tokens_per_step / flops_per_s
