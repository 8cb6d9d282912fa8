"""libnetweave-mark.so rules without root: a Python child under LD_PRELOAD connects to local
listeners on several ports; getsockopt in the child shows the marks each rule gave."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from flowsched import ncclhook

CHILD = textwrap.dedent("""
    import json, socket, sys
    listeners = [socket.socket() for _ in range(3)]
    for l in listeners:
        l.bind(("127.0.0.1", 0)); l.listen(4)
    ports = [l.getsockname()[1] for l in listeners]
    out = {}
    for p in ports:
        c = socket.create_connection(("127.0.0.1", p))
        a, _ = listeners[ports.index(p)].accept()
        out[p] = {"connect": [c.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) >> 2, c.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY)],
                  "accept": [a.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) >> 2, a.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY)]}
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.connect(("127.0.0.1", ports[0]))
    out["udp"] = udp.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)
    print(json.dumps({"ports": ports, "marks": out}))
""")


@pytest.fixture(scope="module")
def build_dir():
    return ncclhook.build()


def run_child(env_extra: dict[str, str]) -> dict:
    env = {**os.environ, **env_extra}
    res = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_env_default_marks_every_tcp_socket_but_not_udp(build_dir):
    out = run_child(ncclhook.marker_env(dscp=46, priority=3, build_dir=build_dir))
    for p in out["ports"]:
        assert out["marks"][str(p)] == {"connect": [46, 3], "accept": [46, 3]}
    assert out["marks"]["udp"] == 0


def test_port_rules_and_plan_rules(build_dir, tmp_path):
    """Port rules from the environment beat plan port rules, which beat the defaults; the plan's `mark *` is the last resort."""
    # rules name ports: the child binds two ports found free here, and a third one the kernel picks
    free = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        free.append(s.getsockname()[1])
        s.close()
    child = CHILD.replace('l.bind(("127.0.0.1", 0))', 'l.bind(("127.0.0.1", PORTS.pop(0)))').replace(
        "listeners = [", f"PORTS = {free + [0]}\nlisteners = [")
    plan = ncclhook.write_plan(ncclhook.FlowPlan(marks=[ncclhook.MarkRule(free[1], 26, 2), ncclhook.MarkRule(None, 8, 1)]),
                               tmp_path / "m.plan")
    env = {**os.environ, **ncclhook.marker_env(ports={free[0]: (48, 6)}, plan=plan, build_dir=build_dir)}
    res = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    a, b, other = (out["marks"][str(p)] for p in out["ports"])
    assert a == {"connect": [48, 6], "accept": [48, 6]}  # NETWEAVE_MARK_PORTS
    assert b == {"connect": [26, 2], "accept": [26, 2]}  # plan "mark <port>"
    assert other == {"connect": [8, 1], "accept": [8, 1]}  # plan "mark *"


def test_marker_env_rejects_bad_values(build_dir):
    with pytest.raises(ncclhook.NcclHookError, match="dscp must be an integer 0..63"):
        ncclhook.marker_env(dscp=64, build_dir=build_dir)
    with pytest.raises(ncclhook.NcclHookError, match="port must be an integer 1..65535"):
        ncclhook.marker_env(ports={0: (1, None)}, build_dir=build_dir)
