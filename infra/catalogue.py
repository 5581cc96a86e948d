"""GPU instance types the planner chooses from, as data.

Source: the AWS EC2 instance type pages (aws.amazon.com/ec2/instance-types/g5/, /p3/, /p4/,
/p5/) for GPUs, GPU memory, vCPUs and network bandwidth ("up to N Gbps" is taken as N), NVIDIA's
data sheets (A10G, V100 SXM2, A100 40 GB SXM, H100 SXM) for peak dense TFLOPS, and the EC2
on-demand pricing page (us-east-1, Linux) as listed in 2024 for prices. Prices change (AWS cut
P4d/P5 prices in mid-2024, and regions differ): they are indicative and used only to rank the
instance types against each other. Check the pricing page before budgeting.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpus: int
    gpu: str
    gpu_memory_gib: float  # per GPU
    vcpus: int
    network_gbps: float
    price_per_hour: float  # USD, on-demand
    tflops_fp32: float  # peak per GPU
    tflops_fp16: float  # peak dense tensor-core per GPU

    def tflops(self, precision: str) -> float:
        return self.tflops_fp16 if precision == "fp16" else self.tflops_fp32


def _g5(name: str, gpus: int, vcpus: int, gbps: float, price: float) -> InstanceType:
    return InstanceType(name, gpus, "A10G", 24.0, vcpus, gbps, price, 31.2, 125.0)


def _p3(name: str, gpus: int, vcpus: int, gbps: float, price: float) -> InstanceType:
    return InstanceType(name, gpus, "V100", 16.0, vcpus, gbps, price, 15.7, 125.0)


CATALOGUE: tuple[InstanceType, ...] = (
    _g5("g5.xlarge", 1, 4, 10, 1.006),
    _g5("g5.2xlarge", 1, 8, 10, 1.212),
    _g5("g5.4xlarge", 1, 16, 25, 1.624),
    _g5("g5.8xlarge", 1, 32, 25, 2.448),
    _g5("g5.12xlarge", 4, 48, 40, 5.672),
    _g5("g5.16xlarge", 1, 64, 25, 4.096),
    _g5("g5.24xlarge", 4, 96, 50, 8.144),
    _g5("g5.48xlarge", 8, 192, 100, 16.288),
    _p3("p3.2xlarge", 1, 8, 10, 3.06),
    _p3("p3.8xlarge", 4, 32, 10, 12.24),
    _p3("p3.16xlarge", 8, 64, 25, 24.48),
    InstanceType("p4d.24xlarge", 8, "A100", 40.0, 96, 400, 32.7726, 19.5, 312.0),
    InstanceType("p5.48xlarge", 8, "H100", 80.0, 192, 3200, 98.32, 67.0, 989.0),
)


def by_name(name: str) -> InstanceType:
    for it in CATALOGUE:
        if it.name == name:
            return it
    raise KeyError(f"unknown instance type {name!r}; known: {[it.name for it in CATALOGUE]}")
