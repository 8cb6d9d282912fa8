"""flowsched.control over loopback: plan round trips, heartbeats, resync, rejection, CURVE authentication."""

import json
import logging
import socket
import time

import pytest
import zmq

from flowsched.control import (
    SCHEDULER_KEY,
    Agent,
    AgentConfig,
    ControlConfig,
    ControlError,
    MessageError,
    Scheduler,
    agent_key_name,
    check_endpoint,
    decode,
    encode,
    generate_keys,
    load_config,
    load_keypair,
    load_public,
)
from flowsched.enforce import DryRunApplier, host_tc_commands
from flowsched.plan import FlowPlan, FlowRule, HostPlan, with_epoch
from topology.schema import load_schema, validator_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def config(tmp_path):
    generate_keys(tmp_path / "keys", ["h0", "h1"])
    return ControlConfig(tmp_path / "keys", f"tcp://127.0.0.1:{free_port()}",
                         {h: AgentConfig(f"tcp://127.0.0.1:{free_port()}") for h in ("h0", "h1")}, heartbeat_s=0.05)


def make_plan(epoch: int) -> FlowPlan:
    return FlowPlan({"h0": HostPlan([FlowRule("a", 0), FlowRule("b", 3, rate=1e6, peer="h1")], link_rate=1.25e7),
                     "h1": HostPlan([FlowRule("a", 1), FlowRule("b", 3, rate=2e6, peer="h0")], link_rate=1.25e7)}, epoch=epoch, policy="t")


def client(ctx, endpoint, *, keys=None, name=None, server_public=None, curve_keys=None):
    """A DEALER to ``endpoint``; CURVE with ``name``'s pair from ``keys`` (or explicit ``curve_keys``) when given."""
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    pair = curve_keys or (load_keypair(keys, name) if name else None)
    if pair is not None:
        s.curve_publickey, s.curve_secretkey = pair
        s.curve_serverkey = server_public
    s.connect(endpoint)
    return s


def recv_json(sock, timeout_ms=2000):
    if not sock.poll(timeout_ms):
        return None
    return json.loads(sock.recv())


def test_plan_round_trip_to_two_agents_with_acks_and_heartbeats(config):
    appliers = {h: DryRunApplier("eth0") for h in ("h0", "h1")}
    with Scheduler(config) as sched, Agent("h0", config, appliers["h0"]) as a0, Agent("h1", config, appliers["h1"]) as a1:
        plan = make_plan(1)
        sched.publish(plan)
        assert sched.wait_acked(1, timeout=5)
        for agent in (a0, a1):
            assert agent.epoch == 1 and agent.applied == [1]
            epoch, lines = appliers[agent.host].applied[0]
            assert epoch == 1 and lines == host_tc_commands(plan, agent.host, "eth0")
        assert sched.wait_for(lambda: all(a.heartbeats >= 2 for a in sched.agents.values()), 5)
        assert sched.alive() == {"h0": True, "h1": True}
        a0.report({"0": 1234.5})
        a1.complete("a")
        assert sched.wait_for(lambda: sched.agents["h0"].reports and sched.agents["h1"].done, 5)
        assert sched.agents["h0"].reports[-1]["rates"] == {"0": 1234.5}
        assert sched.agents["h1"].done[-1]["job"] == "a"
        with pytest.raises(ControlError, match="not newer"):
            sched.publish(make_plan(1))
        assert not sched.rejected and not a0.rejected and not a1.rejected


def test_agent_reports_metered_class_rates(config):
    counter = {"n": 0}

    def meter():
        counter["n"] += 1
        return {"0": 1000.0 * counter["n"], "3": 0.0}

    with Scheduler(config) as sched, Agent("h0", config, DryRunApplier("eth0"), meter=meter):
        assert sched.wait_for(lambda: len(sched.agents["h0"].reports) >= 2, 5)
        rates = sched.agents["h0"].reports[-1]["rates"]
        assert rates["0"] > 0 and rates["3"] == 0.0


def test_restarted_agent_resynchronises(config):
    appliers = {h: DryRunApplier("eth0") for h in ("h0", "h1")}
    with Scheduler(config) as sched, Agent("h1", config, appliers["h1"]):
        with Agent("h0", config, appliers["h0"]):
            sched.publish(make_plan(1))
            assert sched.wait_acked(1, timeout=5)
        sched.publish(make_plan(2))  # h0 is down
        assert sched.wait_acked(2, ["h1"], timeout=5)
        assert sched.agents["h0"].epoch == 1
        fresh = DryRunApplier("eth0")
        with Agent("h0", config, fresh) as again:  # a new process: it holds no plan and says hello with epoch -1
            assert sched.wait_acked(2, ["h0"], timeout=5)
            assert again.applied == [2] and [e for e, _ in fresh.applied] == [2]
        assert [e for e, _ in appliers["h0"].applied] == [1]


def test_malformed_stale_and_misdirected_messages_are_rejected_without_applying(config, caplog):
    applier = DryRunApplier("eth0")
    ctx = zmq.Context()
    try:
        with Agent("h0", config, applier) as agent, caplog.at_level(logging.WARNING, logger="flowsched.control"):
            # the scheduler's own key (as the scheduler would), talking straight to the agent
            s = client(ctx, config.agents["h0"].bind, keys=config.keys, name=SCHEDULER_KEY,
                       server_public=load_public(config.keys, agent_key_name("h0")))
            good = make_plan(5).for_host("h0").to_dict()
            s.send(encode({"type": "plan", "host": "h0", "epoch": 5, "plan": good}))
            assert recv_json(s)["type"] == "ack" and agent.epoch == 5
            bad_plan = json.loads(json.dumps(good))
            bad_plan["hosts"]["h0"]["rules"][1]["priority"] = 9
            half_bad = json.loads(json.dumps(good))
            half_bad["epoch"] = 7
            half_bad["hosts"]["h0"]["rules"].append({"job": "c", "priority": 2, "dscp": 56})  # DSCP of class 0 on class 2
            cases = [
                (b"{not json", "not JSON"),
                (encode({"type": "plan", "host": "h0", "epoch": "6", "plan": good}), "plan.epoch"),
                (encode({"type": "plan", "host": "h1", "epoch": 6, "plan": {**good, "epoch": 6}}), "for host 'h1'"),
                (encode({"type": "plan", "host": "h0", "epoch": 4, "plan": {**good, "epoch": 4}}), "stale"),
                (encode({"type": "plan", "host": "h0", "epoch": 6, "plan": {**bad_plan, "epoch": 6}}), "priority"),
                (encode({"type": "plan", "host": "h0", "epoch": 7, "plan": half_bad}), "DSCP 56"),
                (encode({"type": "plan", "host": "h0", "epoch": 8, "plan": good}), "differs"),
                (encode({"type": "heartbeat", "host": "h0", "epoch": 1, "seq": 1, "time": 0}), "not allowed"),
            ]
            for payload, reason in cases:
                s.send(payload)
                reply = recv_json(s)
                assert reply["type"] == "nack" and reason in reply["reason"], (reason, reply)
            assert agent.epoch == 5 and agent.applied == [5] and len(applier.applied) == 1
            assert len(agent.rejected) == len(cases)
            assert sum("rejected message" in r.getMessage() for r in caplog.records) == len(cases)
            s.close()
    finally:
        ctx.term()


def test_scheduler_rejects_an_agent_speaking_for_another(config):
    ctx = zmq.Context()
    try:
        with Scheduler(config) as sched:
            s = client(ctx, config.scheduler_bind, keys=config.keys, name=agent_key_name("h0"),
                       server_public=load_public(config.keys, SCHEDULER_KEY))
            s.send(encode({"type": "heartbeat", "host": "h1", "epoch": 0, "seq": 1, "time": 0.0}))
            s.send(encode({"type": "plan", "host": "h0", "epoch": 1, "plan": {}}))
            assert sched.wait_for(lambda: len(sched.rejected) == 2, 5)
            assert "key of 'h0'" in sched.rejected[0] and "not allowed" in sched.rejected[1]
            assert sched.agents["h1"].heartbeats == 0
            s.send(encode({"type": "heartbeat", "host": "h0", "epoch": 0, "seq": 1, "time": 0.0}))
            assert sched.wait_for(lambda: sched.agents["h0"].heartbeats == 1, 5)
            s.close()
    finally:
        ctx.term()


_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}


def _handshake_events(mon, seconds):
    """Monitor events until a handshake outcome is known (or ``seconds`` pass)."""
    from zmq.utils.monitor import recv_monitor_message

    events = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (set(events) & (_FAILED | {zmq.EVENT_HANDSHAKE_SUCCEEDED})):
        if mon.poll(50):
            events.append(recv_monitor_message(mon)["event"])
    return events


def test_unauthenticated_and_wrong_key_clients_are_refused(config):
    applier = DryRunApplier("eth0")
    ctx = zmq.Context()
    try:
        with Agent("h0", config, applier) as agent, Scheduler(config) as sched:
            plan = make_plan(1).for_host("h0").to_dict()
            msg = encode({"type": "plan", "host": "h0", "epoch": 1, "plan": plan})
            agent_pub = load_public(config.keys, agent_key_name("h0"))
            stranger = zmq.curve_keypair()
            agent_key_pair = load_keypair(config.keys, agent_key_name("h1"))  # a real key, but not the scheduler's
            for kwargs in ({}, {"curve_keys": stranger, "server_public": agent_pub}, {"curve_keys": agent_key_pair, "server_public": agent_pub}):
                s = client(ctx, config.agents["h0"].bind, **kwargs)
                mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
                s.send(msg, zmq.NOBLOCK)
                assert recv_json(s, 400) is None  # no reply
                events = _handshake_events(mon, 3.0)
                assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events and set(events) & _FAILED  # the connection is never authenticated
                if kwargs:
                    assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in events  # a CURVE client with a key the ZAP handler refuses
                s.disable_monitor()
                mon.close(linger=0)
                s.close()
            # the scheduler's report channel refuses a stranger too
            s = client(ctx, config.scheduler_bind, curve_keys=stranger, server_public=load_public(config.keys, SCHEDULER_KEY))
            s.send(encode({"type": "heartbeat", "host": "h1", "epoch": 0, "seq": 1, "time": 0.0}), zmq.NOBLOCK)  # h1 runs no agent
            time.sleep(0.3)
            s.close()
            assert agent.applied == [] and applier.applied == [] and not agent.rejected
            assert sched.agents["h1"].heartbeats == 0 and sched.agents["h1"].last_seen is None and not sched.rejected
            assert sched.agents["h0"].heartbeats > 0  # while the real agent's key gets through
    finally:
        ctx.term()


def test_config_file_keys_and_endpoints(tmp_path):
    made = generate_keys(tmp_path / "k", ["n0"])
    assert set(made) == {"scheduler", "agent-n0"} and (made["scheduler"][1].stat().st_mode & 0o777) == 0o600
    again = generate_keys(tmp_path / "k", ["n0", "n1"])  # keeps existing pairs
    assert again["scheduler"][0].read_text() == made["scheduler"][0].read_text() and "agent-n1" in again
    cfg = tmp_path / "c.yaml"
    cfg.write_text("format: netweave-flow-control\nversion: 1\nkeys: k\nheartbeat_s: 0.5\nscheduler: {bind: 'tcp://127.0.0.1:5710'}\n"
                   "agents: {n0: {bind: 'tcp://127.0.0.1:5711', dev: eth0, rate_mbit: 100}}\n")
    c = load_config(cfg)
    assert c.keys == tmp_path / "k" and c.agents["n0"].dev == "eth0" and c.heartbeat_s == 0.5
    cfg.write_text(cfg.read_text().replace("tcp://127.0.0.1:5711", "tcp://*:5711"))
    with pytest.raises(ControlError, match=r"agents\.n0\.bind.*every interface"):
        load_config(cfg)
    cfg.write_text(cfg.read_text() + "allow_wildcard: true\n")
    assert load_config(cfg).agents["n0"].bind == "tcp://*:5711"
    cfg.write_text(cfg.read_text().replace("rate_mbit: 100}", "rate_mbit: 100, state: ''}"))
    with pytest.raises(ControlError, match=r"agents\.n0\.state: expected a file name"):
        load_config(cfg)   # an empty name would make the config's directory the state file
    for bad in ("tcp://0.0.0.0:1", "tcp://[::]:1", "udp://x:1"):
        with pytest.raises(ControlError):
            check_endpoint(bad)
    with pytest.raises(MessageError, match="proto"):
        decode(json.dumps({"type": "hello"}).encode())
    assert decode(encode({"type": "hello", "host": "x", "epoch": -1}))["host"] == "x"
    assert with_epoch(make_plan(1), 3).epoch == 3


def test_cli_serve_and_agents_round_trip(tmp_path, capsys):
    import threading

    from flowsched.plan import write_plan
    from netweave.cli import main

    assert main(["flow", "keys", "--out", str(tmp_path / "keys"), "--agents", "h0,h1"]) == 0
    ports = [free_port() for _ in range(3)]
    cfg = tmp_path / "control.yaml"
    cfg.write_text(f"format: netweave-flow-control\nversion: 1\nkeys: keys\nheartbeat_s: 0.05\nscheduler: {{bind: 'tcp://127.0.0.1:{ports[0]}'}}\n"
                   f"agents:\n  h0: {{bind: 'tcp://127.0.0.1:{ports[1]}', dev: veth0, rate_mbit: 100}}\n"
                   f"  h1: {{bind: 'tcp://127.0.0.1:{ports[2]}', dev: veth1, rate_mbit: 100}}\n")
    write_plan(make_plan(3), tmp_path / "p.json")
    codes = {}
    threads = [threading.Thread(target=lambda h=h: codes.__setitem__(h, main(["flow", "agent", "--config", str(cfg), "--host", h, "--dry-run",
                                                                                "--until-applied", "--duration", "10"])))
               for h in ("h0", "h1")]
    for t in threads:
        t.start()
    try:
        assert main(["flow", "serve", "--config", str(cfg), "--plan", str(tmp_path / "p.json"), "--until-acked", "--duration", "10",
                     "--json"]) == 0
    finally:
        for t in threads:
            t.join(15)
    assert codes == {"h0": 0, "h1": 0}
    out = capsys.readouterr().out
    status = json.loads(out[out.index("{\n"):out.index("\n}\n") + 2])
    assert status["epoch"] == 3 and all(a["epoch"] == 3 for a in status["agents"].values())
    assert "applied epochs [3]" in out


def test_failed_apply_is_nacked_and_keeps_the_old_epoch(config):
    calls = []

    def flaky(plan, host):
        calls.append(plan.epoch)
        if plan.epoch == 2:
            raise RuntimeError("tc -batch failed")
        return ["x"]

    with Scheduler(config) as sched, Agent("h0", config, flaky) as agent:
        sched.publish(FlowPlan({"h0": make_plan(1).hosts["h0"]}, epoch=1))
        assert sched.wait_acked(1, timeout=5)
        sched.publish(FlowPlan({"h0": make_plan(2).hosts["h0"]}, epoch=2))
        assert sched.wait_for(lambda: sched.agents["h0"].nacks, 5)
        assert "apply failed" in sched.agents["h0"].nacks[0] and agent.epoch == 1 and agent.applied == [1]
        assert sched.agents["h0"].epoch == 1


@pytest.mark.emulation
def test_agent_installs_the_tree_in_a_namespace(config):
    import subprocess
    import uuid

    from emu.htb import HtbSpec, check_htb_tree
    from flowsched.enforce import TcApplier, class_ceilings, tc_show

    ns = f"nwctl{uuid.uuid4().hex[:6]}"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        for cmd in (["link", "add", "cta", "type", "veth", "peer", "name", "ctb"], ["link", "set", "cta", "up"], ["link", "set", "ctb", "up"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True, capture_output=True)
        applier = TcApplier("cta", 100.0, netns=ns)
        with Scheduler(config) as sched, Agent("h0", config, applier):
            plan = FlowPlan({"h0": make_plan(1).hosts["h0"]}, epoch=1)
            sched.publish(plan)
            assert sched.wait_acked(1, timeout=10)
        texts = [tc_show("cta", w, netns=ns, stats=False) for w in ("qdisc", "class", "filter")]
        problems = check_htb_tree(HtbSpec("cta", 100.0), *texts)
        assert problems == ["cta: class 1:13 ceil 8000000 bit/s, expected 100000000"]  # class 3 paced at 1e6 B/s
        assert class_ceilings("cta", netns=ns)[3] == 8e6
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# -- the acked state is the kernel's; the epoch survives restarts; bounded stores ------------------------------


class FakeKernel:
    """An applier whose kernel is one attribute: ``lose()`` drops the tree as a reboot or an operator's ``tc qdisc del`` would."""

    def __init__(self, *, holds: bool = True):
        self.tree: list[str] | None = None
        self.holds = holds  # False: the kernel never keeps what is applied
        self.installs: list[int] = []

    def __call__(self, plan, host):
        lines = host_tc_commands(plan, host, "eth0")
        self.tree = lines if self.holds else None
        self.installs.append(plan.epoch)
        return lines

    def verify(self, plan, host):
        return [] if self.tree == host_tc_commands(plan, host, "eth0") else ["eth0: root qdisc is None, expected htb"]

    def lose(self):
        self.tree = None


def pusher(ctx, config):
    """A DEALER holding the scheduler's key, talking straight to agent h0 (as the scheduler does)."""
    return client(ctx, config.agents["h0"].bind, keys=config.keys, name=SCHEDULER_KEY, server_public=load_public(config.keys, agent_key_name("h0")))


def push(sock, epoch):
    sock.send(encode({"type": "plan", "host": "h0", "epoch": epoch, "plan": FlowPlan({"h0": make_plan(epoch).hosts["h0"]}, epoch=epoch).to_dict()}))
    return recv_json(sock)


def test_a_repeated_push_is_verified_and_reapplied_only_when_the_kernel_lost_the_tree(config):
    kernel = FakeKernel()
    ctx = zmq.Context()
    try:
        with Agent("h0", config, kernel, verify_s=1000) as agent:
            s = pusher(ctx, config)
            assert push(s, 1) == {"proto": 1, "type": "ack", "host": "h0", "epoch": 1, "commands": len(kernel.tree), "verified": True,
                                  "repaired": False}
            again = push(s, 1)
            assert again["type"] == "ack" and again["commands"] == 0 and again["verified"] and kernel.installs == [1]
            kernel.lose()
            repaired = push(s, 1)
            assert repaired["type"] == "ack" and repaired["commands"] > 0 and repaired["repaired"] and kernel.installs == [1, 1]
            assert agent.epoch == 1 and agent.verified == [1]
    finally:
        ctx.destroy(linger=0)


def test_the_agent_repairs_a_lost_tree_on_its_own_and_reports_what_is_in_force(config):
    kernel = FakeKernel()
    with Scheduler(config) as sched, Agent("h0", config, kernel, verify_s=0.1) as agent:
        sched.publish(FlowPlan({"h0": make_plan(1).hosts["h0"]}, epoch=1))
        assert sched.wait_acked(1, timeout=5)
        kernel.lose()
        assert agent.wait_for(lambda: agent.applied == [1, 1], 5)  # the periodic check applied it again
        assert kernel.tree is not None and agent.epoch == 1
    never = FakeKernel(holds=False)
    with Scheduler(config) as sched, Agent("h0", config, never, verify_s=1000) as agent:
        sched.publish(FlowPlan({"h0": make_plan(2).hosts["h0"]}, epoch=2))
        assert sched.wait_for(lambda: sched.agents["h0"].nacks, 5)
        assert "the kernel does not hold it" in sched.agents["h0"].nacks[0] and never.installs[:2] == [2, 2]  # applied twice, then nacked
        assert agent.epoch == -1 and agent.floor == -1
        assert sched.wait_for(lambda: sched.agents["h0"].heartbeats >= 2, 5) and sched.agents["h0"].epoch == -1


def test_a_refused_plan_is_nacked_and_the_previous_epoch_stays_in_force(config):
    kernel = FakeKernel()

    def refusing(plan, host):
        if plan.epoch == 2:
            raise RuntimeError("tc refused the new tree on a staging device (Illegal \"burst\"); eth0 keeps its previous tree")
        return kernel(plan, host)

    refusing.verify = kernel.verify
    with Scheduler(config) as sched, Agent("h0", config, refusing) as agent:
        sched.publish(FlowPlan({"h0": make_plan(1).hosts["h0"]}, epoch=1))
        assert sched.wait_acked(1, timeout=5)
        sched.publish(FlowPlan({"h0": make_plan(2).hosts["h0"]}, epoch=2))
        assert sched.wait_for(lambda: sched.agents["h0"].nacks, 5)
        assert "keeps its previous tree; epoch 1 stays in force" in sched.agents["h0"].nacks[0]
        assert agent.epoch == 1 and sched.agents["h0"].epoch == 1 and kernel.verify(make_plan(1), "h0") == []


def test_the_epoch_in_force_survives_a_restart(config, tmp_path):
    state = tmp_path / "agent-h0.state.json"
    kernel = FakeKernel()
    ctx = zmq.Context()
    try:
        with Agent("h0", config, kernel, state_path=state):
            s = pusher(ctx, config)
            assert push(s, 1)["type"] == "ack" and push(s, 2)["type"] == "ack"
        saved = json.loads(state.read_text())
        assert (saved["epoch"], saved["floor"], saved["plan"]["epoch"]) == (2, 2, 2)
        assert validator_for(load_schema("flowsched", "flow-agent-state")).is_valid(saved)  # what the agent writes, its schema takes
        with Agent("h0", config, kernel, state_path=state) as again:  # a new process reading the state file
            assert again.epoch == 2 and again.verified == [2] and again.applied == []
            s = pusher(ctx, config)
            stale = push(s, 1)
            assert stale["type"] == "nack" and "stale" in stale["reason"]
            current = push(s, 2)
            assert current["type"] == "ack" and current["commands"] == 0 and again.applied == [] and kernel.installs == [1, 2]
        kernel.lose()
        with Agent("h0", config, kernel, state_path=state) as third:  # the kernel lost the tree while the agent was down
            assert third.epoch == 2 and third.applied == [2] and kernel.installs == [1, 2, 2]
    finally:
        ctx.destroy(linger=0)


def test_a_bad_state_file_is_one_line_naming_the_file(config, tmp_path):
    state = tmp_path / "s.json"
    head = {"format": "netweave-flow-agent-state", "version": 1}
    for text, where in (("{", "invalid JSON"), ('{"format": "x"}', "format"), (b"\xff\xfe", "cannot read"),
                        (json.dumps({**head, "host": "h1", "epoch": 1, "floor": 1, "plan": None}), "host"),
                        (json.dumps({**head, "host": "h0", "epoch": 3, "floor": 1, "plan": None}), "disagree")):
        state.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ControlError, match=where) as exc:
            Agent("h0", config, FakeKernel(), state_path=state)
        assert str(state) in str(exc.value) and "\n" not in str(exc.value)


def test_the_report_store_keeps_the_newest_reports_per_host(config, monkeypatch):
    import tracemalloc

    import flowsched.control as control

    monkeypatch.setattr(control, "MAX_KEPT", 50)
    with Scheduler(config) as sched, Agent("h0", config, DryRunApplier("eth0")) as agent:
        assert sched.wait_for(lambda: sched.agents["h0"].last_seen is not None, 5)  # connected (sends are dropped before)
        for i in range(200):
            agent.report({"0": float(i)})
            if i % 32 == 31:  # within the agent's send high-water mark of 64
                assert sched.wait_for(lambda i=i: sched.agents["h0"].received == i + 1, 10)
        assert sched.wait_for(lambda: sched.agents["h0"].received == 200, 10)
        reports = sched.agents["h0"].reports
        assert len(reports) == 50 and [r["rates"]["0"] for r in reports] == [float(i) for i in range(150, 200)]
        assert sched.status()["agents"]["h0"]["reports"] == 200
    monkeypatch.undo()
    state = control.AgentState()
    msg = {"proto": 1, "type": "report", "host": "h0", "epoch": 1, "rates": {str(p): 1e9 + p for p in range(8)}}
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(100_000):  # the 100k reports
        state.reports.append({**msg, "seq": i})
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(state.reports) == control.MAX_KEPT and grown < 3e6, grown  # ~1 MB for MAX_KEPT = 1000, not +100 MB


@pytest.mark.emulation
def test_agent_killed_and_restarted_refuses_old_plans_and_verifies_the_current(tmp_path):
    """SIGKILL the `netweave flow agent` process, restart it: old epoch refused, current verified (not re-applied), a lost tree re-applied."""
    import signal
    import subprocess
    import sys
    import uuid
    from pathlib import Path

    from flowsched.enforce import verify_tc

    repo = Path(__file__).resolve().parent.parent
    ns = f"nwctl{uuid.uuid4().hex[:6]}"
    generate_keys(tmp_path / "keys", ["h0"])
    ports = [free_port(), free_port()]
    cfg = tmp_path / "control.yaml"
    cfg.write_text(f"format: netweave-flow-control\nversion: 1\nkeys: keys\nheartbeat_s: 0.1\nscheduler: {{bind: 'tcp://127.0.0.1:{ports[0]}'}}\n"
                   f"agents:\n  h0: {{bind: 'tcp://127.0.0.1:{ports[1]}', dev: cta, rate_mbit: 100, netns: {ns}}}\n")
    config = load_config(cfg)
    env = {**__import__("os").environ, "PYTHONPATH": str(repo)}

    def start_agent(seconds):
        return subprocess.Popen([sys.executable, "-m", "netweave.cli", "flow", "agent", "--config", str(cfg), "--host", "h0",
                                 "--duration", str(seconds), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo, env=env)

    plan2 = FlowPlan({"h0": make_plan(2).hosts["h0"]}, epoch=2)
    lines2 = host_tc_commands(plan2, "h0", "cta", rate_mbit=100)
    agent = None
    ctx = zmq.Context()
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        for cmd in (["link", "add", "cta", "type", "veth", "peer", "name", "ctb"], ["link", "set", "cta", "up"], ["link", "set", "ctb", "up"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True, capture_output=True)
        agent = start_agent(60)
        with Scheduler(config) as sched:
            sched.publish(FlowPlan({"h0": make_plan(1).hosts["h0"]}, epoch=1))
            assert sched.wait_acked(1, timeout=20)
            sched.publish(plan2)
            assert sched.wait_acked(2, timeout=10)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        assert json.loads((tmp_path / "agent-h0.state.json").read_text())["epoch"] == 2
        assert verify_tc(lines2, "cta", netns=ns) == []  # the kernel kept the tree; only the agent died
        agent = start_agent(8)
        s = pusher(ctx, config)
        s.send(encode({"type": "plan", "host": "h0", "epoch": 1, "plan": FlowPlan({"h0": make_plan(1).hosts["h0"]}, epoch=1).to_dict()}))
        stale = recv_json(s, 20_000)
        assert stale["type"] == "nack" and "stale" in stale["reason"], stale
        current = push(s, 2)
        assert current["type"] == "ack" and current["commands"] == 0 and current["verified"], current
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "cta", "root"], check=True, capture_output=True)
        repaired = push(s, 2)
        assert repaired["type"] == "ack" and repaired["commands"] == len(lines2) and repaired["repaired"], repaired
        assert verify_tc(lines2, "cta", netns=ns) == []
        out, err = agent.communicate(timeout=30)
        report = json.loads(out[out.index("{"):])
        assert report["applied"] == [2] and 2 in report["verified"] and report["epoch"] == 2, (report, err[-2000:])
    finally:
        ctx.destroy(linger=0)
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.emulation
def test_a_tree_tc_refuses_leaves_the_previous_plan_enforced_and_acked_truthfully(config):
    """The issue's case on a real device: epoch 2's tree is refused by tc; epoch 1's tree stays, and pushing 1 again verifies it."""
    import subprocess
    import uuid

    from flowsched.enforce import TcApplier, verify_tc

    class RefusedAtEpoch2(TcApplier):
        def commands(self, plan, host):  # a tree the plan checks accept but tc refuses (a duplicate class)
            lines = super().commands(plan, host)
            return lines + [f"class add dev {self.dev} parent 1:1 classid 1:10 htb rate 1mbit"] if plan.epoch == 2 else lines

    ns = f"nwctl{uuid.uuid4().hex[:6]}"
    ctx = zmq.Context()
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        for cmd in (["link", "add", "cta", "type", "veth", "peer", "name", "ctb"], ["link", "set", "cta", "up"], ["link", "set", "ctb", "up"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True, capture_output=True)
        applier = RefusedAtEpoch2("cta", 100.0, netns=ns)
        with Agent("h0", config, applier, verify_s=1000) as agent:
            s = pusher(ctx, config)
            assert push(s, 1)["type"] == "ack"
            lines1 = applier.commands(FlowPlan({"h0": make_plan(1).hosts["h0"]}, epoch=1), "h0")
            refused = push(s, 2)
            assert refused["type"] == "nack" and "tc refused the new tree" in refused["reason"] and "epoch 1 stays in force" in refused["reason"]
            assert refused["epoch"] == 1 and agent.epoch == 1 and verify_tc(lines1, "cta", netns=ns) == []
            again = push(s, 1)
            assert again["type"] == "ack" and again["commands"] == 0 and again["verified"], again
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "cta", "root"], check=True, capture_output=True)
            repaired = push(s, 1)
            assert repaired["type"] == "ack" and repaired["repaired"] and verify_tc(lines1, "cta", netns=ns) == []
    finally:
        ctx.destroy(linger=0)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
