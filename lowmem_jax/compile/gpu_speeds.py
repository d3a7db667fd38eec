"""The speeds of the shipped GPUs that a step-time floor needs besides memory bandwidth: the
dense bfloat16 tensor-core peak, the PCIe link to the host and NVLink to the other GPUs, each
from the vendor's datasheet (`lowmem_jax.compile.targets.Target` reads them by device kind)."""

from typing import NamedTuple


def pcie_bytes_per_s(generation: int, lanes: int = 16) -> float:
  """One direction of a PCIe link in bytes/s: 8, 16 or 32 GT/s a lane (generations 3, 4, 5;
  PCI-SIG's PCI Express Base Specifications) after 128b/130b line coding. Packet headers take
  some 5-15% of it in practice."""
  return 2**(generation - 3) * 8e9 * lanes * (128 / 130) / 8


class Speeds(NamedTuple):
  """What a step-time floor needs of a GPU besides its memory bandwidth."""
  peak_bf16_flops: float  # dense bfloat16 tensor-core peak, FP32 accumulation, FLOP/s
  host_link_bytes_per_s: float  # the PCIe link to the host, one direction, bytes/s
  # NVLink to the other GPUs, one direction, bytes/s; None: no NVLink, the peers over PCIe
  nvlink_bytes_per_s: float | None = None


# By device kind, so that `from_devices` and `attached` on the same card find them too.
# bfloat16 peaks are dense (NVIDIA's datasheets list twice these "with sparsity") with float32
# accumulation, the only accumulation for bfloat16 and the one XLA's dots use: GeForce cards
# and the A10G run it at half their FP16-accumulate rate, the datacenter and RTX pro cards at
# the full rate.
BY_DEVICE_KIND = {
    # h100: H100 datasheet, SXM5: BF16 1,979 TFLOPS with sparsity; PCIe Gen5 x16 to the host;
    # NVLink 4 900 GB/s a GPU, both directions together (18 links of 25 GB/s each way).
    "NVIDIA H100 80GB HBM3": Speeds(989.4e12, pcie_bytes_per_s(5), 450e9),
    # h200: H200 datasheet, SXM: BF16 1,979 TFLOPS with sparsity (the H100 SXM's die and
    # clocks, HBM3e); PCIe Gen5 x16; NVLink 4 900 GB/s, both directions together.
    "NVIDIA H200": Speeds(989.4e12, pcie_bytes_per_s(5), 450e9),
    # h100-pcie: H100 datasheet, PCIe: BF16 1,513 TFLOPS with sparsity; PCIe Gen5 x16 (its
    # NVLink bridge joins two cards only, so 8 cards talk over PCIe).
    "NVIDIA H100 PCIe": Speeds(756.5e12, pcie_bytes_per_s(5)),
    # a100-40gb, a100-80gb: A100 datasheet, SXM4: BF16 312 TFLOPS dense; PCIe Gen4 x16; NVLink
    # 3 600 GB/s, both directions together.
    "NVIDIA A100-SXM4-40GB": Speeds(312e12, pcie_bytes_per_s(4), 300e9),
    "NVIDIA A100-SXM4-80GB": Speeds(312e12, pcie_bytes_per_s(4), 300e9),
    # b200: Blackwell datasheet, HGX B200 (1,000 W): BF16 4.5 PFLOPS with sparsity a GPU. The
    # GPU's own link is PCIe Gen6 x16, but HGX and DGX B200 hosts are Gen5 (DGX B200 user guide:
    # 2 Xeon 8570, PCIe Gen5), so the link runs at Gen5 x16. NVLink 5: 1.8 TB/s a GPU, both
    # directions together.
    "NVIDIA B200": Speeds(2.25e15, pcie_bytes_per_s(5), 900e9),
    # a6000: RTX A6000 datasheet: tensor 309.7 TFLOPS with sparsity (GA102 whitepaper: 154.8
    # dense, FP32 accumulation at the full rate); PCIe Gen4 x16.
    "NVIDIA RTX A6000": Speeds(154.8e12, pcie_bytes_per_s(4)),
    # v100: no bfloat16 tensor cores (sm_70): XLA computes bfloat16 dots in float32 there, so
    # the floor is the FP32 peak, 15.7 TFLOPS (V100 datasheet, SXM2); PCIe Gen3 x16; NVLink 2
    # 300 GB/s, both directions together.
    "Tesla V100-SXM2-16GB": Speeds(15.7e12, pcie_bytes_per_s(3), 150e9),
    # rtx4090: BF16 tensor with FP32 accumulation 165.2 TFLOPS dense, the Ada whitepaper's
    # appendix figure as third-party tables quote it (330.3 is FP16 with FP16 accumulation;
    # 82.6 the FP32 non-tensor peak); PCIe Gen4 x16.
    "NVIDIA GeForce RTX 4090": Speeds(165.2e12, pcie_bytes_per_s(4)),
    # rtx3090: GA102 whitepaper, appendix: BF16 tensor with FP32 accumulation 71 TFLOPS dense
    # (142 with FP16 accumulation); PCIe Gen4 x16.
    "NVIDIA GeForce RTX 3090": Speeds(71e12, pcie_bytes_per_s(4)),
    # l4: L4 datasheet: BF16 242 TFLOPS with sparsity; PCIe Gen4 x16.
    "NVIDIA L4": Speeds(121e12, pcie_bytes_per_s(4)),
    # a10g: 70 TFLOPS dense tensor (AWS's G5 figures as Baseten's "A10 vs A10G" gives them;
    # = 80 SMs x 512 FLOP a clock at FP32 accumulation x 1.71 GHz); PCIe Gen4 x16 (A10).
    "NVIDIA A10G": Speeds(70e12, pcie_bytes_per_s(4)),
    # l40s: L40S datasheet: BF16 362.05 TFLOPS dense (733 with sparsity); PCIe Gen4 x16.
    "NVIDIA L40S": Speeds(362.05e12, pcie_bytes_per_s(4)),
}
