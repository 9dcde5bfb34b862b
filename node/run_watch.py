"""One run's watch, for both holders: the hang rule's polls, the straggler verdict, the evidence and the verdict.

`RunWatch` is given how to ask the run's nodes (`ask`: every node's answer to `hang.py status` or `collect`),
how to stop the run (`stop`), how to wait for its end (`ended`), where its lines go (`say`) and its records
(`keep`). fab's watch (remote/hangwatch.py) asks over its SSH sessions; a Slurm-held run's batch job
(node/slurm_watch.py) through srun steps. Everything else is here, once: each poll applies the hang rule
(node/hang_rule.py) and the straggler verdict (node/straggler.py, with its own looks at the shared step
times where the cluster has a shared folder); on a hang it collects every rank's evidence, says the verdict
line, hands the verdict record to `on_verdict`, and stops the run (`on_hang` "stop") or leaves it running.

A watch's own error never ends a run: a poll that fails is said once (the same failure again is not), and
the next poll is made; an error past the polls (the diagnosis) is said once and the run goes on unwatched.

Standard library only: the Slurm batch job runs it on the head node.
"""

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from node import contract, hang_rule, straggler

OVERDUE_GRACE_S = 30
"""Past the hang timeout plus this, a rank still waiting in one collective is a hang even where the rule
has no rank to blame (a node that stopped answering, a transport that stopped moving): the verdict comes
within the timeout + 60 s, polls and evidence included, and a run never waits forever for one."""
STOP_ATTEMPTS = 3
STOP_CHECK_S = 20
"""How long a stopped run may take to end before the watch stops it again (a node that missed the stop)."""


@dataclass(frozen=True)
class WatchPolicy:
    """What the watch looks for and does (`--hang-timeout`, `--on-hang`, `--on-straggler`)."""

    timeout_s: float
    """A rank inside a collective this long while another rank has not entered it is a hang."""
    poll_s: float
    """The regular pause between two polls (sooner where a slow rank is due to be named)."""
    on_hang: str = "stop"
    """stop: end the run everywhere; wait: leave it running for a person."""
    overdue_grace_s: float = OVERDUE_GRACE_S


class RunWatch:
    """Polls one run's ranks until the run ends (`ended` says so) or a hang is found and dealt with."""

    def __init__(
        self,
        run_id: str,
        policy: WatchPolicy,
        ask: Callable[[str], list],
        stop: Callable[[], None],
        ended: Callable[[float], bool],
        say: Callable[[str], None],
        keep: Callable[[str, str], None],
        on_verdict: Callable[[dict], str | None] | None = None,
        read_shared: Callable[[], list] | None = None,
        take_out: Callable[[list], None] | None = None,
        note_prefix: str = "",
    ):
        """`ask(action)`: every node's answer (a dict each) to `status` or `collect`; `ended(timeout_s)`: wait
        up to that long for the run's end, True once it has ended; `say(line)`: a line where the run's
        watcher reads (the verdicts bare, the watch's notes after `note_prefix`); `keep(name, text)`: a record
        into the run's folder; `on_verdict(record)`: the hang's record (`verdict`, `stalled_at`,
        `detected_at`, `collected`) kept, before the run is stopped, and a line to say after the verdict where
        it says one; `read_shared()`: the ranks' shared step times (straggler.SharedLooks); `take_out(fresh)`:
        what `--on-straggler replace` does with the ranks named."""
        self.run_id, self.policy = run_id, policy
        self.ask, self.stop, self.ended, self.say, self.keep = ask, stop, ended, say, keep
        self.on_verdict, self.read_shared, self.take_out = on_verdict, read_shared, take_out
        self.note_prefix = note_prefix
        self.named = straggler.Named()
        """The ranks named slow, each once."""
        self.polls = 0
        """Polls answered: every rank's progress read, no hang found."""
        self.ranks_seen = 0
        """The most ranks one poll found reporting (the run's ranks, once all have started)."""
        self.stopping = False
        """Set once the watch is stopping the run (fail-fast then has nothing to add)."""
        self.failure = ""
        """The last failure said (the same one again is not)."""

    def run(self) -> dict | None:
        """Watch until the run ends; the hang's record where one was found."""
        looks = None
        try:
            if self.read_shared is not None:
                looks = straggler.SharedLooks(self.named, self.read_shared, self._said, self.take_out).start()
            found = self._poll_until_found(looks)
            if looks is not None:
                looks.stop()
            return None if found is None else self._act(found)
        except Exception as exc:  # noqa: BLE001 - the watch's own fault: the run goes on, unwatched
            self._fault(exc, "the run goes on unwatched")
            return None
        finally:
            if looks is not None:
                looks.stop()

    def note(self, text: str) -> None:
        self.say(self.note_prefix + text)

    def _poll_until_found(self, looks: straggler.SharedLooks | None) -> hang_rule.Hang | None:
        """Poll until a hang is found (returned) or the run has ended (None). A poll that fails is simply made
        again. While the straggler verdict's own `looks` find step times, the polls keep their pace (else a
        poll comes sooner where a slow rank is due)."""
        overdue_s = self.policy.timeout_s + self.policy.overdue_grace_s
        regular_s = self.policy.poll_s

        def pause_s() -> float:
            serving = looks is not None and looks.serving()
            return regular_s if serving else self.named.next_look_s(regular_s)

        while not self.ended(pause_s()):
            try:
                payloads = self.ask("status")
                views = [view for payload in payloads for view in hang_rule.parse_ranks(payload)]
                found = hang_rule.find_hang(views, self.policy.timeout_s, overdue_s)
                records = [record for payload in payloads for record in payload.get("ranks", [])]
                fresh = self.named.update(records, self._said)
                if fresh and self.take_out is not None:
                    self.take_out(fresh)
            except Exception as exc:  # noqa: BLE001 - the next poll tries again
                self._fault(exc, "the next poll tries again")
                continue
            self.polls += 1
            self.ranks_seen = max(self.ranks_seen, len(views))
            if found is not None and not self.ended(0):  # a run that has just ended hangs no more
                return found
        return None

    def _act(self, found: hang_rule.Hang) -> dict:
        """The evidence, the verdict said and kept, and the run stopped (or left to a person)."""
        detected_at = time.time()
        collected = self.ask("collect")
        evidence = hang_rule.Evidence.from_collected(collected) if collected else None
        line = hang_rule.verdict(self.run_id, found, evidence)
        record = {
            "verdict": line,
            "stalled_at": hang_rule.stalled_since(found),
            "detected_at": detected_at,
            "collected": collected,
        }
        after = self.on_verdict(record) if self.on_verdict is not None else None
        self.say(line)
        if after:
            self.say(after)
        if self.policy.on_hang != "stop":
            self.note("--on-hang wait: the run keeps running; fab stop ends it")
            return record
        self.stopping = True
        self.note("stopping the hung run on every node (--on-hang wait leaves it running)")
        for attempt in range(STOP_ATTEMPTS):
            self.stop()
            if self.ended(STOP_CHECK_S):
                return record
            self.note(f"the hung run has not ended {STOP_CHECK_S} s after stop {attempt + 1}; stopping it again")
        self.note("could not end the hung run on every node; run fab stop once the nodes answer")
        return record

    def _said(self, fresh: list) -> None:
        """Say each rank the straggler rule names now, and keep the verdict in the run's folder (`fab jobs`)."""
        for found in fresh:
            self.say(found.line(self.run_id))
        self.keep(contract.STRAGGLER_RECORD, self.named.record())

    def _fault(self, exc: Exception, then: str) -> None:
        """The watch's own failure, said once (with where it came from), never blamed on the run's nodes."""
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        failure = f"{type(exc).__name__}: {exc}" + (f" at {where.name} line {where.lineno}" if where else "")
        if failure != self.failure:
            self.note(f"hang watch: {failure}; {then} (the run is not at fault)")
        self.failure = failure
