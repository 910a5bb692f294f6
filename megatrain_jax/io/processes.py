"""How the processes of one run agree on a checkpoint: short messages through the key-value
store of JAX's distributed runtime (the coordination service `jax.distributed.initialize`
starts on the first process).

    peers = Peers.of_this_run()              # None in a run of one process
    peers.tell(f"{key}/written", "ok")       # or the error text
    peers.hear(f"{key}/written", process)    # waits; PeerFailed(text) unless "ok"
    peers.said("stop-request")               # {process: word} told so far; does not wait

Unlike a collective (`multihost_utils.sync_global_devices`), a message needs no device and may
be sent from any thread, so a save can agree while the next steps run. JAX offers the store
only through its runtime client (`jax._src.distributed`), as orbax-checkpoint uses it too.
A process that dies is noticed by the service within its heartbeat timeout (100 s), which then
ends the others; WAIT_S bounds a wait on a process that is alive but stuck.
"""

from __future__ import annotations

import itertools

WAIT_S = 3600.0  # seconds
_made = itertools.count()  # Peers made in this process: the same sequence in every process


class PeerFailed(RuntimeError):
    """Another process said it failed (`said`: the text is its error), or did not answer."""

    def __init__(self, text: str, said: bool = False):
        super().__init__(text)
        self.said = said


class Peers:
    def __init__(self, client, process: int, count: int):
        self.client, self.process, self.count = client, process, count
        self.prefix = f"megatrain/{next(_made)}"
        self.rounds = itertools.count()  # saves agreed on: a fresh name for each, even the
        # same step saved twice

    @classmethod
    def of_this_run(cls) -> Peers | None:
        import jax

        if jax.process_count() == 1:
            return None
        from jax._src import distributed

        return cls(distributed.global_state.client, jax.process_index(), jax.process_count())

    @property
    def main(self) -> bool:
        """Whether this process commits checkpoints: the first."""
        return self.process == 0

    def tell(self, what: str, value: str) -> None:
        self.client.key_value_set(f"{self.prefix}/{what}/{self.process}", value)

    def word(self, what: str, process: int) -> str:
        """Waits for `process`'s word on `what` and returns it; PeerFailed if none comes."""
        try:
            return self.client.blocking_key_value_get(f"{self.prefix}/{what}/{process}",
                                                      int(WAIT_S * 1000))
        except Exception as e:  # the runtime's own error type, from a timeout or a lost service
            raise PeerFailed(f"process {process} did not answer within {WAIT_S:.0f} s "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                             ) from None

    def hear(self, what: str, process: int) -> None:
        """Waits for `process`'s word on `what`; raises PeerFailed unless it is "ok"."""
        value = self.word(what, process)
        if value != "ok":
            raise PeerFailed(value, said=True)

    def said(self, what: str) -> dict[int, str]:
        """The words on `what` the processes have told so far, by process (does not wait)."""
        folder = f"{self.prefix}/{what}/"
        return {int(key[len(folder):]): value
                for key, value in self.client.key_value_dir_get(folder)}

    def hear_all(self, what: str) -> None:
        """Waits for every other process's word on `what` (all of them, so that none is still
        at work when it returns); raises the first failure."""
        failures = []
        for process in range(self.count):
            if process != self.process:
                try:
                    self.hear(what, process)
                except PeerFailed as e:
                    failures.append(e)
        if failures:
            raise failures[0]
