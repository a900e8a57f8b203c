"""A rank's CUDA device (Zeus's and torch's ``device_id``) and the NVML index clocks go to."""

from __future__ import annotations

import pytest

from protocol.exceptions import ConfigError
from worker_client.gpu.nvml import NVML

FAKE = "tests.fake_nvml"  # four GPUs; GPU i has UUID GPU-0000000i-fake-i


@pytest.fixture
def nvml() -> NVML:
    return NVML(FAKE)


def test_without_cuda_visible_devices_cuda_and_nvml_count_alike(nvml, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [nvml.cuda_to_nvml(i) for i in range(4)] == [0, 1, 2, 3]


def test_indices_and_uuids_in_cuda_visible_devices_map_in_their_order(nvml):
    assert [nvml.cuda_to_nvml(i, "2,0") for i in range(2)] == [2, 0]
    assert nvml.cuda_to_nvml(0, "GPU-00000003-fake-3") == 3
    assert nvml.cuda_to_nvml(1, "1, GPU-00000002") == 2  # a unique prefix, as CUDA takes


def test_a_device_cuda_cannot_see_is_refused_naming_the_variable(nvml):
    with pytest.raises(
        ConfigError,
        match=r"device_id 1 is not a visible CUDA device: "
        r"CUDA_VISIBLE_DEVICES='3' makes 1 visible",
    ):
        nvml.cuda_to_nvml(1, "3")
    with pytest.raises(ConfigError, match="makes 0 visible"):
        nvml.cuda_to_nvml(0, "")
    # CUDA ignores the list from the first entry it cannot read, or that names no GPU.
    with pytest.raises(ConfigError, match="makes 1 visible"):
        nvml.cuda_to_nvml(1, "0,-1,2")
    with pytest.raises(ConfigError, match="makes 1 visible"):
        nvml.cuda_to_nvml(1, "0,7,2")  # four GPUs: there is no 7
    assert nvml.visible_count("3,7,1") == 1 and nvml.visible_count("2,0") == 2


def test_a_uuid_that_names_no_gpu_or_several_and_a_mig_instance_are_refused(nvml):
    with pytest.raises(ConfigError, match=r"GPU-ffff.*matches no GPU"):
        nvml.cuda_to_nvml(0, "GPU-ffff")
    with pytest.raises(ConfigError, match=r"matches GPUs \[0, 1, 2, 3\]"):
        nvml.cuda_to_nvml(0, "GPU-0000000")
    with pytest.raises(ConfigError, match=r"MIG instance MIG-abc.*belong to the whole GPU"):
        nvml.cuda_to_nvml(0, "MIG-abc")
