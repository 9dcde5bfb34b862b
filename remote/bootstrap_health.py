"""Bootstrap's health and preflight stages: every node reaches MASTER_ADDR:MASTER_PORT, then the preflight job
(harness/fitness.py) all-reduces across every node and measures each; its measurements judged per node
(OK / WARN / CRITICAL, remote/fitness.py)."""

import threading

from remote import fitness, node_paths
from remote.bootstrap_stage import BootstrapBase, Outcome, digest
from remote.connect import describe, on_all_nodes
from remote.job_spec import NodeSetup
from remote.stream import say


class HealthStages(BootstrapBase):
    """The health stage (once across the cluster) and the preflight stage that judges what it measured."""

    fitness: fitness.Fitness | None
    """The preflight the health stage ran (None where health was up to date)."""

    def health(self) -> dict[str, Outcome]:
        wanted = digest([r.stages.get("env", {}).get("digest") for r in self.records], self.manifest, self.master_port)
        if all(self._up_to_date(r, "health", wanted) for r in self.records):
            return {r.name: Outcome("up to date", "all-reduce ok") for r in self.records}
        reachable = self._check_master_reachable()
        if any(o.status == "failed" for o in reachable.values()):
            return reachable
        outcomes = self._check_all_reduce()
        if all(o.status == "done" for o in outcomes.values()):
            on_all_nodes(
                [r.session for r in self.records], lambda s: self._record(self._record_of(s), "health", wanted, {})
            )
        return outcomes

    def _check_master_reachable(self) -> dict[str, Outcome]:
        head = self.records[0]
        address, port = self.cluster.head.private_ip, str(self.master_port)
        listen_command = node_paths.node_module(
            self.cluster, self.python_for(head), "reach", "listen", address, port, str(len(self.records))
        )
        listened = []
        listener = threading.Thread(target=lambda: listened.append(head.session.run(listen_command)))
        listener.start()
        results = on_all_nodes(
            [r.session for r in self.records],
            lambda s: s.run(
                node_paths.node_module(
                    self.cluster, self.python_for(self._record_of(s)), "reach", "connect", address, port
                )
            ),
        )
        listener.join()
        outcomes = {}
        for record, answer in zip(self.records, results, strict=True):
            result = answer.value
            if result is None:
                outcomes[record.name] = Outcome("failed", describe(answer.error))
            elif result.exited != 0:
                why = result.stdout.strip() or result.stderr.strip()[-200:]
                outcomes[record.name] = Outcome("failed", f"cannot reach MASTER_ADDR {address}:{port}: {why}")
            else:
                outcomes[record.name] = Outcome("done", f"reaches {address}:{port}")
        if not listened or listened[0].exited != 0:
            why = listened[0].stderr if listened else "the listener's connection failed"
            outcomes[head.name] = Outcome("failed", f"cannot listen on {address}:{port}", why)
        return outcomes

    def _check_all_reduce(self) -> dict[str, Outcome]:
        """The preflight job (all-reduces across every node, and the fitness measurements the preflight
        stage judges): one job, so that a bootstrap starts torch on the nodes once."""
        setup = NodeSetup(self.master_port, {r.name: self.python_for(r) for r in self.records})
        found = fitness.check(self.cluster, [r.session for r in self.records], setup, self.stack_dir / "bootstrap")
        world = len(self.records)
        outcomes = {}
        for record in self.records:
            why = found.failed.get(record.name)
            if why is None and not found.failed:
                outcomes[record.name] = Outcome("done", f"all-reduce ok ({world} ranks)")
            else:
                outcomes[record.name] = Outcome(
                    "failed",
                    f"all-reduce failed: {why or 'on another node'}",
                    "\n".join(found.tails.get(record.name, [])),
                )
        if not found.failed:
            self.fitness = found
            fitness.save(self.cluster, found)
        return outcomes

    def preflight(self) -> dict[str, Outcome]:
        """Each node's verdict from the health stage's measurements (remote/fitness.py); a CRITICAL node is
        shown, and refused by launches, but bootstrap completes (--skip-preflight can still use it)."""
        found = self.fitness
        if found is None:
            recorded = fitness.recorded(self.cluster)
            return {r.name: Outcome("up to date", recorded.get(r.name, "")) for r in self.records}
        outcomes = {}
        for record in self.records:
            verdict = found.verdicts[record.name]
            gflops = next((n.get("gflops") for n in found.report["nodes"] if n["node"] == record.name), None)
            detail = f"{gflops:.1f} GFLOP/s" if gflops else ""
            status = "done" if verdict.level == "OK" else verdict.level
            outcomes[record.name] = Outcome(status, f"{detail}; {verdict.why()}" if verdict.level != "OK" else detail)
        for verdict in found.critical:
            say(f"bootstrap: preflight: {verdict.node} is CRITICAL ({verdict.why()}): launches refuse it")
        return outcomes
