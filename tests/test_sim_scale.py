"""The flow simulator's scale changes leave its answers unchanged (differential against answers recorded before them).

``tests/data/sim_scale_golden.json`` holds the iteration ends, phase records, event count and per-link bytes of
``tests/sim_scale_case.py``'s mid-size case (256 GPUs, 24 jobs, mixed priorities) as the simulator gave them at
95242e0, before the utilisation recorder kept only the used links and the solver stopped scanning every link.
"""

from __future__ import annotations

import json
import math

from sim_scale_case import GOLDEN, answers, scale_case

from emu.sim import simulate


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)


def test_mid_size_case_gives_the_recorded_answers():
    topo, work = scale_case()
    got, want = answers(simulate(topo, work)), json.loads(GOLDEN.read_text())
    assert got["events"] == want["events"]
    assert got["ends"].keys() == want["ends"].keys()
    for job, ends in want["ends"].items():
        assert len(got["ends"][job]) == len(ends) == 3
        assert all(_close(a, b) for a, b in zip(got["ends"][job], ends, strict=True)), job
    assert len(got["phases"]) == len(want["phases"])
    for a, b in zip(got["phases"], want["phases"], strict=True):
        assert a[:3] == b[:3] and _close(a[3], b[3]) and _close(a[4], b[4])
    # the recorder keeps the used links only: the same links carried the same bytes
    assert got["link_bytes"].keys() == want["link_bytes"].keys()
    assert all(math.isclose(got["link_bytes"][k], v, rel_tol=1e-9) for k, v in want["link_bytes"].items())


def test_network_only_tracking_keeps_the_network_links_of_the_full_record():
    topo, work = scale_case()
    full = simulate(topo, work, record_flows=False).links
    net = simulate(topo, work, record_flows=False, track_links="network").links
    assert set(net.links) == {name for name, kind in zip(full.links, full.kinds, strict=True) if kind == "network"}
    assert set(net.kinds) == {"network"}
    assert simulate(topo, work, record_flows=False, track_links="none").links is None
