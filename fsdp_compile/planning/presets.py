"""Data-sheet clusters (``Cluster.preset``), and which one a GPU is (``Cluster.for_device``).

Every number is per device, from the vendor's data sheet, with its source beside it (``cluster.sources``). FLOP/s are
dense (a data sheet's "with sparsity" figure halved); bandwidths are one way (a data sheet's "bidirectional" figure
halved). Links between nodes vary by cluster: each preset says which it assumes. Latencies are NCCL's ring/Simple tuning
constants (RCCL is assumed to match them on the MI300X). ``reserved_memory`` stands for the CUDA context, the
communication library's buffers and allocator slack.

A GPU is matched by its name and its total memory (``torch.cuda.get_device_properties``): the name picks a family
(``A100``), the memory picks the part (40 or 80 GB), and a device whose memory fits no part of its family matches
nothing rather than the nearest part, whose plan would run out of memory or leave it unused.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from .vocabulary import GB, GBITS, TFLOPS, GiB

_NCCL_LATENCY = ("NCCL src/graph/tuning.cc defaults for ring/Simple (quoted in torch/_inductor/"
                 "comm_analysis.py): base {base} us, {hw} hop {hop} us per step")
_NVLINK_LATENCY = {"intra_node_latency": 3.4e-6, "inter_node_latency": 14e-6, "collective_latency": 8.4e-6}
_PCIE_LATENCY = {"intra_node_latency": 5.7e-6, "inter_node_latency": 14e-6, "collective_latency": 8.4e-6}
_NVLINK_SOURCE = _NCCL_LATENCY.format(base=8.4, hw="NVLink", hop=3.4) + "; network hop 14 us"
_PCIE_SOURCE = _NCCL_LATENCY.format(base=8.4, hw="PCIe", hop=5.7) + "; network hop 14 us"
_RESERVED_LARGE = "assumed: ~2 GiB per GPU for the CUDA context, NCCL buffers and allocator slack"
_RESERVED_SMALL = "assumed: ~1 GiB per GPU for the CUDA context and NCCL buffers"


def _flops(bf16: float, fp32: float, fp8: float | None = None) -> dict[torch.dtype, float]:
    """Dense matmul peaks in TFLOPS; ``fp8`` where the device has float8 tensor cores (both float8 formats run at
    it)."""
    rates = {torch.bfloat16: bf16 * TFLOPS, torch.float16: bf16 * TFLOPS, torch.float32: fp32 * TFLOPS}
    if fp8 is not None:
        rates.update({torch.float8_e4m3fn: fp8 * TFLOPS, torch.float8_e5m2: fp8 * TFLOPS})
    return rates


def _gpu(name: str, memory: float, flops: dict[torch.dtype, float], bandwidth: float, intra: float, inter: float,
         sources: dict[str, str], pcie: bool = False) -> dict[str, Any]:
    """A preset of 8 GPUs per node linked by NVLink (or, ``pcie``, by PCIe), each number's source in ``sources``."""
    return {"name": name, "devices_per_node": 8, "device_memory": memory, "peak_flops": flops,
            "memory_bandwidth": bandwidth, "intra_node_bandwidth": intra, "inter_node_bandwidth": inter,
            **(_PCIE_LATENCY if pcie else _NVLINK_LATENCY), "reserved_memory": (1 if pcie else 2) * GiB,
            "device_type": "cuda", "sources": {
                "latency": _PCIE_SOURCE if pcie else _NVLINK_SOURCE,
                "reserved_memory": _RESERVED_SMALL if pcie else _RESERVED_LARGE, **sources}}


PRESETS: dict[str, dict[str, Any]] = {
    "h100-sxm": _gpu("h100-sxm", 80 * GB, _flops(989, 67, fp8=1979), 3.35e12, 450 * GB, 400 * GBITS, {
        "device_memory": "NVIDIA H100 Tensor Core GPU data sheet (SXM): 80 GB HBM3",
        "peak_flops": "NVIDIA H100 data sheet (SXM): BF16/FP16 tensor 1,979 TFLOPS with sparsity = 989 dense; "
                      "FP32 67 TFLOPS (non-tensor; torch's default fp32 matmul precision); FP8 tensor 3,958 with "
                      "sparsity = 1,979 dense",
        "memory_bandwidth": "NVIDIA H100 data sheet (SXM): 3.35 TB/s",
        "intra_node_bandwidth": ("NVIDIA H100 data sheet: NVLink 900 GB/s per GPU, both directions "
                                 "-> 450 GB/s one way"),
        "inter_node_bandwidth": "assumed: one 400 Gb/s InfiniBand NDR (ConnectX-7) NIC per GPU, as in DGX H100 "
                                "clusters -> 50 GB/s one way"}),
    "h200": _gpu("h200", 141 * GB, _flops(989, 67, fp8=1979), 4.8e12, 450 * GB, 400 * GBITS, {
        "device_memory": "NVIDIA H200 Tensor Core GPU data sheet (SXM): 141 GB HBM3e",
        "peak_flops": "NVIDIA H200 data sheet (SXM): BF16/FP16 tensor 1,979 TFLOPS with sparsity = 989 dense; "
                      "FP32 67 TFLOPS; FP8 tensor 3,958 with sparsity = 1,979 dense",
        "memory_bandwidth": "NVIDIA H200 data sheet (SXM): 4.8 TB/s",
        "intra_node_bandwidth": ("NVIDIA H200 data sheet (SXM): NVLink 900 GB/s per GPU, both directions "
                                 "-> 450 GB/s one way"),
        "inter_node_bandwidth": "assumed: one 400 Gb/s InfiniBand NDR (ConnectX-7) NIC per GPU, as in DGX H200 "
                                "-> 50 GB/s one way"}),
    "b200": _gpu("b200", 180 * GB, _flops(2250, 75, fp8=4500), 8e12, 900 * GB, 400 * GBITS, {
        "device_memory": "NVIDIA HGX B200 data sheet: 1.44 TB of HBM3e over 8 GPUs -> 180 GB per GPU",
        "peak_flops": "NVIDIA HGX B200 data sheet (8 GPUs): FP16/BF16 tensor 36 PFLOPS with sparsity -> 2,250 "
                      "dense per GPU; FP32 600 TFLOPS -> 75 per GPU; FP8 72 PFLOPS with sparsity -> 4,500 "
                      "dense per GPU",
        "memory_bandwidth": "NVIDIA DGX B200 data sheet: 64 TB/s of HBM3e bandwidth over 8 GPUs -> 8 TB/s",
        "intra_node_bandwidth": ("NVIDIA HGX B200 data sheet: fifth-generation NVLink 1.8 TB/s per GPU, both "
                                 "directions -> 900 GB/s one way"),
        "inter_node_bandwidth": "assumed: one 400 Gb/s ConnectX-7 NIC per GPU, as in DGX B200 -> 50 GB/s one way"}),
    "a100-80gb": _gpu("a100-80gb", 80 * GB, _flops(312, 19.5), 2.039e12, 300 * GB, 200 * GBITS, {
        "device_memory": "NVIDIA A100 Tensor Core GPU data sheet (80GB SXM): 80 GB HBM2e",
        "peak_flops": "NVIDIA A100 data sheet: BF16/FP16 tensor 312 TFLOPS dense; FP32 19.5 TFLOPS",
        "memory_bandwidth": "NVIDIA A100 data sheet (80GB SXM): 2,039 GB/s",
        "intra_node_bandwidth": ("NVIDIA A100 data sheet: NVLink 600 GB/s per GPU, both directions "
                                 "-> 300 GB/s one way"),
        "inter_node_bandwidth": ("assumed: one 200 Gb/s InfiniBand HDR NIC per GPU, as in DGX A100 "
                                 "-> 25 GB/s one way")}),
    "a100-40gb": _gpu("a100-40gb", 40 * GB, _flops(312, 19.5), 1.555e12, 300 * GB, 200 * GBITS, {
        "device_memory": "NVIDIA A100 Tensor Core GPU data sheet (40GB SXM): 40 GB HBM2",
        "peak_flops": "NVIDIA A100 data sheet: BF16/FP16 tensor 312 TFLOPS dense; FP32 19.5 TFLOPS",
        "memory_bandwidth": "NVIDIA A100 data sheet (40GB SXM): 1,555 GB/s",
        "intra_node_bandwidth": ("NVIDIA A100 data sheet: NVLink 600 GB/s per GPU, both directions "
                                 "-> 300 GB/s one way"),
        "inter_node_bandwidth": ("assumed: one 200 Gb/s InfiniBand HDR NIC per GPU, as in DGX A100 "
                                 "-> 25 GB/s one way")}),
    "l40s": _gpu("l40s", 48 * GB, _flops(362.05, 91.6, fp8=733), 864 * GB, 32 * GB, 400 * GBITS / 8, {
        "device_memory": "NVIDIA L40S data sheet: 48 GB GDDR6 with ECC",
        "peak_flops": "NVIDIA L40S data sheet: BF16/FP16 tensor 362.05 TFLOPS dense (733 with sparsity); "
                      "FP32 91.6 TFLOPS; FP8 tensor 733 dense (1,466 with sparsity)",
        "memory_bandwidth": "NVIDIA L40S data sheet: 864 GB/s",
        "intra_node_bandwidth": "NVIDIA L40S data sheet: PCIe Gen4 x16, 64 GB/s both directions -> 32 GB/s one "
                                "way (no NVLink)",
        "inter_node_bandwidth": "assumed: AWS G6e.48xlarge (8x L40S), 400 Gb/s networking per node shared by its "
                                "8 GPUs -> 6.25 GB/s per GPU"}, pcie=True),
    "a10g": _gpu("a10g", 24 * GB, _flops(125, 31.2), 600 * GB, 32 * GB, 100 * GBITS / 8, {
        "device_memory": "AWS G5 instance page / NVIDIA A10 data sheet: 24 GB GDDR6 per GPU",
        "peak_flops": "NVIDIA A10 data sheet (the A10G is AWS's variant): BF16/FP16 tensor 125 TFLOPS dense "
                      "(250 with sparsity); FP32 31.2 TFLOPS",
        "memory_bandwidth": "NVIDIA A10 data sheet: 600 GB/s",
        "intra_node_bandwidth": "assumed: PCIe Gen4 x16, 32 GB/s one way (G5.48xlarge has no NVLink)",
        "inter_node_bandwidth": "AWS G5 instance page: 100 Gb/s networking per G5.48xlarge node, shared by its 8 "
                                "GPUs -> 1.56 GB/s per GPU"}, pcie=True),
    "l4": _gpu("l4", 24 * GB, _flops(121, 30.3, fp8=242.5), 300 * GB, 32 * GB, 100 * GBITS / 8, {
        "device_memory": "NVIDIA L4 Tensor Core GPU data sheet: 24 GB GDDR6",
        "peak_flops": "NVIDIA L4 data sheet: BF16/FP16 tensor 242 TFLOPS with sparsity = 121 dense; FP32 30.3 "
                      "TFLOPS; FP8 tensor 485 with sparsity = 242.5 dense",
        "memory_bandwidth": "NVIDIA L4 data sheet: 300 GB/s",
        "intra_node_bandwidth": "NVIDIA L4 data sheet: PCIe Gen4 x16, 64 GB/s both directions -> 32 GB/s one way "
                                "(no NVLink)",
        "inter_node_bandwidth": "assumed: AWS G6.48xlarge (8x L4), 100 Gb/s networking per node shared by its 8 "
                                "GPUs -> 1.56 GB/s per GPU"}, pcie=True),
    "mi300x": _gpu("mi300x", 192 * GB, _flops(1307.4, 163.4, fp8=2614.9), 5.3e12, 448 * GB, 400 * GBITS, {
        "device_memory": "AMD Instinct MI300X data sheet: 192 GB HBM3",
        "peak_flops": "AMD Instinct MI300X data sheet: peak BF16/FP16 matrix 1,307.4 TFLOPS dense (2,614.9 with "
                      "sparsity); FP32 matrix 163.4 TFLOPS; FP8 matrix 2,614.9 dense (5,229.8 with sparsity)",
        "memory_bandwidth": "AMD Instinct MI300X data sheet: 5.3 TB/s",
        "intra_node_bandwidth": ("AMD Instinct MI300X data sheet: 7 Infinity Fabric links of 128 GB/s (both "
                                 "directions) to the other 7 GPUs of an 8-GPU platform, 896 GB/s -> 448 GB/s one "
                                 "way when a collective uses every link"),
        "inter_node_bandwidth": "assumed: one 400 Gb/s NIC per GPU -> 50 GB/s one way",
        "latency": _NCCL_LATENCY.format(base=8.4, hw="NVLink", hop=3.4)
                   + " (assumed for RCCL over Infinity Fabric); network hop 14 us",
        "reserved_memory": "assumed: ~2 GiB per GPU for the HIP context, RCCL buffers and allocator slack"}),
}

# How a device names each preset's GPU (``torch.cuda.get_device_properties(...).name``, lower case), and the names of
# parts with other numbers that the pattern would also catch.
_DEVICE_NAMES: dict[str, tuple[str, str | None]] = {
    "h100-sxm": (r"\bh100\b", r"pcie|\bnvl\b"),  # "NVIDIA H100 80GB HBM3"; not the PCIe or NVL cards
    "h200": (r"\bh200\b", r"\bnvl\b"),  # "NVIDIA H200"; not the H200 NVL (PCIe, lower clocks)
    "b200": (r"\bb200\b", None),
    "a100-80gb": (r"\ba100\b", r"pcie"),  # "NVIDIA A100-SXM4-80GB"
    "a100-40gb": (r"\ba100\b", r"pcie"),  # "NVIDIA A100-SXM4-40GB"
    "l40s": (r"\bl40s\b", None),
    "a10g": (r"\ba10g\b", None),
    "l4": (r"\bl4\b", None),  # "NVIDIA L4" (and not "L40S": no word boundary after "l4" there)
    "mi300x": (r"\bmi300x\b", None),  # "AMD Instinct MI300X" (ROCm)
}

# A device reports a little more or less than its data sheet's capacity (HBM sold as "80 GB" reports 79.1 GiB, 85.0e9
# bytes; GDDR6 sold as "24 GB", 23.8e9): a part matches when the device's total memory is within these ratios of the
# preset's.
MEMORY_RATIOS = (0.9, 1.15)


def preset_for_device(name: str, total_memory: float) -> str | None:
    """The preset of the GPU called ``name`` with ``total_memory`` bytes, or None where no preset describes it (see the
    module docstring)."""
    lowered = name.lower()
    low, high = MEMORY_RATIOS
    matches = []
    for preset, (pattern, other) in _DEVICE_NAMES.items():
        if not re.search(pattern, lowered) or (other and re.search(other, lowered)):
            continue
        ratio = total_memory / PRESETS[preset]["device_memory"]
        if low <= ratio <= high:
            matches.append((abs(ratio - 1.0), preset))
    return min(matches)[1] if matches else None
