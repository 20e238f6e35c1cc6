"""Process-group set-up choices that need no GPU to check."""

from __future__ import annotations

from tpserve.parallel.state import NCCL_LOOPBACK_INTERFACE, nccl_loopback_env


def test_a_single_host_nccl_group_bootstraps_on_loopback():
    assert nccl_loopback_env({}) == {"NCCL_SOCKET_IFNAME": NCCL_LOOPBACK_INTERFACE} \
        == {"NCCL_SOCKET_IFNAME": "lo"}
    assert nccl_loopback_env({"NCCL_SOCKET_IFNAME": ""}) == {"NCCL_SOCKET_IFNAME": "lo"}


def test_the_users_interface_is_kept():
    assert nccl_loopback_env({"NCCL_SOCKET_IFNAME": "eth0"}) == {}
    assert nccl_loopback_env({"NCCL_SOCKET_IFNAME": "^docker"}) == {}
