"""testkit.server_load: MXNet 1.9's key-to-server rule, and the socket byte counts it measures with."""
import os
import socket
import threading

import psutil
import pytest

from testkit.server_load import imbalance, mlp_keys, server_elements, socket_bytes

pytestmark = pytest.mark.unit


def test_mlp_keys_are_each_layers_weight_then_bias():
    assert mlp_keys(64, (3, 2), 10) == [("dense0_weight", 192), ("dense0_bias", 3), ("dense1_weight", 6),
                                        ("dense1_bias", 2), ("dense2_weight", 20), ("dense2_bias", 10)]


def test_small_keys_go_whole_to_key_times_9973_mod_servers():
    # 9973 % 4 == 1: key k lands on server k % 4; with 3 servers 9973 % 3 == 1 as well.
    assert server_elements([5, 7, 11, 13, 17], 4, bound=100) == [5 + 17, 7, 11, 13]
    assert server_elements([5, 7, 11, 13], 3, bound=100) == [5 + 13, 7, 11]


def test_a_big_array_is_cut_into_one_rounded_part_per_server():
    assert server_elements([10], 4, bound=10) == [3, 2, 3, 2]  # C's round: 2.5 → 3, 5, 7.5 → 8, 10
    assert sum(server_elements([100_000_001], 4)) == 100_000_001


def test_the_100m_mlp_is_even_over_4_servers_and_the_digits_mlp_is_not():
    big = [size for _, size in mlp_keys(64, (10000, 10000), 10)]
    assert imbalance(server_elements(big, 4)) < 1.05
    # The DAG's digits MLP (128, 64): no array reaches the bound, 6 keys on 4 servers.
    small = [size for _, size in mlp_keys(64, (128, 64), 10)]
    assert imbalance(server_elements(small, 4)) > 1.5
    # A bound below its arrays splits them: even again.
    assert imbalance(server_elements(small, 4, bound=1000)) < 1.1


def test_ss_counts_a_loopback_transfer_that_psutil_io_counters_miss():
    n = 5_000_000
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    received, release = threading.Event(), threading.Event()

    def sink():
        conn, _ = srv.accept()
        got = 0
        while got < n:
            got += len(conn.recv(1 << 20))
        received.set()
        release.wait(30)
        conn.close()

    threading.Thread(target=sink, daemon=True).start()
    before = psutil.Process().io_counters()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"x" * n)
        assert received.wait(30)
        counted = psutil.Process().io_counters().write_chars - before.write_chars
        got = socket_bytes({os.getpid()})
        release.set()
    srv.close()
    mine = {k: v for k, v in got.items() if k[1].endswith(f":{port}") or k[2].endswith(f":{port}")}
    assert sorted(rx for rx, _ in mine.values()) == [0, n]
    assert max(tx for _, tx in mine.values()) >= n  # acked bytes (+1 for the SYN)
    assert counted < n  # why ss and not io_counters: socket sends are not write() calls
